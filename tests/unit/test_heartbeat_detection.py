"""A dead peer is named within ``distributed.peer_timeout_s`` plus one heartbeat interval of its death, and
never before it has been silent for ``peer_timeout_s``: the heartbeat's own schedule, replayed on a fake
clock against a stand-in of the coordination service's store (5eb7ae3 took up to the timeout plus 13 s,
and with the default timeouts the hang watchdog spoke first)."""
import pytest

from jaxtrain.runtime import heartbeat


class Store:
    """The coordination service's key-value store, as the heartbeat uses it."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value, allow_overwrite=True):
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise RuntimeError("NOT_FOUND")
        return self.kv[key]


class Named(Exception):
    pass


def watcher(monkeypatch, timeout: float) -> tuple[heartbeat.Heartbeat, float]:
    """Process 0's heartbeat of a 2-process job as it starts, its thread replaced: (it, its cadence in s)."""
    import types

    from jax._src import distributed
    monkeypatch.setattr(distributed, "global_state",
                        types.SimpleNamespace(client=Store(), process_id=0, num_processes=2))
    cadence = []
    monkeypatch.setattr(heartbeat, "_every", lambda seconds, stop, tick, name: cadence.append(seconds))
    beat = heartbeat.Heartbeat(timeout)
    return beat, cadence[0]


def named_at(monkeypatch, timeout: float, death: float, start: float) -> tuple[float, float, str]:
    """Replays process 0's heartbeat against a peer that beats every interval (from 0.7 s) and dies at
    ``death``; process 0's thread starts at ``start`` and waits its cadence after each look, which takes
    0.37 s of RPCs. Returns (when the peer was named, its last beat, the message)."""
    beat, cadence = watcher(monkeypatch, timeout)
    clock, named = [0.0], []

    def die(message, code=heartbeat.EXIT_CODE):
        named.append((clock[0], message))
        raise Named

    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(heartbeat, "die", die)
    peer_beats = [k * beat.interval + 0.7 for k in range(100000) if k * beat.interval + 0.7 < death]
    look = start
    with pytest.raises(Named):
        while look < death + 3 * timeout:
            look += cadence
            clock[0] = look
            beats = sum(t <= look for t in peer_beats)
            if beats:
                beat.client.key_value_set("jaxtrain/alive/1", str(beats))
            beat._tick(look)
            look += 0.37
    return named[0][0], peer_beats[-1], named[0][1]


@pytest.mark.parametrize("timeout", [30.0, 300.0])
def test_a_dead_peer_is_named_within_the_timeout_and_one_interval(monkeypatch, timeout):
    interval = min(5.0, timeout / 6)
    worst = 0.0
    for death in [3 * interval + 0.7 + d * interval / 10 for d in range(10)]:  # just after a beat ... before the next
        for start in [s * interval / 8 for s in range(8)]:  # where process 0's looks fall between the peer's beats
            at, last, message = named_at(monkeypatch, timeout, death, start)
            assert at - last >= timeout  # silent for the whole timeout before it is named
            assert message.startswith("distributed.peer_timeout_s: process 1 of 2 sent no heartbeat for ")
            worst = max(worst, at - death)
    assert worst <= timeout + interval  # and named within one interval more
