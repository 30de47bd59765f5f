"""A real ``mlflow server`` for the tests: a SQLite store and local artifacts on 127.0.0.1, one per
session. ``conftest`` starts it as soon as the session knows that a selected test needs it, so that its
~10 s start (the CLI and its worker each import mlflow) overlaps the tests that run before; the tests
use names of their own (experiments, registered models), so they can share it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


class MlflowServer:
    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="jaxtrain-mlflow-"))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        exe = Path(sys.executable).parent / "mlflow"
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
        self.log = self.root / "server.log"
        with open(self.log, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [str(exe), "server", "--backend-store-uri", f"sqlite:///{self.root / 'db.sqlite'}",
                 "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1", "--port",
                 str(port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        self.ready = False

    def wait(self, timeout_s: float = 120) -> str:
        """The server's URL once ``/health`` answers OK; RuntimeError with its log after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while not self.ready:
            try:
                self.ready = urllib.request.urlopen(f"{self.url}/health", timeout=1).read() == b"OK"
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    log = self.log.read_text(errors="replace")[-2000:]
                    self.stop()
                    raise RuntimeError(f"mlflow server did not start within {timeout_s} s: {log}") from None
                time.sleep(0.5)
        return self.url

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 2 s (its graceful stop took ~4 s); the store is removed."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        shutil.rmtree(self.root, ignore_errors=True)
