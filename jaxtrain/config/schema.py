"""The typed run-config schema.

A tree of pydantic models with ``extra='forbid'`` and strict types; the value checks
(``jaxtrain.config.checks``) raise :class:`ConfigError` whose message starts with the
offending dotted key, all before anything is compiled. Loading from YAML + overrides is
in ``jaxtrain.config.loading``.

The ``model:`` section is a union discriminated by ``model.family``: each family in
``jaxtrain.models.registry`` brings its own config class (a :class:`ModelConfig`), and
``family: custom`` (:class:`CustomModelConfig`) is a model built in Python and given to
``jaxtrain.fit``. The built-in defaults *are* the default job: a small ``llama`` trained
byte-level on the running interpreter's standard library (``data.path: stdlib``).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, SerializeAsAny, field_validator, model_validator

from jaxtrain.config.base import (  # noqa: F401
    DEFAULT_FAMILY,
    MESH_AXES,
    SINKS,
    CustomModelConfig,
    ModelConfig,
    Section,
    implementation_key,
)
from jaxtrain.config.checks import check_consistency
from jaxtrain.config.paths import normalize
from jaxtrain.errors import ConfigError


def _path_key(key: str):
    """A 'before' validator of the path key ``section.field``: ``file://`` made local, unsupported
    schemes refused naming the key (``jaxtrain.config.paths``)."""
    def check(cls, value: Any) -> Any:
        if isinstance(value, str):
            return normalize(key, value)
        if isinstance(value, dict):  # data.mixture: {path: weight}
            return {normalize(key, k) if isinstance(k, str) else k: v for k, v in value.items()}
        return value
    return field_validator(key.split(".")[1], mode="before")(classmethod(check))


def family_config(family: str) -> type[ModelConfig]:
    """The config class of ``model.family``. Raises ConfigError for an unknown family."""
    if family == "custom":
        return CustomModelConfig
    from jaxtrain.models import registry  # names and config classes only; no model code runs
    return registry.config_class(family)


class MeshConfig(Section):
    """Device-mesh axis sizes; at most one may be -1 (filled from the device count)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1
    stage: int = 1  # pipeline stages: the layers are split across them (the pipeline: section)
    # How many nodes (processes, or TPU slices) an axis spans, e.g. {stage: 2}: the rest of each axis
    # stays within a node, so the axes that talk most stay on the fast links (MaxText's dcn_*/ici_*).
    # Empty: the device order alone decides.
    across_nodes: dict[str, int] = {}


class PipelineConfig(Section):
    """Pipeline parallelism over ``mesh.stage`` (``jaxtrain.parallel.pipeline``). Each micro-batch
    (``train.global_batch / train.grad_accum`` sequences) is split into ``microbatches`` that flow
    through the stages; gradient accumulation steps each run a whole pipeline."""

    microbatches: int = 0  # per micro-batch; 0: mesh.stage
    schedule: Literal["gpipe", "circular", "1f1b"] = "gpipe"
    repeats: int = 1  # circular: the chunks of layers each stage holds (the bubble shrinks by as much)


# One rule candidate: a mesh axis, several mesh axes (sharded over their product), or null.
Candidate = Optional[Union[str, list[str]]]


class ShardingConfig(Section):
    rules: str = "fsdp_tp"  # a name in sharding_rules/ or a path to a YAML file
    _rules_path = _path_key("sharding.rules")
    allow_fallback: bool = False  # replicate indivisible dims (reported) instead of failing
    # {logical name: [candidates]} added to (or replacing) the rule file's entries, e.g. for the
    # logical names of a custom model: {classes: [null]}
    extra_rules: dict[str, list[Candidate]] = {}


class DataConfig(Section):
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
    _path = _path_key("data.path")
    _mixture = _path_key("data.mixture")
    _tokenizer_path = _path_key("data.tokenizer_path")


class OptimizerConfig(Section):
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
    # Low-precision params (model.param_dtype=bfloat16): keep float32 master weights and Adam
    # moments, the model computing with the bf16 cast. false: pure bf16 training (updates below
    # a weight's bf16 resolution are lost; a warning is logged).
    master_weights: bool = True
    # The step's guarded update (global norm, non-finite guard, clipping, AdamW): auto, or an implementation
    # the kernel registry lists (xla: optax's; a provider's one-kernel update, as torchtitan's
    # optimizer.implementation=fused); auto picks per backend and run (resolved.json says which and why)
    implementation: str = "auto"
    _implementation = implementation_key("optimizer", "implementation")


class OffloadConfig(Section):
    """Host-memory offload (``jaxtrain.parallel.offload``; docs/memory.md): what lives in the devices'
    ``pinned_host`` memory instead of their own, to train models bigger than device memory."""

    # host: the AdamW moments and the float32 master weights (optimizer.master_weights) live in host
    # memory between steps; the step brings them in for the update and puts them back
    optimizer: Literal["device", "host"] = "device"
    # host: every parameter lives in host memory; the shared decoder fetches one stacked layer per scan
    # iteration (needs model.scan_layers=true and model.remat full or save_matmuls)
    params: Literal["device", "host"] = "device"
    # names of tagged activations saved to host memory in the forward instead of recomputed (needs
    # model.remat full or save_matmuls), e.g. [qkv, attn_out]; the decoder families tag attn_in, qkv,
    # attn_out, mlp_in (and llama mlp_hidden)
    activations: list[str] = []


class TrainConfig(Section):
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
    gc_every: int = 50  # Python GC: automatic off in the loop, a gen-1 collection every N steps; 0: automatic
    # A train step making no progress this long ends the run (exit 5, every thread's stack in the run dir);
    # an evaluation gets eval_batches / grad_accum times as long. null: 20x the slowest step, at least 300 s.
    hang_timeout_s: Optional[float] = None
    # The loop waiting this long for a compile (the train step's; a precompiled evaluation's or sample's),
    # timed from when it needs the program, ends the run the same way (exit 5). null: no limit.
    compile_timeout_s: Optional[float] = 3600.0


class CheckpointConfig(Section):
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
    # A save not finished this long after it began ends the run (exit 4; the last committed step is
    # intact). null: wait for ever.
    save_timeout_s: Optional[float] = 1800.0
    # Resuming, a committed step whose files fail their size/CRC32C check: false stops with an error
    # naming the step and file; true resumes from the newest good step instead (the bad one is kept
    # as <step>.corrupt) and says so loudly.
    fallback: bool = False
    dir: Optional[str] = None  # local path, gs://bucket/path or s3://bucket/path; default RUN_DIR/checkpoints
    s3_endpoint: Optional[str] = None  # S3-compatible endpoint URL; default $AWS_ENDPOINT_URL, else AWS
    _dir = _path_key("checkpoint.dir")


class RunConfig(Section):
    dir: str = "runs/default"
    progress: bool = True  # rich progress bar with ETA
    # glibc keeps freed buffers up to 1 GiB for reuse (jaxtrain.runtime.host_memory): XLA:CPU allocates a
    # step's temporaries on every step, and faulting fresh pages in each time cost ~30% of a small step
    reuse_host_memory: bool = True
    _dir = _path_key("run.dir")


class MetricsConfig(Section):
    """Where metric rows go (``jaxtrain.metrics.sinks``); process 0 writes them."""

    sinks: list[str] = ["console", "jsonl"]  # any of SINKS
    mlflow_tracking_uri: Optional[str] = None  # the mlflow sink's server; default $MLFLOW_TRACKING_URI
    mlflow_experiment: str = "jaxtrain"
    wandb_project: str = "jaxtrain"
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: files in RUN_DIR/wandb, nothing sent


class ProfileConfig(Section):
    """A jax.profiler trace of steps [start_step, start_step + steps) written to <run.dir>/profile."""

    start_step: int = 5  # after compile and warm-up
    steps: int = 0  # 0: no trace


class DistributedConfig(Section):
    """Multi-process start-up (``jax.distributed``; ``jaxtrain.runtime.join``).

    ``auto`` starts it when the job's sources name several processes: these keys, jaxtrain's
    ``JAXTRAIN_*`` variables, a Ray worker's, Kubeflow's ``JAX_*``, Volcano's, a JobSet's, Vertex AI's
    ``CLUSTER_SPEC``, a SLURM step (``srun``) or a multi-host TPU slice; sources that disagree are an
    error (the table: ``jaxtrain.runtime.job``).

    ``elastic``: a run resumed on another number of batch devices (data*fsdp*expert, the -1 mesh axis
    absorbing the change) keeps ``train.global_batch`` and the per-device micro-batch
    (``device_micro_batch``) by raising or lowering ``train.grad_accum`` (``jaxtrain.train.elastic``).
    """

    mode: Literal["auto", "on", "off"] = "auto"  # on: always call jax.distributed.initialize
    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    init_timeout_s: float = 300.0  # waiting for every process to join: then a named error, exit 5
    peer_timeout_s: float = 300.0  # a peer's heartbeat silent this long (it died): a named error, exit 5
    stop_check_every: int = 1  # steps between the all-reduces that agree on a SIGTERM/SIGINT stop
    elastic: bool = True  # resumed on other devices: keep the global batch and device_micro_batch via grad_accum
    # Sequences per batch device in one micro-batch, kept by elastic resumes; null: the first run's
    # (global_batch / grad_accum / (data*fsdp*expert)), recorded in the run directory's config.yaml.
    device_micro_batch: Optional[int] = None


class Config(Section):
    model: SerializeAsAny[ModelConfig] = Field(default_factory=lambda: family_config(DEFAULT_FAMILY)())
    mesh: MeshConfig = MeshConfig()
    pipeline: PipelineConfig = PipelineConfig()
    sharding: ShardingConfig = ShardingConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    run: RunConfig = RunConfig()
    metrics: MetricsConfig = MetricsConfig()
    profile: ProfileConfig = ProfileConfig()
    distributed: DistributedConfig = DistributedConfig()
    offload: OffloadConfig = OffloadConfig()

    @field_validator("model", mode="before")
    @classmethod
    def _family_schema(cls, value: Any) -> Any:
        """A mapping is validated by the config class of its ``family`` (default llama)."""
        if isinstance(value, dict):
            family = value.get("family", DEFAULT_FAMILY)
            if not isinstance(family, str):
                raise ConfigError(f"model.family: expected a family name, got {family!r}")
            return family_config(family).model_validate(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> "Config":
        check_consistency(self)
        return self

    @property
    def micro_batch(self) -> int:
        return self.train.global_batch // self.train.grad_accum

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches per micro-batch (``pipeline.microbatches``, 0: ``mesh.stage``)."""
        return self.pipeline.microbatches or max(1, self.mesh.stage)

    @property
    def decay_steps(self) -> int:
        return self.optimizer.decay_steps or self.train.steps

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")
