"""Process 0 ends only after the processes it waited for have ended.

Process 0 hosts ``jax.distributed``'s coordination service, and a live client whose service goes
away aborts its process (signal 6, ``Terminating process because the JAX distributed service
detected fatal errors``). The other processes say their last word (a key in the service's store)
just before ``os._exit``; a peer descheduled between the two on a loaded machine was aborted when
process 0 ended at once (``tests/integration/test_multiprocess.py`` saw exit -6 instead of 2).

So every process announces where it runs (:func:`announce`), and process 0, having heard a peer's
word, waits until that process is gone (:func:`outlive`): on the same host and in the same PID
namespace it watches ``/proc/<pid>`` (Linux), bounded by ``limit_s``; for a peer elsewhere it can
only wait :data:`GRACE_S`.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Iterable

GRACE_S = 0.5  # for a peer on another host: a margin, chosen and not measured
LIMIT_S = 5.0  # the longest process 0 watches a local peer that said its word
_KEY = "jaxtrain/proc/"


def identity() -> str:
    """``host|pid-namespace|pid`` of this process (the namespace is empty where /proc has none)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}|{namespace}|{os.getpid()}"


def announce(client, process_id: int) -> None:
    """Records this process's :func:`identity` in the coordination service's store."""
    client.key_value_set(f"{_KEY}{process_id}", identity(), allow_overwrite=True)


def gone(pid: int) -> bool:
    """The local process ``pid`` has ended: no ``/proc/<pid>``, or a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def outlive(client, peers: Iterable[int], limit_s: float = LIMIT_S) -> list[int]:
    """Waits until each of ``peers`` (process ids that said their last word) has ended: local ones
    are watched for at most ``limit_s`` in all, and :data:`GRACE_S` is waited for when any of them
    runs elsewhere or did not announce itself. Returns the local peers still running at the limit."""
    peers = list(peers)
    if not peers:
        return []
    try:
        known = {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get(_KEY)}
    except Exception:  # noqa: BLE001 - a store that cannot answer: treat every peer as remote
        known = {}
    host, namespace, _ = identity().split("|")
    local, remote = [], False
    for p in peers:
        parts = known.get(p, "").split("|")
        if len(parts) == 3 and parts[0] == host and parts[1] == namespace and namespace and parts[2].isdigit():
            local.append(int(parts[2]))
        else:
            remote = True
    end = time.monotonic() + limit_s
    while local and time.monotonic() < end:
        local = [pid for pid in local if not gone(pid)]
        if local:
            time.sleep(0.01)
    if remote:
        time.sleep(GRACE_S)
    return local
