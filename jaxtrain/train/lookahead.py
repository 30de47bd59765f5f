"""The loop's batches with one fetched ahead, on a thread where the step runs on the loop's own."""
from __future__ import annotations

import concurrent.futures
from typing import Any, Iterator, Optional


class Lookahead:
    """The loop's batches with one fetched ahead: :meth:`fetch` assembles the next batch while the
    devices run a step (with ``train.log_every=1`` the host would otherwise assemble it while they
    sit idle). Called once a step is dispatched; where the step runs inline on the loop's thread (a
    kernel provider says so: a single-process CPU run) it is called before the step instead,
    with ``threaded``: a thread of its own then draws the batch while the step runs. That fetch had
    followed the step: ~0.9 ms a shakespeare-char batch just after a step (0.24 ms alone: the step
    leaves the caches cold); drawn on a thread, the logged step took 0.975x and 0.99x the time and
    the whole run 0.99x and 0.97x (two A/Bs of 4 and 5 alternated CLI rounds, 2-core Intel Xeon).
    :meth:`get_state` is the position of the next batch the loop will take, the held (or pending)
    one included, so a checkpoint resumes with it."""

    def __init__(self, inner: Iterator, threaded: bool = False):
        self.inner = inner
        self.held: Optional[tuple[dict, Any]] = None  # (the inner iterator's state before it, the batch)
        self.pending: Optional[concurrent.futures.Future] = None  # the same, being drawn on the thread
        self.threaded = threaded
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "jaxtrain-batches") if threaded else None

    def _draw(self) -> tuple[dict, Any]:
        state = self.inner.get_state()
        return state, next(self.inner)

    def _settle(self) -> None:
        """Waits for a batch being drawn (its error, if any, is raised here)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.held = pending.result()

    def fetch(self) -> None:
        if self.held is not None or self.pending is not None:
            return
        if self._pool is not None:
            self.pending = self._pool.submit(self._draw)
        else:
            self.held = self._draw()

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        self._settle()
        if self.held is None:
            return next(self.inner)
        batch, self.held = self.held[1], None
        return batch

    def get_state(self) -> dict:
        self._settle()
        return self.held[0] if self.held is not None else self.inner.get_state()

    def set_state(self, state: dict) -> None:
        self._settle()
        self.held = None
        self.inner.set_state(state)

    def close(self) -> None:
        """Ends the thread (after the batch it may be drawing)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
