"""Value checks of a Config: without devices (on every validation) and against the resolved mesh.

Every failure is a :class:`ConfigError` whose message starts with the dotted key. The
``model:`` section checks itself (``ModelConfig.check`` / ``check_against_mesh`` of its family).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

from jaxtrain.config.base import MESH_AXES, SINKS
from jaxtrain.config.features import check_gated
from jaxtrain.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the schema imports this module
    from jaxtrain.config.schema import Config, MeshConfig, OptimizerConfig



def positive(key: str, value: int | float) -> None:
    """Raises ConfigError naming ``key`` unless ``value > 0``."""
    if value <= 0:
        raise ConfigError(f"{key}: must be > 0, got {value}")


def check_consistency(cfg: "Config") -> None:
    """Value checks that need no devices. Raises ConfigError naming the key."""
    t = cfg.train
    for key in ("steps", "global_batch", "grad_accum", "log_every", "eval_every", "eval_batches"):
        positive(f"train.{key}", getattr(t, key))
    positive("data.seq_len", cfg.data.seq_len)
    _check_profile(cfg)
    c = cfg.checkpoint
    positive("checkpoint.every", c.every)
    positive("checkpoint.keep", c.keep)
    for key in ("every_seconds", "keep_period", "grace_period_s", "save_timeout_s"):
        if getattr(c, key) is not None:
            positive(f"checkpoint.{key}", getattr(c, key))
    if c.keep_best < 0:
        raise ConfigError(f"checkpoint.keep_best: must be >= 0, got {c.keep_best}")
    if t.gc_every < 0:
        raise ConfigError(f"train.gc_every: must be >= 0 (0 = Python's automatic collection), got {t.gc_every}")
    if t.compile_timeout_s is not None and not 0 < t.compile_timeout_s < math.inf:
        raise ConfigError(f"train.compile_timeout_s: must be a positive number of seconds (null: no limit), "
                          f"got {t.compile_timeout_s}")
    if t.hang_timeout_s is not None and not 0 < t.hang_timeout_s < math.inf:
        raise ConfigError(f"train.hang_timeout_s: must be a positive number of seconds (null: automatic), "
                          f"got {t.hang_timeout_s}")
    if t.sample_temperature < 0:  # the sampler took any value <= 0 as greedy
        raise ConfigError(f"train.sample_temperature: must be >= 0 (0 = greedy), got {t.sample_temperature}")
    if t.max_nonfinite_steps < 1:
        raise ConfigError(f"train.max_nonfinite_steps: must be >= 1, got {t.max_nonfinite_steps}")
    if t.global_batch % t.grad_accum:
        raise ConfigError(
            f"train.global_batch: {t.global_batch} is not divisible by train.grad_accum={t.grad_accum}")
    _check_data(cfg)
    _check_optimizer(cfg.optimizer)
    check_gated(cfg)
    d = cfg.distributed
    for key in ("init_timeout_s", "peer_timeout_s", "stop_check_every", "num_processes", "device_micro_batch"):
        if getattr(d, key) is not None:
            positive(f"distributed.{key}", getattr(d, key))
    if d.process_id is not None and d.process_id < 0:
        raise ConfigError(f"distributed.process_id: must be >= 0, got {d.process_id}")
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
    _check_pipeline(cfg)
    _check_offload(cfg)
    unknown = [s for s in cfg.metrics.sinks if s not in SINKS]
    if unknown:
        raise ConfigError(f"metrics.sinks: unknown sink '{unknown[0]}' (known: {', '.join(SINKS)})")
    if len(set(cfg.metrics.sinks)) != len(cfg.metrics.sinks):
        raise ConfigError(f"metrics.sinks: a sink named twice in {cfg.metrics.sinks}")
    cfg.model.check(cfg)


def _check_pipeline(cfg: "Config") -> None:
    p, m = cfg.pipeline, cfg.mesh
    if p.microbatches < 0:
        raise ConfigError(f"pipeline.microbatches: must be >= 0 (0 = mesh.stage), got {p.microbatches}")
    positive("pipeline.repeats", p.repeats)
    if p.repeats > 1 and p.schedule != "circular":
        raise ConfigError(f"pipeline.repeats: {p.repeats} chunks per stage need pipeline.schedule=circular, "
                          f"got {p.schedule}")
    for axis, nodes in m.across_nodes.items():
        if axis not in MESH_AXES:
            raise ConfigError(f"mesh.across_nodes: '{axis}' is not a mesh axis (mesh axes: {', '.join(MESH_AXES)})")
        if not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"mesh.across_nodes.{axis}: must be a whole number of nodes >= 1, got {nodes!r}")


def _check_profile(cfg: "Config") -> None:
    """``profile.*``: a trace window of whole steps inside the run. Raises ConfigError naming the key."""
    p, steps = cfg.profile, cfg.train.steps
    positive("profile.start_step", p.start_step)
    if p.steps < 0:
        raise ConfigError(f"profile.steps: must be >= 0 (0 = no trace), got {p.steps}")
    last = p.start_step + p.steps - 1
    if p.steps and last > steps:  # the trace would never be written
        raise ConfigError(f"profile.start_step: steps {p.start_step}..{last} end after train.steps={steps}; trace "
                          f"steps within the run")


def _check_offload(cfg: "Config") -> None:
    """``offload.*``: activation names given once; parameter offload streams the stacked layers, so it
    needs them stacked (``model.scan_layers``, no pipeline) and a remat policy that refetches them.

    Raises:
      ConfigError: naming the key and what to set.
    """
    o, model = cfg.offload, cfg.model
    names = o.activations
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"offload.activations: {', '.join(repr(n) for n in twice)} named twice in {names}")
    if any(not n.strip() for n in names):
        raise ConfigError(f"offload.activations: empty name in {names}")
    if names and getattr(model, "remat", None) == "none":
        raise ConfigError("offload.activations: saving activations to host instead of recomputing them needs "
                          "model.remat=full or save_matmuls (with remat none nothing is recomputed, and the "
                          "backward pass keeps derivative terms, not the named activations)")
    if o.params != "host":
        return
    if getattr(model, "scan_layers", None) is False and cfg.mesh.stage == 1:
        raise ConfigError("offload.params: host fetches each layer's weights inside the scan over stacked "
                          "layers; set model.scan_layers=true")
    if getattr(model, "remat", None) == "none":
        raise ConfigError("offload.params: host needs model.remat=full or save_matmuls (with remat none the "
                          "backward pass would keep every layer's fetched weights in device memory)")
    if cfg.mesh.stage > 1:
        raise ConfigError(f"offload.params: host is not supported with pipeline stages (mesh.stage="
                          f"{cfg.mesh.stage}); use mesh.stage=1")


def _check_data(cfg: "Config") -> None:
    d = cfg.data
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {d.val_fraction}")
    if d.mixture and d.mode == "windows":
        raise ConfigError("data.mixture: needs data.mode=packed or padded (windows reads one data.path)")
    if d.format not in ("auto", "text") and d.mode == "windows":
        raise ConfigError(f"data.format: {d.format} needs data.mode=packed or padded (windows reads plain text)")
    for key, w in d.mixture.items():
        if w <= 0:
            raise ConfigError(f"data.mixture: weight of '{key}' must be > 0, got {w}")
    if d.tokenizer in ("hf", "sentencepiece") and not d.tokenizer_path:
        raise ConfigError(f"data.tokenizer_path: data.tokenizer={d.tokenizer} needs a local tokenizer file")
    if d.tokenizer in ("byte", "char") and d.tokenizer_path:  # set, but it would be silently unused
        raise ConfigError(f"data.tokenizer_path: '{d.tokenizer_path}' is not read by data.tokenizer={d.tokenizer}; "
                          f"set data.tokenizer=hf (tokenizer.json) or sentencepiece (.model), or leave the path out")
    if d.prefetch < 1:  # the Grain pipeline clamped it to 1
        raise ConfigError(f"data.prefetch: must be >= 1 (batches assembled ahead), got {d.prefetch}")
    if (d.add_bos or d.add_eos) and d.mode == "windows":
        raise ConfigError("data.add_bos: BOS/EOS are added per document: use data.mode=packed or padded")


def _check_optimizer(o: OptimizerConfig) -> None:
    for key in ("lr", "min_lr", "b1", "b2", "eps", "weight_decay", "clip_norm"):
        if not math.isfinite(getattr(o, key)):
            raise ConfigError(f"optimizer.{key}: must be finite, got {getattr(o, key)}")
    positive("optimizer.lr", o.lr)
    positive("optimizer.eps", o.eps)
    positive("optimizer.clip_norm", o.clip_norm)
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


def check_against_mesh(cfg: "Config", axis_sizes: dict[str, int], platform: Optional[str] = None) -> None:
    """Checks that need the resolved mesh sizes (still before any compile).

    Raises:
      ConfigError: the micro-batch not divisible by the batch axes (data*fsdp*expert), or a
        check of the model family (e.g. heads not divisible by the tensor axis, an attention
        implementation that cannot run on ``platform``, the devices' platform).
    """
    batch_div = axis_sizes["data"] * axis_sizes["fsdp"] * axis_sizes["expert"]
    if cfg.micro_batch % batch_div:
        raise ConfigError(
            f"train.global_batch: micro-batch {cfg.micro_batch} (global_batch {cfg.train.global_batch} / "
            f"grad_accum {cfg.train.grad_accum}) is not divisible by data*fsdp*expert = "
            f"{axis_sizes['data']}*{axis_sizes['fsdp']}*{axis_sizes['expert']} = {batch_div}")
    check_pipeline_against_mesh(cfg, axis_sizes)
    if platform is not None:
        check_kernels(cfg, axis_sizes, platform)
    cfg.model.check_against_mesh(cfg, axis_sizes, platform)


def kernel_values(cfg: "Config") -> dict[str, str]:
    """The configured implementation of each kernel op (``jaxtrain.kernels.registry.KEYS``) whose key the
    config has (a custom model's section has none of the model's, a family without experts no
    ``model.grouped_matmul``)."""
    model_keys = {"attention": "attention", "matmul": "matmul", "grouped_matmul": "grouped_matmul"}
    out = {op: getattr(cfg.model, key) for op, key in model_keys.items() if hasattr(cfg.model, key)}
    return {**out, "optimizer": cfg.optimizer.implementation}


def kernel_facts(cfg: "Config", axis_sizes: dict[str, int], platform: str, **known: Any) -> Any:
    """What the config says of the kernels' run (:class:`jaxtrain.kernels.registry.Facts`): the backend,
    devices, the model's dtype and attention sizes, the data's segment ids, what is offloaded; ``known``
    adds or overrides facts the caller knows better (the run plan: the state's dtypes, the length split)."""
    from jaxtrain.kernels.registry import Facts
    m, family = cfg.model, cfg.model.family != "custom"
    master, param_dtype = cfg.optimizer.master_weights, getattr(m, "param_dtype", None)
    state = ("float32",) if master or param_dtype == "float32" else (param_dtype,) if param_dtype else ()
    facts = dict(backend=platform, devices=math.prod(axis_sizes.values()), dtype=getattr(m, "dtype", None),
                 state_dtypes=state, host_state=cfg.offload.optimizer == "host" or cfg.offload.params == "host",
                 offloaded_activations=bool(cfg.offload.activations), seq_len=cfg.data.seq_len if family else None,
                 head_dim=getattr(m, "head_dim", None), heads=getattr(m, "n_heads", None),
                 kv_heads=getattr(m, "n_kv_heads", None), segment_ids=cfg.data.mode != "windows" if family else None)
    return Facts(**{**facts, **known})


def check_kernels(cfg: "Config", axis_sizes: dict[str, int], platform: str) -> None:
    """Every explicit kernel choice (``model.attention``, ``model.matmul``, ``model.grouped_matmul``,
    ``optimizer.implementation``) can run here, as far as the config shows (the run plan also asks
    whether its library built).

    Raises:
      ConfigError (AttentionBackendError for ``model.attention``): ``<key>=<value> cannot run here: <why>``.
    """
    from jaxtrain.kernels import registry
    facts = kernel_facts(cfg, axis_sizes, platform)
    for op, value in kernel_values(cfg).items():
        registry.check(op, value, facts)


def check_pipeline_against_mesh(cfg: "Config", axis_sizes: dict[str, int]) -> None:
    """With ``mesh.stage > 1``: the micro-batch splits into pipeline microbatches that the batch axes
    still divide, the model pipelines (a family built on the shared decoder) and the schedule fits.

    Raises:
      ConfigError: naming the key and what would divide.
    """
    stages = axis_sizes.get("stage", 1)
    p = cfg.pipeline
    if stages == 1:  # a pipeline key without a pipeline would be ignored: named instead
        for key, default in (("schedule", "gpipe"), ("microbatches", 0), ("repeats", 1)):
            if getattr(p, key) != default:
                raise ConfigError(f"pipeline.{key}: {getattr(p, key)} without a pipeline (mesh.stage=1); set "
                                  f"mesh.stage to the number of stages, or leave pipeline.{key} at {default}")
        return
    micro, m = cfg.micro_batch, cfg.microbatches
    batch_div = axis_sizes["data"] * axis_sizes["fsdp"] * axis_sizes["expert"]
    if micro % m or (micro // m) % batch_div:
        raise ConfigError(f"pipeline.microbatches: the micro-batch of {micro} sequences splits into {m} pipeline "
                          f"microbatches of {micro / m:g}, which data*fsdp*expert = {batch_div} must divide; "
                          f"use a micro-batch that is a multiple of {m * batch_div}")
    if axis_sizes.get("sequence", 1) > 1:
        raise ConfigError(f"mesh.sequence: {axis_sizes['sequence']} with mesh.stage={stages}: ring attention "
                          f"inside the pipeline is not supported; use mesh.sequence=1")
    if p.schedule == "circular" and m < stages:
        raise ConfigError(f"pipeline.microbatches: the circular schedule needs at least as many microbatches as "
                          f"stages ({stages}), got {m}")
    if not getattr(type(cfg.model), "pipelines", False):
        raise ConfigError(f"mesh.stage: {stages} stages, but model family '{cfg.model.family}' does not pipeline "
                          f"(families built on the shared decoder do: llama, mixtral); use mesh.stage=1")
