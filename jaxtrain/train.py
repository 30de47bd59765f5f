"""``python -m jaxtrain.train [--config FILE | FILE] [key=value ...]``: train, checkpoint, resume.

With no arguments it runs the built-in default job (a small Llama trained
byte-level on this interpreter's standard library). Rerunning a command with
the same ``run.dir`` resumes from the latest complete checkpoint: model,
optimizer, step, RNG and data position.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import jax
import numpy as np

from jaxtrain import checkpoint as ckptlib
from jaxtrain import preempt
from jaxtrain import data as datalib
from jaxtrain import flops, memory, rundir, step as steplib, tokenizer as toklib
from jaxtrain.profile import StepProfiler
from jaxtrain.config import Config, ConfigError, check_against_mesh, load
from jaxtrain.mesh import build_mesh, describe, resolve_sizes
from jaxtrain.models import count_params
from jaxtrain.partitioning import Rules, ShardingError, check_mesh_used
from jaxtrain.progress import Reporter, format_flops
from jaxtrain.sample import generate

USER_ERRORS = (ConfigError, toklib.DataError, ShardingError, ckptlib.CheckpointError)


class NonFiniteError(RuntimeError):
    """``train.max_nonfinite_steps`` steps in a row had a non-finite loss or gradient."""


@dataclass
class RunResult:
    run_dir: Path
    rows: list[dict] = field(default_factory=list)  # every metrics row written by this process
    val_loss: Optional[float] = None
    sample: str = ""
    start_step: int = 0
    compile_s: float = 0.0
    preempted: str = ""  # the signal name when the run stopped early on SIGTERM/SIGINT
    nonfinite_steps: int = 0  # steps skipped by the non-finite guard in this process
    state: object = None  # the final train state (for tests and notebooks)

    @property
    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.rows if "loss" in r}


def evaluate(trainer: steplib.Trainer, params, batches: dict, counts: Optional[np.ndarray] = None) -> float:
    """Mean validation loss over ``batches`` ({field: [n, micro, T]}; one dispatch per batch, one sync),
    each batch weighted by ``counts`` [n] (its loss-mask tokens) when they differ."""
    n = batches["inputs"].shape[0]
    losses = jax.device_get([trainer.eval_step(params, {k: v[i] for k, v in batches.items()}) for i in range(n)])
    if counts is None or (counts == counts[0]).all():
        return float(np.mean(losses))
    return float(np.average(np.asarray(losses, np.float64), weights=counts))


def run(cfg: Config, devices: Optional[Sequence[jax.Device]] = None, quiet: bool = False) -> RunResult:
    """Trains ``cfg`` on ``devices`` (default: all). Validates everything before compiling.

    Raises:
      ConfigError, DataError, ShardingError, CheckpointError: bad input, with the key/path named.
    """
    devices = list(devices) if devices is not None else jax.devices()
    check_against_mesh(cfg, resolve_sizes(cfg.mesh, len(devices)), devices[0].platform)
    rules = Rules.load(cfg.sharding.rules, cfg.sharding.allow_fallback)
    run_dir = Path(cfg.run.dir).expanduser()
    saved_tok = toklib.load_json(run_dir) if run_dir.is_dir() else None
    corpus = datalib.load(cfg, saved_tok)
    vocab = cfg.model.vocab_size or corpus.tokenizer.vocab_size
    if vocab < corpus.tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size: {vocab} is smaller than the tokenizer's vocabulary "
                          f"({corpus.tokenizer.vocab_size})")
    mesh = build_mesh(cfg.mesh, devices)
    check_mesh_used(rules, dict(mesh.shape))
    trainer = steplib.build(cfg, mesh, rules, vocab)  # resolves every sharding: errors before compile
    run_dir = rundir.prepare(cfg, write_config=False)
    lock = rundir.RunLock(run_dir, enabled=jax.process_index() == 0)
    try:
        return _train(cfg, devices, mesh, rules, corpus, trainer, vocab, run_dir, quiet)
    finally:
        lock.release()


def _train(cfg: Config, devices, mesh, rules: Rules, corpus, trainer: steplib.Trainer, vocab: int,
           run_dir: Path, quiet: bool) -> RunResult:
    toklib.save(corpus.tokenizer, run_dir)
    out = Reporter(quiet=quiet or not cfg.run.progress, total=cfg.train.steps)
    for line in corpus.info:
        out.info(line)

    metrics_out = rundir.MetricsWriter(run_dir)
    result = RunResult(run_dir=run_dir)

    def record(row: dict) -> None:
        metrics_out.write(row)
        result.rows.append(row)

    def on_checkpoint(row: dict) -> None:
        record(row)
        if "checkpoint_failed" in row:
            out.info(f"[red]checkpoint save at step {row['step']} failed: {row['checkpoint_failed']}; "
                     f"latest committed step: {row['latest_committed']}")

    ckpt = ckptlib.Checkpointer(cfg, run_dir, dict(mesh.shape), on_checkpoint) if cfg.checkpoint.enabled else None
    if ckpt and ckpt.removed:
        out.info(f"removed uncommitted checkpoint directories: {', '.join(ckpt.removed)}")
    batches = corpus.iterator(trainer.batch_sharding)
    latest = ckpt.latest_step() if ckpt else None
    if latest is not None:
        shape_keys, notes = rundir.resume_changes(cfg, run_dir)
        for note in notes:
            out.info(f"[yellow]note:[/] {note}")
        abstract = ckptlib.abstract_like(jax.eval_shape(trainer.init), trainer.state_shardings)
        try:
            state, data_state = ckpt.restore(latest, abstract)
        except ckptlib.CheckpointError as err:
            if not shape_keys:
                raise
            raise ckptlib.CheckpointError(f"{err}\nconfig keys changed since the checkpoint (use a new run.dir "
                                          f"or the saved values):\n  " + "\n  ".join(shape_keys)) from err
        if data_state:  # empty for an imported checkpoint (jaxtrain.export --import)
            batches.set_state(data_state)
        saved_mesh = ckpt.saved_mesh(latest)
        resharded = f" (resharded from mesh {saved_mesh})" if saved_mesh and saved_mesh != dict(mesh.shape) else ""
        out.info(f"resumed from {ckpt.store.url}/{latest}{resharded}")
    else:
        state = trainer.init()
    start = int(jax.device_get(state["step"]))
    rundir.write_config_file(cfg, run_dir)  # only now: a failed resume leaves the old config.yaml
    metrics_out.drop_after(start)
    if latest is None:
        out.info(f"run directory: {run_dir}")
    if start >= cfg.train.steps:
        out.info(f"checkpoint step {start} >= train.steps={cfg.train.steps}: nothing to train "
                 f"(raise train.steps to continue)")
    val_counts = corpus.val["loss_mask"].sum(axis=(1, 2))
    val = jax.device_put(corpus.val, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        None, *trainer.batch_sharding.spec[1:])))

    n_params = count_params(state["params"])
    fpt = flops.flops_per_token(cfg, vocab)
    peak, peak_src = flops.total_peak_flops(cfg, devices)
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    out.info(f"mesh {describe(mesh)} | rules {rules.name} | params {n_params / 1e6:.2f}M | vocab {vocab} "
             f"| {fpt / 1e6:.1f} MFLOP/token | peak {format_flops(peak)} "
             f"({peak_src})")
    result.start_step = start

    compiled = None
    prof = StepProfiler(cfg, run_dir)
    last_eval: dict = {}
    bad_run, prev_flag = 0, None  # consecutive non-finite steps; the previous step's flag (read one step late)
    with preempt.Preemption(cfg.checkpoint.grace_period_s) as stop, out.progress(start):
        t_last, s_last = time.perf_counter(), start
        for s in range(start + 1, cfg.train.steps + 1):
            batch = next(batches)
            if compiled is None:
                t0 = time.perf_counter()
                compiled = trainer.train_step.lower(state, batch).compile()
                result.compile_s = time.perf_counter() - t0
                out.info(f"compiled train step in {result.compile_s:.1f} s")
                out.info(memory.state_report(state, trainer.state_shardings, compiled).summary())
                if rules.fallbacks:  # after tracing, so activation fallbacks are listed too
                    out.warn_table("sharding.allow_fallback replicated these dimensions", rules.fallbacks)
                t_last = time.perf_counter()
            prof.before(s)
            state, m = compiled(state, batch)
            # Read the previous step's flag now, so the host never waits on the step just dispatched.
            if prev_flag is not None:
                bad_run = _check_nonfinite(int(prev_flag), bad_run, s - 1, cfg, ckpt, result)
            prev_flag = m["nonfinite"]
            if s == cfg.train.steps:
                bad_run = _check_nonfinite(int(prev_flag), bad_run, s, cfg, ckpt, result)
            prof.after(s, m)
            if s % cfg.train.log_every == 0 or s == cfg.train.steps:
                m = jax.device_get(m)  # the only host sync in the loop
                now = time.perf_counter()
                dt = (now - t_last) / (s - s_last)
                tps = tokens_per_step / dt
                row = {"step": s, "loss": float(m["loss"]), "lr": float(m["lr"]),
                       "grad_norm": float(m["grad_norm"]), "tokens_per_sec": tps, "step_time_s": dt,
                       "mfu": (tps * fpt / peak) if peak else None,
                       "nonfinite_steps": result.nonfinite_steps + int(m["nonfinite"])}
                record(row)
                out.log_train(row)
                t_last, s_last = time.perf_counter(), s
            if s % cfg.train.eval_every == 0 or s == cfg.train.steps:
                record({"step": s, "val_loss": evaluate(trainer, state["params"], val, val_counts)})
                out.log_eval(result.rows[-1])
                last_eval = {"step": s, "val_loss": result.rows[-1]["val_loss"]}
            stopping = stop.requested
            if ckpt and (stopping or ckpt.due(s, final=s == cfg.train.steps)):
                if cfg.checkpoint.keep_best and last_eval.get("step") != s:  # best-K needs this step's metric
                    last_eval = {"step": s, "val_loss": evaluate(trainer, state["params"], val, val_counts)}
                    record(dict(last_eval))
                metrics = {k: v for k, v in last_eval.items() if k != "step"} if last_eval.get("step") == s else {}
                ckpt.save(s, state, batches.get_state(), metrics)
            if ckpt:
                ckpt.poll()
            out.advance(s)
            if stopping:
                if ckpt:
                    ckpt.wait()
                stop.finished()
                result.preempted = stop.name
                out.info(f"{stop.name}: stopped after step {s}; checkpoint "
                         f"{'committed' if ckpt and ckpt.latest_step() == s else 'NOT saved'}; rerun to resume")
                break
    prof.stop()
    if ckpt:
        ckpt.close()
    if result.preempted:
        metrics_out.close()
        result.state = state
        return result
    evals = [r["val_loss"] for r in result.rows if "val_loss" in r]
    result.val_loss = evals[-1] if evals else evaluate(trainer, state["params"], val, val_counts)
    prompt = corpus.tokenizer.encode(cfg.train.sample_prompt)
    if corpus.bos_id is not None:
        prompt = np.concatenate([[corpus.bos_id], prompt]).astype(np.int32)
    unk = getattr(corpus.tokenizer, "unk", None)
    ids = generate(trainer.logits_fn, state["params"], prompt, cfg.train.sample_tokens, cfg.data.seq_len,
                   cfg.train.sample_temperature, cfg.train.seed, banned=() if unk is None else (unk,),
                   vocab_limit=corpus.tokenizer.vocab_size)
    result.sample = corpus.tokenizer.decode(ids)
    metrics_out.close()
    result.state = state
    out.final(result.val_loss, int(corpus.val["inputs"].shape[0]), result.sample)
    return result


def _check_nonfinite(flag: int, bad_run: int, step: int, cfg: Config, ckpt, result: RunResult) -> int:
    """Counts a skipped step; raises NonFiniteError after ``train.max_nonfinite_steps`` in a row."""
    if not flag:
        return 0
    result.nonfinite_steps += 1
    bad_run += 1
    if bad_run >= cfg.train.max_nonfinite_steps:
        last = None
        if ckpt:
            ckpt.wait()  # a save already started holds unchanged params: let it commit
            last = ckpt.latest_step()
        raise NonFiniteError(
            f"train.max_nonfinite_steps: {bad_run} steps in a row (steps {step - bad_run + 1}..{step}) had a "
            f"non-finite loss or gradient and were skipped; stopping. The last good checkpoint is "
            + (f"step {last} in {ckpt.store.url}" if last is not None else "none (no checkpoint saved)"))
    return bad_run


def parse_args(argv: Sequence[str]) -> tuple[Optional[str], list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m jaxtrain.train",
        description="Train a model. Overrides are dotted key=value pairs, e.g. train.steps=100 mesh.fsdp=8.")
    parser.add_argument("--config", help="YAML config file or a name in configs/ (default: built-in job)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (a leading FILE.yaml is the config)")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after --config
    overrides = list(args.overrides)
    config = args.config
    if overrides and "=" not in overrides[0] and overrides[0].endswith((".yaml", ".yml")):
        if config:
            parser.error("give the config file once: positional or --config")
        config = overrides.pop(0)
    return config, overrides


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR`` or ~/.cache/jaxtrain/xla)."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/jaxtrain/xla"))


def log_to_console() -> None:
    """Shows the library's INFO lines (e.g. which attention ``model.attention=auto`` picked) on stderr."""
    log = logging.getLogger("jaxtrain")
    if not log.handlers and not logging.getLogger().handlers:  # else the root's handler prints them
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def main(argv: Optional[Sequence[str]] = None) -> int:
    config, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    enable_compilation_cache()
    log_to_console()
    try:
        run(load(config, overrides))
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
