"""How long process 0 waits in jaxtrain.runtime.heartbeat.leave before it ends the coordination service
(whose end aborts every other process): a peer whose heartbeat still beats gets up to
distributed.peer_timeout_s (60 s at most), a silent one 5 s and a heartbeat interval. At a normal
end (end_run), the others say they are done only as their process's last act, after its exit
handlers, and process 0 waits for that word. A fake coordination client records the waits instead of
making them."""
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
from jax._src import distributed as jd

from jaxtrain.runtime import heartbeat, outlive


class Client:
    def __init__(self, gone: set[int]):
        self.set, self.waits, self.gone = {}, {}, gone

    def key_value_set(self, key, value, allow_overwrite=False):
        self.set[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        peer = int(key.rsplit("/", 1)[-1])
        self.waits[peer] = timeout_ms
        if peer not in self.gone:
            raise TimeoutError(key)  # what the real client raises is a JaxRuntimeError: anything goes
        return "2"


def leave(monkeypatch, pid: int, seen_ago: dict[int, float], timeout: float, gone=()) -> Client:
    client = Client(set(gone))
    monkeypatch.setattr(jd, "global_state", SimpleNamespace(client=client, process_id=pid, num_processes=4))
    now = time.monotonic()
    beat = SimpleNamespace(interval=2.0, timeout=timeout, seen={p: ("x", now - ago) for p, ago in seen_ago.items()})
    monkeypatch.setitem(heartbeat._heartbeat, "current", beat)

    def exit_(code):
        raise SystemExit(code)
    monkeypatch.setattr(heartbeat.os, "_exit", exit_)
    with pytest.raises(SystemExit) as out:
        heartbeat.leave(2)
    assert out.value.code == 2
    return client


def test_process_0_waits_longer_for_a_peer_that_still_beats(monkeypatch):
    # peer 1 beat 1 s ago (beating), peer 2 10 s ago (silent: more than two intervals), peer 3 not
    # heard from yet (given the benefit of the doubt, as a peer that joined may not have beaten yet).
    client = leave(monkeypatch, 0, {1: 1.0, 2: 10.0}, timeout=30.0)
    assert client.set == {"jaxtrain/exit/0": "2"}
    assert 29_000 < client.waits[1] <= 30_000  # peer_timeout_s
    assert 6_000 < client.waits[2] <= 7_000  # 5 s + one interval, counted from when leave began
    assert 29_000 < client.waits[3] <= 30_000


def test_the_wait_for_a_beating_peer_is_60_s_at_most_and_one_that_left_ends_it(monkeypatch):
    client = leave(monkeypatch, 0, {1: 0.5, 2: 0.5, 3: 0.5}, timeout=600.0, gone={1, 2, 3})
    assert 59_000 < client.waits[1] <= 60_000
    assert set(client.waits) == {1, 2, 3}  # each answered at once: the fake does not sleep


def test_other_processes_only_say_they_leave(monkeypatch):
    client = leave(monkeypatch, 2, {0: 0.1}, timeout=30.0)
    assert client.set == {"jaxtrain/exit/2": "2"} and client.waits == {}


class Beat:
    """The parts of a Heartbeat that end_run and last_word use; ``finished`` says the word."""

    def __init__(self, pid: int, client: Client, said: list):
        self.pid, self.n, self.timeout, self.client, self.said = pid, 3, 30.0, client, said
        self.ended = False

    def finished(self):
        self.said.append(self.pid)


def test_at_a_normal_end_the_others_say_done_last_and_process_0_waits_for_it(monkeypatch):
    monkeypatch.setattr(heartbeat.atexit, "unregister", lambda fn: None)  # not this test process's handlers
    slept = []
    monkeypatch.setattr(heartbeat.time, "sleep", slept.append)
    said: list = []
    other = Beat(1, Client(set()), said)
    monkeypatch.setitem(heartbeat._heartbeat, "current", other)
    heartbeat.end_run()
    assert said == []  # not yet: process 0 could end the service while this one still runs its exit handlers
    heartbeat.last_word()
    assert said == [1]
    client = Client(gone={1, 2})
    monkeypatch.setitem(heartbeat._heartbeat, "current", Beat(0, client, said))
    heartbeat.end_run()
    assert said == [1, 0] and set(client.waits) == {1, 2} and slept == [outlive.GRACE_S]  # the fake store names no host
    heartbeat.last_word()  # process 0 said it in end_run; a run that did not end normally says nothing here
    assert said == [1, 0]


def test_exit_now_says_the_last_word_after_the_exit_handlers():
    code = textwrap.dedent("""
        import atexit, sys
        from jaxtrain.runtime import heartbeat, outlive
        from jaxtrain.cli.common import exit_now
        atexit.register(lambda: print("exit handler"))
        heartbeat.last_word = lambda: sys.stderr.write("last word after: " + repr(sys.stdout.getvalue()) + "\\n")
        import io
        sys.stdout = io.StringIO()  # what was printed when the word is said: the exit handler's line too
        print("row")
        exit_now(3)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stderr.strip().endswith("last word after: 'row\\nexit handler\\n'")
