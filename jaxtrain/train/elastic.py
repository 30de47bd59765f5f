"""Elastic resumes: a run restarted on more or fewer processes or devices continues from its last
checkpoint without a config edit.

The mesh axis marked -1 absorbs the new device count (``jaxtrain.parallel.mesh``). What would
change with it is the batch each device holds: ``train.global_batch / train.grad_accum`` sequences
per micro-batch, cut over the batch devices (data x fsdp x expert). With ``distributed.elastic``
(the default) :func:`adapt` keeps both the global batch (the optimizer sees the same batches) and
the per-device micro-batch (the same memory per device) by choosing ``train.grad_accum``::

    grad_accum = global_batch / (device_micro_batch x batch devices)

``distributed.device_micro_batch`` is the first run's unless set: it is recorded in the run
directory's ``config.yaml`` and read back by every resume. The data position needs nothing: every
iterator counts whole global batches or global rows (``jaxtrain.data``), so a resume on any
device count continues with exactly the rows an uninterrupted run would have seen.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import yaml

from jaxtrain.config import MESH_AXES, Config, from_dict
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.mesh import resolve_sizes
from jaxtrain.runtime import heartbeat

BATCH_AXES = ("data", "fsdp", "expert")  # the axes that cut a micro-batch (jaxtrain.config.check_against_mesh)


def batch_devices(sizes: dict[str, int]) -> int:
    """How many ways a micro-batch is cut: the product of the batch axes' sizes."""
    n = 1
    for axis in BATCH_AXES:
        n *= sizes.get(axis, 1)
    return n


def grad_accum_for(global_batch: int, device_micro_batch: int, devices: int) -> int:
    """The gradient accumulation that keeps ``global_batch`` sequences per step and
    ``device_micro_batch`` sequences per batch device in each micro-batch.

    Raises:
      ConfigError: no whole number of micro-batches makes the global batch.
    """
    rows = device_micro_batch * devices
    if global_batch % rows:
        raise ConfigError(
            f"train.grad_accum: elastic resume: train.global_batch={global_batch} is not a whole number of "
            f"micro-batches of {rows} sequences (distributed.device_micro_batch={device_micro_batch} on each of "
            f"{devices} batch devices, data*fsdp*expert), so no gradient accumulation keeps both; resume on a "
            f"device count for which it is, set distributed.device_micro_batch to a size that divides, or set "
            f"distributed.elastic=false to keep train.grad_accum instead")
    return global_batch // rows


def saved_device_micro_batch(run_dir: Path) -> Optional[int]:
    """``distributed.device_micro_batch`` as an earlier run of ``run_dir`` recorded it (None: none did)."""
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        value = saved.get("distributed", {}).get("device_micro_batch")
    except (OSError, ValueError, yaml.YAMLError, AttributeError):  # no file, or one the resume itself reports
        return None
    return value if isinstance(value, int) and value > 0 else None


def may_resume(cfg: Config) -> bool:
    """Whether this run may resume a checkpoint, so that an earlier run's recorded micro-batch applies:
    checkpoints on, and a local checkpoint directory holding anything (a remote one, ``gs://`` or
    ``s3://``, is not listed here: assumed to). Without that a run starts at step 0 and its own micro-batch
    is the one to keep (a reused run directory's config.yaml had made a fresh run an elastic resume). Only a
    step's directory (its name a number) counts: a save's unfinished temporary one does not."""
    if not cfg.checkpoint.enabled:
        return False
    where = cfg.checkpoint.dir or str(Path(cfg.run.dir).expanduser() / "checkpoints")
    if "://" in where:
        return True
    try:
        return any(p.name.isdigit() for p in Path(where).expanduser().iterdir())
    except OSError:  # none yet (or unreadable: the checkpointer names that)
        return False


def _from_process_0(name: str, fn):
    """``fn()`` on process 0, its (JSON) result given to every process: the run directory may be on
    process 0's disk alone, and every process must build the same step."""
    import jax
    if jax.process_count() == 1:
        return fn()
    from jax._src import distributed as jd
    client, key = jd.global_state.client, f"jaxtrain/elastic/{name}"

    def first():
        value = fn()
        client.key_value_set(key, json.dumps(value), allow_overwrite=True)
        return value
    return heartbeat.primary_first(f"elastic-{name}", first,
                                   lambda: json.loads(client.blocking_key_value_get(key, 60_000)))


def adapt(cfg: Config, devices: Optional[Sequence] = None, out=None) -> Config:
    """``cfg`` with the ``train.grad_accum`` that keeps the global batch and the per-device
    micro-batch on ``devices`` (default: all), and ``distributed.device_micro_batch`` set; a note on
    ``out`` (a Reporter) when the accumulation differs from the configured one. Unchanged with
    ``distributed.elastic=false``, when no mesh axis is -1 (nothing absorbs a new device count: the
    layout is the user's), or when the configured micro-batch does not divide over the batch devices
    (the run's set-up names that).

    Raises:
      ConfigError: the mesh does not fit the devices, or no whole gradient accumulation keeps both.
    """
    if not cfg.distributed.elastic or not any(getattr(cfg.mesh, a) == -1 for a in MESH_AXES):
        return cfg  # every axis sized by hand: a changed layout is the user's, the accumulation too
    import jax
    sizes = resolve_sizes(cfg.mesh, len(devices) if devices is not None else jax.device_count())
    n = batch_devices(sizes)
    per_device = cfg.distributed.device_micro_batch or _from_process_0(
        "device_micro_batch",
        lambda: saved_device_micro_batch(Path(cfg.run.dir).expanduser()) if may_resume(cfg) else None)
    if per_device is None:  # the first run: its own micro-batch per device, if whole
        if cfg.micro_batch % n:
            return cfg
        per_device = cfg.micro_batch // n
    accum = grad_accum_for(cfg.train.global_batch, per_device, n)
    if accum != cfg.train.grad_accum and out is not None:
        out.info(f"[yellow]note:[/] elastic: {n} batch devices (data*fsdp*expert): train.grad_accum {accum} "
                 f"instead of {cfg.train.grad_accum} keeps train.global_batch={cfg.train.global_batch} and "
                 f"distributed.device_micro_batch={per_device}")
    tree = cfg.to_dict()
    tree["train"]["grad_accum"] = accum
    tree["distributed"]["device_micro_batch"] = per_device
    return from_dict(tree)
