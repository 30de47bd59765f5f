"""The run's train step and evaluation, compiled from their shapes on a thread of their own while the
main thread builds the state (the init program, or a restore).

With a warm compile cache, compiling still costs: on the shakespeare-char config (2-core AMD EPYC)
tracing the train step takes ~0.45 s and loading each cached executable ~0.2 s, and much of the
loading, like the init program and a restore's reads, leaves the interpreter free for the other
thread. The train step compiled here is used only when the built state and the first batch have
exactly the shapes, dtypes and shardings it was compiled for; otherwise the loop compiles it from
the real arrays as before. The evaluation is compiled only to fill the caches its first call reads.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import jax

from jaxtrain.train.assembly import Setup

log = logging.getLogger("jaxtrain")


def signature(tree: Any) -> tuple:
    """What a compiled program checks of its arguments: tree structure, and per leaf shape, dtype,
    weak type and sharding (of arrays or ShapeDtypeStructs alike)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, [(x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding) for x in leaves]


class Precompile:
    """Starts compiling at once, on a daemon thread (an exit never waits for it).

    Args:
      s: the run's setup; its ``abstract_state``/``abstract_batch`` give the train step's shapes.
      val: the validation batches as host arrays ``{field: [n_batches, micro, ...]}`` (None: no
        evaluation to prepare).
    """

    def __init__(self, s: Setup, val: Optional[dict] = None):
        self._step_ready, self._eval_ready = threading.Event(), threading.Event()
        self._step: Any = None
        self._inputs: Optional[tuple] = None  # the signature of (state, batch) compiled for
        self._error: Optional[BaseException] = None
        self.seconds = 0.0  # tracing, lowering and compiling the train step
        threading.Thread(target=self._run, args=(s, val), name="jaxtrain-precompile", daemon=True).start()

    def _run(self, s: Setup, val: Optional[dict]) -> None:
        state = None
        try:
            t0 = time.perf_counter()
            state, batch = s.abstract_state(), s.abstract_batch()
            self._inputs = signature((state, batch))
            self._step = s.fns.train_step.lower(state, batch).compile()
            self.seconds = time.perf_counter() - t0
        except BaseException as err:  # noqa: BLE001 - raised on the main thread by train_step()
            self._error = err
        finally:
            self._step_ready.set()
        try:
            if state is not None and val:
                sharding = s.fns.batch_sharding
                shaped = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in val.items()}
                s.fns.evaluate.lower(state["params"], shaped).compile()
        except Exception as err:  # noqa: BLE001 - the evaluation's own call compiles again and raises it
            log.debug("precompiling the evaluation failed: %s", err)
        finally:
            self._eval_ready.set()

    def train_step(self, state: dict, batch: dict) -> Any:
        """The compiled train step (a ``TrainStep``) once ready, or None when ``state`` or ``batch``
        differs from what it was compiled for.

        Raises:
          whatever tracing or compiling the step raised (e.g. ShardingError).
        """
        self._step_ready.wait()
        if self._error is not None:
            raise self._error
        return self._step if signature((state, batch)) == self._inputs else None

    def wait_evaluation(self) -> None:
        """Until the evaluation's compile (if any) finished: its first call then finds it cached
        instead of compiling it a second time alongside."""
        self._eval_ready.wait()
