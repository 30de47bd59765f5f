"""A real local Ray cluster for the tests: ``ray start --head --block`` on 127.0.0.2.

Not 127.0.0.1: Ray replaces that (and ``localhost``) with the machine's interface address, and the
whole cluster would then listen and connect there; any other loopback address keeps the cluster
address, the node manager and every connection on 127.0.0.0/8. Every port Ray would otherwise fix
(the client server's 10001, the dashboard's 8265, the agents') is a free one, so two test runs on
one machine never collide; usage stats are off; CPUs are bounded; everything Ray writes lives in one
short temporary directory (Ray's unix sockets are under it), which is also the daemons' ``HOME``: it holds
a ``ray_bootstrap_config.yaml`` naming a local provider, because without one Ray's dashboard asks the cloud
metadata server (169.254.169.254) which cloud it runs on, usage stats or not. ``--block`` keeps ``ray start`` as the
parent of every daemon, in a session of its own: :meth:`RayCluster.stop` ends that session's
processes by their ids (the daemons, the Ray workers and the training processes they started).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import portpicker

NODE_IP = "127.0.0.2"


def _session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (zombies count as dead)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session, ...
            pids.append(int(entry))
    return pids


class RayCluster:
    """A one-node Ray cluster with ``cpus`` CPUs; ``address`` is what ``ray.init`` and ``--address`` take."""

    def __init__(self, cpus: int = 4, timeout_s: float = 90, attempts: int = 2):
        # On two loaded cores Ray's control store (GCS) has missed its own RPC deadline during `ray start`
        # ("Failed to get node info ... Deadline Exceeded"); a second start, on fresh ports, has come up.
        for attempt in range(1, attempts + 1):
            try:
                self._start(cpus, timeout_s)
                return
            except RuntimeError:
                if attempt == attempts:
                    raise

    def _start(self, cpus: int, timeout_s: float) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="jtr", dir="/tmp"))  # short: unix socket paths
        ports = {name: portpicker.pick_unused_port() for name in (
            "port", "ray-client-server-port", "dashboard-port", "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port", "node-manager-port",
            "object-manager-port")}
        self.address = f"{NODE_IP}:{ports['port']}"
        home = self.dir / "home"
        home.mkdir()
        (home / "ray_bootstrap_config.yaml").write_text("provider:\n  type: local\n")
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HOME": str(home)}
        self.log = self.dir / "ray-start.log"
        ray = str(Path(sys.executable).parent / "ray")
        cmd = [ray, "start", "--head", "--block", f"--node-ip-address={NODE_IP}", f"--num-cpus={cpus}", "--num-gpus=0",
               "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.dir}",
               *(f"--{name}={value}" for name, value in ports.items())]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait(timeout_s)
        except RuntimeError:
            log = self.log.read_text(errors="replace")[-3000:]
            self.stop()
            raise RuntimeError(f"ray start did not come up within {timeout_s} s:\n{log}") from None
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while "Ray runtime started" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("ray start did not come up")
            time.sleep(0.2)

    def stop(self) -> None:
        """Ends every process of the cluster's session by its id: SIGTERM, then SIGKILL after 5 s."""
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for pid in _session_pids(self.proc.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + grace
            while _session_pids(self.proc.pid) and time.monotonic() < end:
                time.sleep(0.1)
            if not _session_pids(self.proc.pid):
                break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def worker_pids(self, rank: int) -> list[int]:
        """The ``jaxtrain.train`` process(es) of Ray worker ``rank`` now running (from their environment)."""
        found = []
        for pid in _session_pids(self.proc.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"jaxtrain.train" in cmdline and f"JAXTRAIN_RAY_WORLD_RANK={rank}".encode() in environ:
                found.append(pid)
        return found


def parent_of(pid: int) -> int:
    """The parent process id of ``pid`` (for a training process: its Ray worker)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
