"""What ``auto`` resolved to (``model.attention``, ``model.matmul``, ``model.grouped_matmul``,
``optimizer.implementation``): each decision said once per process, and every one of a run kept for its
run directory (``resolved.json``, written by the trainer).

Once: the main thread and the precompile thread (``jaxtrain.train.precompile``) trace programs at the
same time; with a check of the set and then an add in each, both logged the same line (seen on warm
starts). So the check and the add are one step under a lock.
"""
from __future__ import annotations

import logging
import threading
from typing import Hashable, Optional

log = logging.getLogger("jaxtrain")

_lock = threading.Lock()
_decided: dict[str, dict[str, list[str]]] = {}  # key -> {choice: [reasons]}, in the order first met
_said: set[str] = set()  # the lines said through say() by this process


def first(seen: set, item: Hashable) -> bool:
    """True the first time ``item`` goes into ``seen`` (the caller's set), atomically across threads."""
    with _lock:
        if item in seen:
            return False
        seen.add(item)
        return True


def decided(seen: set, key: str, choice: str, reason: str) -> bool:
    """Records that ``key`` (e.g. 'model.matmul') resolved to ``choice`` because of ``reason`` (one key may
    resolve to several: the matmul per product); True the first time this process meets the pair (log it)."""
    _record(key, choice, reason)
    return first(seen, (choice, reason))


def say(logger: logging.Logger, level: int, message: str) -> bool:
    """``logger.log(level, message)`` unless this process said ``message`` through here already; True if
    said. Why: a program loaded from jaxtrain's program cache repeats the lines its tracing said
    (``jaxtrain.train.program_cache``), and this process's tracing of another program may say them too:
    both printed them (seen on warm starts where one program was cached and another was not)."""
    with _lock:
        if message in _said:
            return False
        _said.add(message)
    logger.log(level, message)
    return True


def mark_said(messages) -> None:
    """Counts ``messages`` as said by this process (lines its tracing printed, which a loaded program's
    stored lines repeat)."""
    with _lock:
        _said.update(messages)


def auto_kernel(seen: set, key: str, problem: Optional[str], fallback: str, fits: str) -> str:
    """What ``auto`` resolves ``key`` to where jaxtrain's kernel is one choice: 'cpu_fused' where ``problem``
    (why the kernel cannot take it) is None, for the reason ``fits``, else ``fallback``; recorded, and
    logged once per reason."""
    choice, reason = (fallback, f"cpu_fused: {problem}") if problem else ("cpu_fused", fits)
    if decided(seen, key, choice, reason):
        say(log, logging.INFO, f"{key}=auto -> {choice} ({reason})")
    return choice


def _record(key: str, choice: str, reason: str) -> None:
    with _lock:
        reasons = _decided.setdefault(key, {}).setdefault(choice, [])
        if reason not in reasons:
            reasons.append(reason)


def decisions() -> dict[str, dict[str, list[str]]]:
    """The decisions recorded since :func:`forget`: ``{key: {choice: [reasons]}}`` (the matmul, say, can
    resolve to one choice for several reasons, one per product size)."""
    with _lock:
        return {key: {choice: list(reasons) for choice, reasons in choices.items()}
                for key, choices in _decided.items()}


def merge(decisions: dict) -> None:
    """Adds decisions recorded by another process (a program loaded from jaxtrain's program cache was
    traced there, not here); anything malformed is skipped."""
    for key, choices in (decisions.items() if isinstance(decisions, dict) else ()):
        for choice, reasons in (choices.items() if isinstance(choices, dict) else ()):
            for reason in (reasons if isinstance(reasons, list) else ()):
                if isinstance(key, str) and isinstance(choice, str) and isinstance(reason, str):
                    _record(key, choice, reason)


def forget() -> None:
    """Starts a new run's record (what the process logged stays logged)."""
    with _lock:
        _decided.clear()
