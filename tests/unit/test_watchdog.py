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
