"""A real single-node SLURM cluster for the tests, from Debian's packages (slurmctld, slurmd,
slurm-client, munge; ``.ci/run`` installs them).

Everything lives in one short temporary directory under /tmp (unix socket paths are limited to
107 characters): a private ``munged -F`` with its own key and socket, a ``slurm.conf`` with free
ports, no accounting, no cgroups (``proctrack/linuxproc``, ``task/none``), then
``slurmctld -D -c -i`` and ``slurmd -D -N <node>`` in the background. ``FirstJobId`` is random
because JAX derives its coordinator port from the job id (61440 + id % 4096): two test runs on
one machine must not pick the same port. Teardown stops each daemon by its PID.

Every client command (sbatch, srun, scontrol) needs ``SLURM_CONF``: :attr:`SlurmCluster.env`.
Jobs run as root and inherit the submitter's environment.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import portpicker
import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing_binaries() -> list[str]:
    """The SLURM/munge programs this machine lacks (empty when the cluster can start)."""
    return [b for b in (*DAEMONS, "sbatch", "srun", "scontrol") if shutil.which(b) is None]


def _node_name() -> str:
    """This machine's host name when it resolves to a loopback address (srun resolves node names), else localhost."""
    name = socket.gethostname().split(".")[0]
    try:
        if socket.gethostbyname(name).startswith("127."):
            return name
    except OSError:
        pass
    return "localhost"


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as dead (PID 1 may reap slowly here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class SlurmCluster:
    """Starts munged, slurmctld and slurmd on this machine; :meth:`stop` ends them by PID."""

    def __init__(self, cpus: int = 4, timeout_s: float = 30):
        self.dir = Path(tempfile.mkdtemp(prefix="jts", dir="/tmp"))
        self.node = _node_name()
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.first_job_id = random.randint(1000, 60000)
        try:
            self._start(cpus, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, cpus: int, timeout_s: float) -> None:
        d = self.dir
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)  # munged refuses a key others can read
        sock = d / "munge.sock"
        self._spawn("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                               f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                               f"--seed-file={d / 'munged.seed'}"])
        self._wait(lambda: sock.exists(), timeout_s, "munged did not create its socket")
        ctld_port, d_port = portpicker.pick_unused_port(), portpicker.pick_unused_port()
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        self.conf.write_text("\n".join([
            "ClusterName=jt",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={d_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={sock}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # the node may claim more CPUs than this 2-core machine has
            f"FirstJobId={self.first_job_id}",
            "MinJobAge=600",  # finished jobs stay visible to `scontrol show job` (there is no accounting)
            "InactiveLimit=0",
            "KillWait=5",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])
        self._wait(self._node_idle, timeout_s, "the node did not become idle")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "wb")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=self.env, start_new_session=True))
        log.close()

    def _node_idle(self) -> bool:
        out = subprocess.run(["scontrol", "show", "node", self.node], env=self.env, capture_output=True,
                             text=True, timeout=10).stdout
        return "State=IDLE" in out

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} (exited: {dead or 'none'})\n{self.logs()}")
            time.sleep(0.2)

    def run(self, *cmd: str, stdin: Optional[str] = None, timeout: float = 30) -> subprocess.CompletedProcess:
        """Runs a SLURM client command against this cluster (``stdin``: text for its standard input)."""
        return subprocess.run(list(cmd), env=self.env, input=stdin, capture_output=True, text=True, timeout=timeout)

    def job_state(self, job_id: str) -> str:
        """``JobState`` of a job from ``scontrol show job`` (PENDING, RUNNING, COMPLETED, FAILED, ...)."""
        out = self.run("scontrol", "show", "job", job_id).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job_id: str, timeout_s: float) -> str:
        """Waits until the job has ended; returns its final state (or the last one seen at the timeout)."""
        deadline = time.monotonic() + timeout_s
        state = self.job_state(job_id)
        while state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN") \
                and time.monotonic() < deadline:
            time.sleep(0.5)
            state = self.job_state(job_id)
        return state

    def logs(self) -> str:
        """The daemons' log tails, for failure messages."""
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "munged.out", "slurmctld.out", "slurmd.out"):
            path = self.dir / name
            if path.is_file():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Stops the daemons by PID (slurmd, slurmctld, then munged), then removes the directory."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            self._reap(proc)
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _reap(proc: subprocess.Popen, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while _alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(proc.pid):
            proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope="module")
def slurm_cluster():
    """A running single-node cluster (:class:`SlurmCluster`) for one test module.

    Missing binaries skip the tests on a developer machine and fail them under CI (CI=true),
    where ``.ci/run`` installs the packages.
    """
    missing = missing_binaries()
    if missing:
        msg = f"SLURM not installed (missing {', '.join(missing)}): apt-get install slurmctld slurmd slurm-client munge"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    cluster: Optional[SlurmCluster] = SlurmCluster()
    yield cluster
    cluster.stop()
