"""The run's train step, evaluation and sample, compiled from their shapes on a thread of their own
while the main thread builds the state (the init program, or a restore).

With a warm compile cache, compiling still costs: on the shakespeare-char config (2-core AMD EPYC)
tracing the train step takes ~0.45 s and loading each cached executable ~0.2 s, and much of the
loading, like the init program and a restore's reads, leaves the interpreter free for the other
thread. The train step compiled here is used only when the built state and the first batch have
exactly the shapes, dtypes and shardings it was compiled for, and when compiling it ahead worked;
otherwise the loop compiles it from the real arrays as before (and a bad config raises its named
error there, on the main thread). Where a kernel provider supplies compiled programs (the ``cpu``
provider's program cache, ``jaxtrain.kernels.provider_hooks.compiled``), the train step and the evaluation
are loaded from there instead of traced, and the loop calls the evaluation compiled here; otherwise the
evaluation, like the sample, is compiled only to fill the caches its first call reads.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import jax

from jaxtrain.kernels import hooks as provider_hooks
from jaxtrain.train import sample as generation
from jaxtrain.train.assembly import Setup

log = logging.getLogger("jaxtrain")


def signature(tree: Any) -> tuple:
    """What a compiled program checks of its arguments: tree structure, and per leaf shape, dtype,
    weak type and sharding (of arrays or ShapeDtypeStructs alike)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, [(x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding) for x in leaves]


THREAD_NAME = "jaxtrain-precompile"


class Precompile:
    """Starts compiling at once, on a thread of its own: the train step, then the evaluation, then
    the sample.

    Not a daemon thread: at its end a Python process waits for a compile in flight, where tearing
    the interpreter down under it aborted the process (exit 134, "FATAL: exception not rethrown").
    The command line ends with ``os._exit`` and does not wait (``jaxtrain.cli.common.exit_now``).
    :meth:`cancel` skips what has not started.

    Args:
      s: the run's setup; its ``abstract_state``/``abstract_batch`` give the train step's shapes.
      val: the validation batches as host arrays ``{field: [n_batches, micro, ...]}`` (None: no
        evaluation to prepare).
      sample: ``(n_tokens, seq_len, temperature)`` of the sample the run ends with (None: none).
    """

    def __init__(self, s: Setup, val: Optional[dict] = None, sample: Optional[tuple] = None):
        self._ready = {name: threading.Event() for name in ("step", "evaluation", "sample")}
        self._cancelled = threading.Event()
        self._step: Any = None
        self._inputs: Optional[tuple] = None  # the signature of (state, batch) compiled for
        self._evaluate: Any = None  # the evaluation, when the program cache made it
        self._eval_inputs: Optional[tuple] = None  # the signature of (params, batches) it was made for
        self.seconds = 0.0  # tracing, lowering and compiling the train step
        threading.Thread(target=self._run, args=(s, val, sample), name=THREAD_NAME).start()

    def _run(self, s: Setup, val: Optional[dict], sample: Optional[tuple]) -> None:
        try:
            self._compile_all(s, val, sample)
        finally:  # whatever ended the thread, no caller waits for it forever
            for ready in self._ready.values():
                ready.set()

    def _compile_all(self, s: Setup, val: Optional[dict], sample: Optional[tuple]) -> None:
        state = None
        try:
            t0 = time.perf_counter()
            state, batch = s.abstract_state(), s.abstract_batch()
            self._inputs = signature((state, batch))
            self._step = (provider_hooks.compiled(s, "train_step", state, batch)
                          or s.fns.train_step.lower(state, batch).compile())
            self.seconds = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001 - the loop compiles the step itself and raises it there
            self._step = None
            log.debug("precompiling the train step failed: %s", err)
        finally:
            self._ready["step"].set()
        # Only to fill the caches the first calls read: a failure here is the call's to raise again.
        if state is not None and val and not self._cancelled.is_set():
            sharding = s.fns.batch_sharding
            n = next(iter(val.values())).shape[0]
            piece = s.fns.eval_piece(n)  # the loop evaluates piece by piece (put_validation)
            shaped = {k: jax.ShapeDtypeStruct((piece, *v.shape[1:]), v.dtype, sharding=sharding)
                      for k, v in val.items()}
            self._warm("evaluation", lambda: self._compile_evaluation(s, state["params"], shaped))
        self._ready["evaluation"].set()
        if state is not None and sample is not None and not self._cancelled.is_set():
            self._warm("sample", lambda: generation.compile_ahead(s.fns.apply, state["params"], *sample))
        self._ready["sample"].set()

    def _compile_evaluation(self, s: Setup, params: Any, batches: dict) -> None:
        self._evaluate = provider_hooks.compiled(s, "evaluate", params, batches)
        if self._evaluate is None:  # only the compile cache: the first call reads it
            s.fns.evaluate.lower(params, batches).compile()
        else:
            self._eval_inputs = signature((params, batches))

    @staticmethod
    def _warm(name: str, compile_fn) -> None:
        try:
            compile_fn()
        except Exception as err:  # noqa: BLE001 - see _run
            log.debug("precompiling the %s failed: %s", name, err)

    def train_step(self, state: dict, batch: dict) -> Any:
        """The compiled train step (a ``TrainStep``) once ready; None when compiling it failed, or
        when ``state`` or ``batch`` differs from what it was compiled for."""
        self._ready["step"].wait()
        if self._step is None:
            return None
        return self._step if signature((state, batch)) == self._inputs else None

    def evaluation(self, params: Any, batches: dict) -> Any:
        """The evaluation program a provider supplied (``jaxtrain.kernels.provider_hooks.compiled``), once ready;
        None when it did not, or when ``params`` or ``batches`` differ from what it was made for."""
        self._ready["evaluation"].wait()
        if self._evaluate is None:
            return None
        return self._evaluate if signature((params, batches)) == self._eval_inputs else None

    def cancel(self) -> None:
        """The run ended (or failed): compiles not yet started are skipped; one in flight finishes."""
        self._cancelled.set()

    def wait(self, name: str) -> None:
        """Until the compile of ``name`` ('evaluation' or 'sample') finished, if it was asked for:
        the first call then finds it cached instead of compiling it a second time alongside."""
        self._ready[name].wait()
