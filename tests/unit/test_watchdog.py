"""The hang watchdog's message: the limit and the wait as given, not rounded to whole seconds."""
import re
import threading

from jaxtrain.runtime.watchdog import Watchdog, seconds


class NeverReady:
    def is_ready(self) -> bool:
        return False


def test_seconds_keep_what_a_sub_second_limit_says():
    assert [seconds(x) for x in (0.001, 0.25, 3.0, 3.26, 9.94, 10.0, 125.4)] == [
        "0.001", "0.25", "3", "3.3", "9.9", "10", "125"]


def test_a_sub_second_limit_is_named_as_set(tmp_path):
    messages, hung = [], threading.Event()

    def on_hang(message: str) -> None:
        messages.append(message)
        hung.set()

    dog = Watchdog(0.001, tmp_path, on_hang=on_hang, poll_s=0.01)
    dog.begin("the train step", step=7).until(NeverReady())
    assert hung.wait(10)
    dog.close()
    found = re.match(r"train\.hang_timeout_s: the train step at step 7 made no progress for ([\d.]+) s "
                     r"\(limit 0\.001 s\); the process is alive but stuck", messages[0])
    assert found and float(found.group(1)) >= 0.001, messages[0]
    assert (tmp_path / "hang_stacks.process0.txt").is_file()


def test_a_compile_past_its_own_limit_is_named_by_its_key(tmp_path):
    messages, hung = [], threading.Event()

    def on_hang(message: str) -> None:
        messages.append(message)
        hung.set()

    dog = Watchdog(None, tmp_path, on_hang=on_hang, poll_s=0.01)
    dog.begin_compile("the evaluation's compile", None).end()  # finished: retired, never limited
    dog.begin_compile("the train step's compile", 0.05)  # never ends
    assert hung.wait(10)
    dog.close()
    found = re.match(r"train\.compile_timeout_s: the train step's compile did not finish in ([\d.]+) s "
                     r"\(limit 0\.05 s\): the compiler is stuck, or this program needs a longer limit "
                     r"\(raise train\.compile_timeout_s; null: no limit\)\. Every thread's Python stack is in ",
                     messages[0])
    assert found and float(found.group(1)) >= 0.05, messages[0]
    assert (tmp_path / "hang_stacks.process0.txt").is_file()


def test_a_compile_without_a_limit_is_only_described(tmp_path):
    hung = threading.Event()
    dog = Watchdog(None, tmp_path, on_hang=lambda message: hung.set(), poll_s=0.01)
    work = dog.begin_compile("the train step's compile", None)
    assert not hung.wait(0.3)
    assert dog.waiting_for().startswith("the train step's compile (")
    work.end()
    assert dog.waiting_for() == ""
    dog.close()


def test_the_automatic_limit_outlasts_the_naming_of_a_dead_peer(tmp_path, monkeypatch):
    """With the default timeouts the automatic hang limit (300 s at least) and distributed.peer_timeout_s
    (300 s) expired together: a process waiting in a collective for a SIGKILLed peer said first that it was
    'alive but stuck'. The automatic limit now ends past the heartbeat's own deadline."""
    import types

    from jaxtrain.runtime import heartbeat, watchdog
    dog = Watchdog(None, tmp_path, on_hang=lambda message: None, poll_s=0.01)
    try:
        assert dog.limit(1) == watchdog.HANG_FLOOR_S  # one process: as before
        beat = types.SimpleNamespace(timeout=300.0, interval=5.0)  # the defaults' heartbeat
        monkeypatch.setitem(heartbeat._heartbeat, "current", beat)
        assert heartbeat.detection_s() == 305.0
        assert dog.limit(1) == 305.0 + watchdog.HANG_MARGIN_S and dog.limit(2) == 2 * (305.0 + watchdog.HANG_MARGIN_S)
        fixed = Watchdog(120.0, tmp_path, on_hang=lambda message: None)
        assert fixed.limit(1) == 120.0  # a limit set is kept
        fixed.close()
    finally:
        dog.close()
