"""Process 0 hosts jax.distributed's coordination service, whose end aborts any other process still
alive (signal 6). Two real jax.distributed processes on 127.0.0.1; process 1 is held up for 1.5 s
between its last word (a key in the service's store) and its os._exit, as a process descheduled on a
loaded machine was (test_multiprocess saw exit -6 instead of 2). Process 0 must outlive it, both when
the run is refused (heartbeat.leave) and when it ends normally (end_run, last_word)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import portpicker
import pytest

from jaxtrain.runtime import outlive

REPO = Path(__file__).resolve().parents[2]
DELAY_S = 1.5  # past outlive.GRACE_S: only watching process 1 end keeps it from being aborted

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import jax
    from jax._src import distributed as jd
    pid, port, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=60, heartbeat_timeout_seconds=70)
    from jaxtrain.runtime import heartbeat
    beat = heartbeat._heartbeat["current"] = heartbeat.Heartbeat(10.0)
    real = jd.global_state.client

    class Slow:  # process 1 is held up right after its last word
        def __getattr__(self, name):
            return getattr(real, name)

        def key_value_set(self, key, value, allow_overwrite=False):
            real.key_value_set(key, value, allow_overwrite=allow_overwrite)
            if key.startswith(("jaxtrain/exit/", "jaxtrain/done/")):
                time.sleep(float(os.environ["DELAY_S"]))

    if pid == 1:
        jd.global_state.client = beat.client = Slow()
    if how == "leave":
        heartbeat.leave(2)
    heartbeat.end_run()
    heartbeat.last_word()
    os._exit(0)
""")


def run_pair(tmp_path: Path, how: str) -> list[int]:
    script = tmp_path / "pair.py"
    script.write_text(SCRIPT)
    port = portpicker.pick_unused_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DELAY_S": str(DELAY_S), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(script), str(p), str(port), how], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for p in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs]
    assert codes[1] != -6, f"process 1 was aborted when process 0 ended:\n{outs[1][-3000:]}"
    return codes


@pytest.mark.parametrize("how, codes", [("leave", [2, 2]), ("end", [0, 0])])
def test_process_0_outlives_a_peer_held_up_after_its_last_word(tmp_path, how, codes):
    assert run_pair(tmp_path, how) == codes


def test_a_local_peer_is_watched_until_it_ends_and_a_remote_one_gets_the_grace(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])
    host, namespace, _ = outlive.identity().split("|")

    class Store:
        def key_value_dir_get(self, prefix):
            return [(f"{prefix}1", f"{host}|{namespace}|{child.pid}"), (f"{prefix}2", f"elsewhere|{namespace}|1")]

    slept = []
    real_sleep = outlive.time.sleep
    monkeypatch.setattr(outlive.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    assert outlive.outlive(Store(), [1]) == []
    assert child.poll() is not None or outlive.gone(child.pid)  # ended (a zombie until reaped counts)
    assert outlive.GRACE_S not in slept  # process 1 is local: watched, no blind margin
    slept.clear()
    assert outlive.outlive(Store(), [2]) == [] and slept == [outlive.GRACE_S]
    child.wait()
    assert outlive.gone(child.pid)
    assert not outlive.gone(os.getpid())


def test_a_local_peer_still_running_at_the_limit_is_returned():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        host, namespace, _ = outlive.identity().split("|")

        class Store:
            def key_value_dir_get(self, prefix):
                return [(f"{prefix}1", f"{host}|{namespace}|{child.pid}")]
        assert outlive.outlive(Store(), [1], limit_s=0.3) == [child.pid]
    finally:
        child.kill()
        child.wait()
