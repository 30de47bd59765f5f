"""The typed run-config schema and its value checks.

A tree of pydantic models with ``extra='forbid'`` and strict types; cross-field
checks raise :class:`ConfigError` whose message starts with the offending dotted
key, all before anything is compiled. Loading from YAML + overrides is in
``jaxtrain.config.loading``.

The built-in defaults *are* the default job: a small Llama trained byte-level
on the running interpreter's standard library (``data.path: stdlib``).
"""
from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, model_validator

MESH_AXES = ("data", "fsdp", "tensor", "sequence", "expert")


class ConfigError(ValueError):
    """A config key, type or value is wrong. The message names the key."""


class _Section(BaseModel):
    # strict: no bool -> int or 2.5 -> int coercion (ints are still accepted for floats).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class ModelConfig(_Section):
    """Llama-style decoder hyper-parameters."""

    vocab_size: int = 0  # 0: taken from the tokenizer
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    d_ff: int = 384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"  # activation/compute dtype
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # auto | xla | blockwise | cudnn | pallas | ring; see models/attention.py and README "Attention (model.attention)"
    attention: Literal["auto", "xla", "blockwise", "cudnn", "pallas", "ring"] = "auto"
    init_std: float = 0.02
    scan_layers: bool = False  # stack the blocks and lax.scan over them (flat compile time in depth)
    remat: Literal["none", "full", "save_matmuls"] = "none"  # activation recompute per block


class MeshConfig(_Section):
    """Device-mesh axis sizes; at most one may be -1 (filled from the device count)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1


class ShardingConfig(_Section):
    rules: str = "fsdp_tp"  # a name in sharding_rules/ or a path to a YAML file
    allow_fallback: bool = False  # replicate indivisible dims (reported) instead of failing


class DataConfig(_Section):
    path: str = "stdlib"  # file, glob, 'stdlib' (the interpreter's Lib/*.py), or a prepared token cache
    tokenizer: Literal["char", "byte", "hf", "sentencepiece"] = "byte"
    seq_len: int = 128
    val_fraction: float = 0.1
    seed: int = 0
    # windows: random windows over the concatenated files; packed/padded: documents (jaxtrain/data/)
    mode: Literal["windows", "packed", "padded"] = "windows"
    format: Literal["auto", "text", "jsonl", "parquet", "arrayrecord"] = "auto"  # auto: by extension
    text_field: str = "text"  # JSONL field / Parquet column holding the document
    separator: Optional[str] = None  # text files: split into documents on this string (None: one per file)
    mixture: dict[str, float] = {}  # {path: weight}; replaces data.path (document modes only)
    tokenizer_path: str = ""  # local tokenizer.json (hf) or .model (sentencepiece); never downloaded
    add_bos: bool = False
    add_eos: bool = False
    bos_token: str = ""  # "" = the tokenizer's usual name (<s>, <|begin_of_text|>, ...)
    eos_token: str = ""
    prefetch: int = 4  # batches assembled ahead by Grain threads (document modes)


class OptimizerConfig(_Section):
    """AdamW with global-norm clipping, linear warmup then cosine decay to ``min_lr``."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    decay_steps: Optional[int] = None  # None: train.steps (MaxText's learning_rate_schedule_steps)
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0


class TrainConfig(_Section):
    steps: int = 300
    global_batch: int = 16  # sequences per optimizer step, over all devices
    grad_accum: int = 1  # micro-batches per step; micro-batch = global_batch / grad_accum
    seed: int = 0
    log_every: int = 25
    eval_every: int = 100
    eval_batches: int = 20
    sample_tokens: int = 200
    sample_prompt: str = "def "
    sample_temperature: float = 0.8
    peak_tflops: Optional[float] = None  # per-device peak override for MFU
    max_nonfinite_steps: int = 10  # stop after this many skipped (non-finite) steps in a row


class CheckpointConfig(_Section):
    enabled: bool = True
    every: int = 100
    keep: int = 3
    async_save: bool = True
    every_seconds: Optional[float] = None  # also save when this many seconds passed since the last save
    keep_best: int = 0  # also keep the best K checkpoints by best_metric (an eval metric, e.g. val_loss)
    best_metric: str = "val_loss"
    best_mode: Literal["min", "max"] = "min"
    keep_period: Optional[int] = None  # keep every step divisible by this forever
    grace_period_s: float = 30.0  # SIGTERM/SIGINT: finish the step, save, commit, exit 0 within this
    dir: Optional[str] = None  # local path, gs://bucket/path or s3://bucket/path; default RUN_DIR/checkpoints
    s3_endpoint: Optional[str] = None  # S3-compatible endpoint URL; default $AWS_ENDPOINT_URL, else AWS


class RunConfig(_Section):
    dir: str = "runs/default"
    progress: bool = True  # rich progress bar with ETA


class ProfileConfig(_Section):
    """A jax.profiler trace of steps [start_step, start_step + steps) written to <run.dir>/profile."""

    start_step: int = 5  # after compile and warm-up
    steps: int = 0  # 0: no trace


class Config(_Section):
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    sharding: ShardingConfig = ShardingConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    run: RunConfig = RunConfig()
    profile: ProfileConfig = ProfileConfig()

    @model_validator(mode="after")
    def _check(self) -> "Config":
        check_consistency(self)
        return self

    @property
    def micro_batch(self) -> int:
        return self.train.global_batch // self.train.grad_accum

    @property
    def decay_steps(self) -> int:
        return self.optimizer.decay_steps or self.train.steps

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


def _positive(key: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: must be > 0, got {value}")


def check_consistency(cfg: Config) -> None:
    """Value checks that need no devices. Raises ConfigError naming the key."""
    m, t = cfg.model, cfg.train
    for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
        _positive(f"model.{key}", getattr(m, key))
    for key in ("steps", "global_batch", "grad_accum", "log_every", "eval_every", "eval_batches"):
        _positive(f"train.{key}", getattr(t, key))
    _positive("data.seq_len", cfg.data.seq_len)
    _positive("profile.start_step", cfg.profile.start_step)
    if cfg.profile.steps < 0:
        raise ConfigError(f"profile.steps: must be >= 0 (0 = no trace), got {cfg.profile.steps}")
    _positive("checkpoint.every", cfg.checkpoint.every)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    c = cfg.checkpoint
    for key in ("every_seconds", "keep_period", "grace_period_s"):
        if getattr(c, key) is not None:
            _positive(f"checkpoint.{key}", getattr(c, key))
    if c.keep_best < 0:
        raise ConfigError(f"checkpoint.keep_best: must be >= 0, got {c.keep_best}")
    if t.max_nonfinite_steps < 1:
        raise ConfigError(f"train.max_nonfinite_steps: must be >= 1, got {t.max_nonfinite_steps}")
    if m.vocab_size < 0:
        raise ConfigError(f"model.vocab_size: must be >= 0 (0 = from tokenizer), got {m.vocab_size}")
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model: {m.d_model} is not divisible by model.n_heads={m.n_heads}")
    if (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model.d_model: head dim {m.d_model // m.n_heads} must be even for rotary embeddings")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: model.n_heads={m.n_heads} is not divisible by n_kv_heads={m.n_kv_heads}")
    if t.global_batch % t.grad_accum:
        raise ConfigError(
            f"train.global_batch: {t.global_batch} is not divisible by train.grad_accum={t.grad_accum}")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {cfg.data.val_fraction}")
    if cfg.data.mixture and cfg.data.mode == "windows":
        raise ConfigError("data.mixture: needs data.mode=packed or padded (windows reads one data.path)")
    for key, w in cfg.data.mixture.items():
        if w <= 0:
            raise ConfigError(f"data.mixture: weight of '{key}' must be > 0, got {w}")
    if cfg.data.tokenizer in ("hf", "sentencepiece") and not cfg.data.tokenizer_path:
        raise ConfigError(f"data.tokenizer_path: data.tokenizer={cfg.data.tokenizer} needs a local tokenizer file")
    if (cfg.data.add_bos or cfg.data.add_eos) and cfg.data.mode == "windows":
        raise ConfigError("data.add_bos: BOS/EOS are added per document: use data.mode=packed or padded")
    _check_optimizer(cfg.optimizer)
    if t.sample_tokens < 0:
        raise ConfigError(f"train.sample_tokens: must be >= 0, got {t.sample_tokens}")
    if t.peak_tflops is not None and not 0 < t.peak_tflops < math.inf:
        raise ConfigError(f"train.peak_tflops: must be a positive number, got {t.peak_tflops}")
    if not cfg.run.dir.strip():
        raise ConfigError("run.dir: must not be empty")
    sizes = [getattr(cfg.mesh, a) for a in MESH_AXES]
    if sum(s == -1 for s in sizes) > 1:
        raise ConfigError("mesh: at most one axis may be -1, got " + _mesh_str(cfg.mesh))
    for a, s in zip(MESH_AXES, sizes):
        if s == 0 or s < -1:
            raise ConfigError(f"mesh.{a}: must be a positive size or -1, got {s}")


def _check_optimizer(o: OptimizerConfig) -> None:
    for key in ("lr", "min_lr", "b1", "b2", "eps", "weight_decay", "clip_norm"):
        if not math.isfinite(getattr(o, key)):
            raise ConfigError(f"optimizer.{key}: must be finite, got {getattr(o, key)}")
    _positive("optimizer.lr", o.lr)
    _positive("optimizer.eps", o.eps)
    _positive("optimizer.clip_norm", o.clip_norm)
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optimizer.min_lr: must be in [0, optimizer.lr={o.lr}], got {o.min_lr}")
    for key in ("b1", "b2"):
        if not 0 <= getattr(o, key) < 1:
            raise ConfigError(f"optimizer.{key}: must be in [0, 1), got {getattr(o, key)}")
    if o.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay: must be >= 0, got {o.weight_decay}")
    if o.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps: must be >= 0, got {o.warmup_steps}")
    if o.decay_steps is not None and o.decay_steps <= o.warmup_steps:
        raise ConfigError(f"optimizer.decay_steps: must be > optimizer.warmup_steps={o.warmup_steps}, "
                          f"got {o.decay_steps}")


def _mesh_str(mesh: MeshConfig) -> str:
    return ", ".join(f"{a}={getattr(mesh, a)}" for a in MESH_AXES)


def check_against_mesh(cfg: Config, axis_sizes: dict[str, int], platform: Optional[str] = None) -> None:
    """Checks that need the resolved mesh sizes (still before any compile).

    Raises:
      ConfigError: batch not divisible by the batch axes, heads/kv heads not divisible
        by the tensor axis, ring chunks not dividing the length, or an attention
        implementation that cannot run on ``platform`` (the devices' platform).
    """
    if cfg.model.attention == "cudnn" and platform is not None and platform != "gpu":
        raise ConfigError(f"model.attention: cudnn needs a GPU, the devices are '{platform}' "
                          "(use auto, blockwise, xla or pallas)")
    batch_div = axis_sizes["data"] * axis_sizes["fsdp"] * axis_sizes["expert"]
    if cfg.micro_batch % batch_div:
        raise ConfigError(
            f"train.global_batch: micro-batch {cfg.micro_batch} (global_batch {cfg.train.global_batch} / "
            f"grad_accum {cfg.train.grad_accum}) is not divisible by data*fsdp*expert = "
            f"{axis_sizes['data']}*{axis_sizes['fsdp']}*{axis_sizes['expert']} = {batch_div}")
    seq = axis_sizes["sequence"]
    if cfg.model.attention == "ring" and cfg.data.seq_len % (2 * seq):
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} is not divisible by 2 * mesh.sequence = {2 * seq} "
                          "(model.attention=ring holds two zig-zag chunks per device)")
    tp = axis_sizes["tensor"]
    for key in ("n_heads", "n_kv_heads"):
        if getattr(cfg.model, key) % tp:
            raise ConfigError(
                f"model.{key}: {getattr(cfg.model, key)} is not divisible by mesh.tensor={tp}")
