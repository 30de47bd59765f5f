"""``model:`` keys of the llama family (``model.family: llama``, the default)."""
from __future__ import annotations

import math
from typing import ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict

from jaxtrain.config.base import ModelConfig, implementation_key
from jaxtrain.config.checks import positive
from jaxtrain.errors import ConfigError


class RopeScaling(BaseModel):
    """``model.rope_scaling``: Llama 3.1's rotary frequency scaling (HF ``rope_type: llama3``).

    The defaults are Llama 3.1's own numbers, so ``model.rope_scaling.type=llama3`` alone turns it
    on, and any one key can be set as ``model.rope_scaling.factor=8`` (the others keep these
    values); ``model.rope_scaling=null`` turns it off. See ``rope_frequencies`` in ``model.py``.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    type: Literal["llama3"] = "llama3"
    factor: float = 8.0  # wavelengths longer than the low-frequency bound are stretched by this
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192  # the context the model was pre-trained at

    def check(self) -> None:
        """Raises ConfigError naming ``model.rope_scaling.<key>`` for a value the formula cannot use."""
        pre = "model.rope_scaling."
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{pre}{key}: must be a finite number > 0, got {value}")
        if self.factor < 1:
            raise ConfigError(f"{pre}factor: must be >= 1 (it stretches wavelengths), got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"{pre}high_freq_factor: must be > low_freq_factor={self.low_freq_factor}, "
                              f"got {self.high_freq_factor}")
        positive(f"{pre}original_max_position_embeddings", self.original_max_position_embeddings)


class LlamaConfig(ModelConfig):
    """Llama-style decoder hyper-parameters (sizes in elements; dtypes as numpy names)."""

    family: Literal["llama"] = "llama"
    vocab_size: int = 0  # 0: taken from the tokenizer
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    d_ff: int = 384
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None  # None: plain RoPE; see RopeScaling
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"  # activation/compute dtype
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # auto, or an attention the kernel registry lists (xla, blockwise, cudnn, pallas, ring, a provider's
    # fused kernel); see docs/attention.md
    attention: str = "auto"
    # the projections' matmuls, the SwiGLU MLP and RMSNorm: auto, xla, or a provider's kernels
    matmul: str = "auto"
    init_std: float = 0.02
    _attention = implementation_key("attention", "attention")
    _matmul = implementation_key("matmul", "matmul")
    scan_layers: bool = False  # stack the blocks and lax.scan over them (flat compile time in depth)
    remat: Literal["none", "full", "save_matmuls"] = "none"  # activation recompute per block
    # The context length the model is declared for (HF max_position_embeddings; None: data.seq_len).
    # Only recorded and exported: it changes no computation.
    max_positions: Optional[int] = None

    pipelines: ClassVar[bool] = True  # built on the shared decoder: mesh.stage > 1 splits its layers
    layout_keys: ClassVar[tuple[str, ...]] = (
        "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings", "param_dtype",
        "scan_layers")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def check(self, cfg) -> None:
        for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
            positive(f"model.{key}", getattr(self, key))
        if self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size: must be >= 0 (0 = from tokenizer), got {self.vocab_size}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model: {self.d_model} is not divisible by model.n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model.d_model: head dim {self.head_dim} must be even for rotary embeddings")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ConfigError(f"model.rope_theta: must be a finite number > 0, got {self.rope_theta}")
        if not (math.isfinite(self.norm_eps) and self.norm_eps >= 0):
            raise ConfigError(f"model.norm_eps: must be a finite number >= 0, got {self.norm_eps}")
        if not self.init_std > 0:  # 0 starts every weight at zero; a negative spread means nothing
            raise ConfigError(f"model.init_std: must be > 0, got {self.init_std}")
        if self.rope_scaling is not None:
            self.rope_scaling.check()
        if self.max_positions is not None:
            positive("model.max_positions", self.max_positions)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads: model.n_heads={self.n_heads} is not divisible by "
                              f"n_kv_heads={self.n_kv_heads}")

    def check_against_mesh(self, cfg, axis_sizes: dict[str, int], platform: Optional[str]) -> None:
        """Raises ConfigError: ring chunks that do not divide the length, heads / KV heads not divisible by
        the tensor axis, layers that do not split into the pipeline's stages. (Whether the kernels it
        names can run here is the kernel registry's check: ``jaxtrain.config.checks.check_kernels``.)"""
        seq = axis_sizes["sequence"]
        if self.attention == "ring" and cfg.data.seq_len % (2 * seq):
            raise ConfigError(f"data.seq_len: {cfg.data.seq_len} is not divisible by 2 * mesh.sequence = "
                              f"{2 * seq} (model.attention=ring holds two zig-zag chunks per device)")
        tp = axis_sizes["tensor"]
        for key in ("n_heads", "n_kv_heads"):
            if getattr(self, key) % tp:
                raise ConfigError(f"model.{key}: {getattr(self, key)} is not divisible by mesh.tensor={tp}")
        self._check_stages(cfg, axis_sizes.get("stage", 1), math.prod(axis_sizes.values()))

    def _check_stages(self, cfg, stages: int, devices: int) -> None:
        """The layers split evenly into the pipeline's stages (and the circular schedule's chunks); the hint
        names only stage counts that split the layers and divide the ``devices``."""
        if stages == 1:
            return
        chunks = stages * cfg.pipeline.repeats
        if self.n_layers % chunks:
            near = sorted({(self.n_layers // chunks) * chunks, (self.n_layers // chunks + 1) * chunks} - {0})
            whole = [d for d in range(2, self.n_layers + 1)
                     if self.n_layers % (d * cfg.pipeline.repeats) == 0 and devices % d == 0]
            what = f"mesh.stage={stages}" + (f" x pipeline.repeats={cfg.pipeline.repeats}"
                                             if cfg.pipeline.repeats > 1 else "")
            other = f", or mesh.stage in {whole}" if whole else ""
            raise ConfigError(f"model.n_layers: {self.n_layers} layers do not split evenly over {what} = {chunks} "
                              f"chunks; use n_layers in {near}{other}")
