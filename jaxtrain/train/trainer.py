"""``fit``: train a config's model family, or any Flax NNX model, on the config's mesh and rules.

Everything is validated before anything is written or compiled (``jaxtrain.train.assembly``).
Rerunning with the same ``run.dir`` resumes from the latest committed checkpoint: model,
optimizer, step, RNG and data position.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
from jax.sharding import NamedSharding

from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.config import Config
from jaxtrain.data import tokenizers
from jaxtrain.errors import CheckpointError, CorruptCheckpointError
from jaxtrain.kernels import hooks as provider_hooks
from jaxtrain.metrics import flops
from jaxtrain.metrics.console import Reporter, format_flops
from jaxtrain.metrics.profile import StepProfiler
from jaxtrain.metrics.sinks import Sinks
from jaxtrain.parallel import host_data
from jaxtrain.parallel.mesh import describe, nodes_along
from jaxtrain.runtime import heartbeat, host_memory, signals
from jaxtrain.runtime.watchdog import Watchdog
from jaxtrain.train import elastic, rundir
from jaxtrain.train import hooks as H
from jaxtrain.train.assembly import Setup, setup
from jaxtrain.train.loop import Hook, RunResult, TrainLoop
from jaxtrain.train.model_spec import ModelSpec
from jaxtrain.train.precompile import Precompile
from jaxtrain.train.step import count_params

log = logging.getLogger("jaxtrain")


def fit(cfg: Config, model_spec: Optional[ModelSpec] = None, data: Any = None, *,
        devices: Optional[Sequence[jax.Device]] = None, quiet: bool = False, hooks: Sequence[Hook] = ()) -> RunResult:
    """Trains ``cfg`` on ``devices`` (default: all) and returns what happened.

    Args:
      cfg: the run config (mesh, rules, optimizer, train, checkpoint, run, metrics, ...).
      model_spec: any Flax NNX model and its loss (``model.family: custom``); None trains the
        config's registered family on ``cfg.data``.
      data: the data source of ``model_spec``: an object with ``iterator(sharding)``, ``val``,
        ``info`` and ``tokenizer`` (e.g. :class:`jaxtrain.data.ArrayData`).
      quiet: no progress bar (lines are still printed).
      hooks: extra loop hooks, run after the built-in ones.

    Raises:
      ConfigError, DataError, ShardingError, CheckpointError: bad input, before anything is
        compiled or written. NonFiniteError: the run diverged (too many non-finite steps in a
        row, every step skipped, or a non-finite validation loss); the last good checkpoint is kept.
    """
    if model_spec is not None and data is None:
        raise ValueError("fit: a ModelSpec needs its data source (e.g. jaxtrain.data.ArrayData)")
    # The run's mesh is its own (config mesh.*): a mesh the caller set (jax.set_mesh, a notebook habit) is
    # not in effect while it trains, or its Explicit axes would turn the model's sharding constraints into
    # failed assertions.
    with jax.set_mesh(None):
        return _run(cfg, model_spec, data, devices, quiet, hooks)


def _run(cfg: Config, model_spec: Optional[ModelSpec], data: Any, devices: Optional[Sequence[jax.Device]],
         quiet: bool, hooks: Sequence[Hook]) -> RunResult:
    primary = heartbeat.is_primary()
    if cfg.run.reuse_host_memory:
        host_memory.reuse_freed_memory()
    out = Reporter(quiet=quiet or not cfg.run.progress, total=cfg.train.steps, silent=not primary)
    cfg = elastic.adapt(cfg, devices, out)  # resumed on other devices: the same batches (distributed.elastic)
    # Before anything else runs (a measurement beside the data's threads or a compile reads low)
    peak = flops.total_peak_flops(cfg, devices if devices is not None else jax.devices())
    with out.status("checking the config, loading the data"):
        s = setup(cfg, devices, model_spec=model_spec, data=data, load_data=True,
                  run_dir=Path(cfg.run.dir).expanduser())
    for line in s.plan.lines():
        log.info(line)
    for line in s.plan.warnings():
        log.warning(f"warning: {line}")
    signals.check_startup()  # a signal while the data loaded (the command line's start-up only)
    with rundir.opened(cfg, lock=primary) as run_dir:
        return _fit(s, run_dir, out, hooks, peak)


def _fit(s: Setup, run_dir: Path, out: Reporter, extra: Sequence[Hook], peaks: tuple) -> RunResult:
    cfg, data = s.cfg, s.data
    primary = heartbeat.is_primary()  # writes the run's files; the others write nothing
    if data.tokenizer is not None and primary:
        tokenizers.save(data.tokenizer, run_dir)
    for line in data.info:
        out.info(line)
    sinks = Sinks(cfg, run_dir, out, s.model_spec.unit, primary=primary)
    result = RunResult(run_dir=run_dir)
    loop: Optional[TrainLoop] = None
    precompiled: Optional[Precompile] = None

    def on_checkpoint(row: dict) -> None:  # committed or failed saves, reported by the checkpointer
        loop.write(row.pop("step"), row)

    try:
        t = cfg.train
        samples = data.tokenizer is not None and t.sample_tokens > 0  # as the Sample hook does at the end
        sample = (t.sample_tokens, cfg.data.seq_len, t.sample_temperature) if samples else None
        precompiled = Precompile(s, data.val, sample)  # while the state is built
        ckpt = open_checkpointer(s, run_dir, out, on_checkpoint)
        batches = data.iterator(s.fns.batch_sharding)
        state = resume(s, ckpt, batches, run_dir, out)
        result.start_step = start = int(jax.device_get(state["step"]))
        signals.check_startup()
        if ckpt:
            _check_no_clash(ckpt, start, cfg.train.steps)
        # Only now: a failed resume leaves the old config.yaml, and so does a launch that trains nothing
        # (config.yaml describes what the run's steps were trained with).
        nothing = start >= cfg.train.steps
        kept = nothing and (run_dir / "config.yaml").is_file()
        if primary and not kept:
            rundir.write_config_file(cfg, run_dir)
            _write_resolved(run_dir, s.plan)  # what this launch resolved, beside the config it was resolved from
        sinks.drop_after(start)
        if nothing:
            out.info(f"checkpoint step {start} >= train.steps={cfg.train.steps}: nothing to train "
                     f"(raise train.steps to continue){'; config.yaml is left as it was' if kept else ''}")
        val = put_validation(data.val, s.fns.batch_sharding, s.fns.eval_piece)
        peak = peaks[0]
        _announce(s, state, out, peaks)
        watch = Watchdog(cfg.train.hang_timeout_s, run_dir, jax.process_index())
        loop = TrainLoop(s, state, batches, val, sinks, out, result, start, ckpt=ckpt, watch=watch,
                         precompiled=precompiled)
        hooks = builtin_hooks(s, ckpt, peak, run_dir)
        stop = next(h for h in hooks if isinstance(h, H.StopOnSignal))
        ok = False
        try:
            loop.run([*hooks, *extra])
            ok = True
        finally:
            stop.release(ok)
            watch.close()
    finally:
        if precompiled is not None:
            precompiled.cancel()
        sinks.close()
    return result


def _announce(s: Setup, state: Any, out: Reporter, peaks: tuple) -> None:
    """The start-up lines: the run (model, mesh, the peak MFU divides by), nodes, low-precision updates."""
    out.info(describe_run(s, state, *peaks))
    if s.cfg.mesh.across_nodes:
        out.info(f"mesh across nodes: {nodes_along(s.mesh, s.cfg.mesh.across_nodes)}")
    if s.fns.low_precision:
        out.info(f"[yellow]warning:[/] optimizer.master_weights=false: {len(s.fns.low_precision)} low-precision "
                 f"parameters (e.g. {s.fns.low_precision[0]}) and their Adam moments are updated in place; "
                 f"updates below a weight's resolution are lost")


def _write_resolved(run_dir: Path, plan: Any) -> None:
    """``resolved.json``: the run plan (``jaxtrain.train.plan.RunPlan.as_json``): mesh, rules, every kernel
    choice with its provider and reason (``auto`` resolved once, before tracing), offload, pipeline and
    shardings. Written with config.yaml (a launch that trains nothing or fails to resume leaves both as
    they were)."""
    try:
        (run_dir / "resolved.json").write_text(json.dumps(plan.as_json(), indent=2) + "\n")
    except OSError as err:  # the run's own outputs are written; this one is a description
        log.warning("could not write %s: %s", run_dir / "resolved.json", err)


def builtin_hooks(s: Setup, ckpt: Optional[Checkpointer], peak: Optional[float], run_dir: Path) -> list[Hook]:
    """The hooks of every run (the loop orders them by what they produce and read)."""
    hooks = [H.GarbageCollection(), H.CompileReport(), H.StopOnSignal(), H.NonFiniteGuard(), H.LogMetrics(peak),
             H.Evaluate(), *([H.Checkpointing(ckpt)] if ckpt else []), H.Profile(StepProfiler(s.cfg, run_dir)),
             H.Progress()]
    if s.data.tokenizer is not None:
        hooks.append(H.Sample(s.data.tokenizer, getattr(s.data, "bos_id", None)))
    return hooks


def open_checkpointer(s: Setup, run_dir: Path, out: Reporter, on_checkpoint) -> Optional[Checkpointer]:
    """The run's Checkpointer (None with ``checkpoint.enabled=false``), after saying what it found."""
    if not s.cfg.checkpoint.enabled:
        return None
    ckpt = Checkpointer(s.cfg, run_dir, dict(s.mesh.shape), on_checkpoint, log=out.info)
    if ckpt.removed:
        out.info(f"removed unfinished checkpoint saves of an earlier run: {', '.join(ckpt.removed)}")
    if ckpt.ignored:
        out.info(f"[yellow]note:[/] {ckpt.store.url} holds {', '.join(ckpt.ignored)}: not committed checkpoints "
                 f"and not written by jaxtrain, so left alone and never restored")
    if ckpt.set_aside_names:
        out.info(f"[yellow]note:[/] {ckpt.store.url} holds {', '.join(ckpt.set_aside_names)}: corrupt steps set "
                 f"aside by checkpoint.fallback, never restored")
    return ckpt


def put_validation(val: dict, sharding: NamedSharding, piece: Optional[Callable[[int], int]] = None):
    """The validation batches ``{field: [n_batches, micro, ...]}`` on the mesh, put once; with
    ``piece`` (n_batches -> batches per evaluation program, ``StepFunctions.eval_piece``) a list of
    such dicts, each ``piece(n_batches)`` batches long, in order (the pieces an evaluation can stop
    between: :meth:`jaxtrain.train.loop.TrainLoop.evaluate`).

    Every process holds the same host arrays and cuts its own devices' shards from them
    (:func:`jaxtrain.parallel.host_data.put`): nothing is sent between processes.
    """
    if piece is None:
        return host_data.put(val, sharding)
    n = next(iter(val.values())).shape[0]
    p = piece(n)
    return [host_data.put({k: v[i:i + p] for k, v in val.items()}, sharding) for i in range(0, n, p)]


def resume(s: Setup, ckpt: Optional[Checkpointer], batches, run_dir: Path, out: Reporter) -> dict:
    """The latest committed checkpoint's state (and data position, set on ``batches``), or a fresh state.

    With ``checkpoint.fallback``, a corrupt latest step is set aside and the newest good one is used.

    Raises:
      CheckpointError: the checkpoint does not fit the config; the message ends with the
        model keys changed since it was saved.
      CorruptCheckpointError: the latest step's files fail their check (without ``checkpoint.fallback``).
    """
    steps = ckpt.restorable() if ckpt else []  # one listing (and marker read) per start
    if not steps:
        for note in rundir.fresh_start_notes(s.cfg, run_dir):
            out.info(f"[yellow]note:[/] {note}")
        out.info(f"run directory: {run_dir}")
        # Finished before any other program is dispatched: on a CPU mesh, the init program's collectives
        # (a pipelined model's layers are regrouped by stage) and the first step's could otherwise be in
        # flight together and starve each other of threads (an abort after 40 s; a warm compile
        # cache makes the step ready that soon).
        return jax.block_until_ready((provider_hooks.compiled(s, "init") or s.fns.init)())
    shape_keys, notes = rundir.resume_changes(s.cfg, run_dir, getattr(s.model_config, "vocab_size", None))
    for note in notes:
        out.info(f"[yellow]note:[/] {note}")
    try:
        latest, state, data_state = _restore_good(s, ckpt, steps, out)
    except CheckpointError as err:
        if not shape_keys:
            raise
        raise CheckpointError(f"{err}\nconfig keys changed since the checkpoint (use a new run.dir "
                              f"or the saved values):\n  " + "\n  ".join(shape_keys)) from err
    for key in shape_keys:  # restored all the same (e.g. param_dtype: the values were cast)
        out.info(f"[yellow]note:[/] {key} (restored as the config says)")
    if data_state:  # empty for an imported checkpoint (jaxtrain.export --import)
        rundir.check_data_position(s.cfg, run_dir)
        batches.set_state(data_state)
    saved_mesh = ckpt.saved_mesh(latest)
    resharded = f" (resharded from mesh {saved_mesh})" if saved_mesh and saved_mesh != dict(s.mesh.shape) else ""
    out.info(f"resumed from {ckpt.store.url}/{latest}{resharded}")
    return state


def _restore_good(s: Setup, ckpt: Checkpointer, steps: list[int], out: Reporter):
    """(step, state, data position) of the newest committed step that passes its integrity check.
    With ``checkpoint.fallback``, the newer ones that fail are then set aside as ``<step>.corrupt``.

    Raises:
      CorruptCheckpointError: the newest fails (without fallback), or every one does (with it;
        then nothing is moved).
    """
    bad = []
    for step in reversed(steps):
        try:
            restored = (step, *ckpt.restore(step, s.abstract_state()))
        except CorruptCheckpointError as err:
            if not s.cfg.checkpoint.fallback:
                raise
            bad.append((step, err.detail))
            continue
        for step_bad, detail in bad:
            aside = ckpt.set_aside(step_bad)
            out.info(f"[bold red]checkpoint.fallback: {detail}; set aside as {aside}[/]")
        if bad:
            out.info(f"[bold red]checkpoint.fallback: resuming from step {step}, not the newest step[/]")
        return restored
    raise CorruptCheckpointError("checkpoint.fallback: no step in " + ckpt.store.url + " passes its check, so "
                                 "nothing was restored or moved:\n  " + "\n  ".join(d for _, d in bad))


def _check_no_clash(ckpt: Checkpointer, start: int, steps: int) -> None:
    """Refuses, before training, a run that may save a step where a directory not written by jaxtrain is.

    Raises:
      CheckpointError: naming them.
    """
    clash = [n for n in ckpt.ignored if n.isdigit() and start < int(n) <= steps]
    if clash:
        raise CheckpointError(f"checkpoint.dir: {ckpt.store.url} holds {', '.join(clash)}, not committed checkpoints "
                              f"of this run, and this run may save those steps (it trains {start + 1}..{steps}); "
                              f"move them away or use another checkpoint.dir. Nothing was trained")


def describe_run(s: Setup, state: dict, peak: Optional[float], peak_src: str) -> str:
    """One line: mesh, rules, model, parameters, (vocabulary,) FLOPs per unit and the peak."""
    model_spec = s.model_spec
    parts = [f"mesh {describe(s.mesh)}", f"rules {s.rules.name}", f"model {model_spec.name}",
             f"params {count_params(state['params']) / 1e6:.2f}M"]
    if getattr(s.model_config, "vocab_size", None):
        parts.append(f"vocab {s.model_config.vocab_size}")
    if model_spec.flops_per_unit:
        parts.append(f"{model_spec.flops_per_unit / 1e6:.1f} MFLOP/{model_spec.unit.rstrip('s')}")
    return " | ".join(parts + [f"peak {format_flops(peak)} ({peak_src})"])
