"""``model:`` keys of the mixtral family (``model.family: mixtral``): a Llama with sparse MoE MLPs."""
from __future__ import annotations

import logging
import math
from typing import ClassVar, Literal, Optional

from jaxtrain.config.base import implementation_key
from jaxtrain.config.checks import positive
from jaxtrain.errors import ConfigError
from jaxtrain.models.llama.config import LlamaConfig


class MixtralConfig(LlamaConfig):
    """Mixtral-style decoder: every llama key, with ``d_ff`` the hidden size of each expert, plus routing.

    ``n_experts`` SwiGLU experts per layer, of which the router picks ``top_k`` per token.
    ``routing``: ``dropless`` (every copy is computed: sort by expert + grouped matmul) or
    ``capacity`` (``ceil(capacity_factor * tokens * top_k / n_experts)`` slots per expert and
    sequence, ``tokens`` its real ones, padding left out; copies past them are dropped).
    ``aux_loss_weight`` scales the load-balancing loss (Switch Transformer), ``z_loss_weight`` the
    router z-loss (ST-MoE); both are added to the loss.
    """

    family: Literal["mixtral"] = "mixtral"  # type: ignore[assignment]
    n_experts: int = 8
    top_k: int = 2
    routing: Literal["dropless", "capacity"] = "dropless"
    capacity_factor: float = 1.25
    # The experts' grouped matmul: auto, or one the kernel registry lists: ragged_dot (grouped GEMMs),
    # blocks (batched matmuls over blocks of sorted rows), windows (2-D matmuls over them), a provider's
    # grouped kernels; auto picks per backend and run (resolved.json says which and why)
    grouped_matmul: str = "auto"
    _grouped_matmul = implementation_key("grouped_matmul", "grouped_matmul")
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001

    layout_keys: ClassVar[tuple[str, ...]] = LlamaConfig.layout_keys + ("n_experts",)

    def check(self, cfg) -> None:
        super().check(cfg)
        positive("model.n_experts", self.n_experts)
        positive("model.top_k", self.top_k)
        if self.top_k > self.n_experts:
            raise ConfigError(f"model.top_k: {self.top_k} is more than model.n_experts={self.n_experts}")
        if not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            raise ConfigError(f"model.capacity_factor: must be a finite number > 0, got {self.capacity_factor}")
        for key in ("aux_loss_weight", "z_loss_weight"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}: must be >= 0, got {getattr(self, key)}")

    def check_against_mesh(self, cfg, axis_sizes: dict[str, int], platform: Optional[str]) -> None:
        """The llama checks, then the experts' layout under the rule set, before anything is compiled
        or written. Raises ShardingError (``jaxtrain.moe.experts.expert_layout``); notes an
        ``expert`` axis that does not split the experts."""
        super().check_against_mesh(cfg, axis_sizes, platform)
        from jaxtrain.moe.experts import expert_layout
        from jaxtrain.parallel.rules import Rules
        rules = Rules.from_config(cfg.sharding)
        tokens = (math.prod(axis_sizes.values()), cfg.data.seq_len, self.d_model)
        exp_axes, _, _ = expert_layout(rules, axis_sizes, (self.n_experts, self.d_model, self.d_ff), tokens)
        if axis_sizes.get("expert", 1) > 1 and "expert" not in exp_axes:
            logging.getLogger("jaxtrain").warning(
                "mesh.expert=%d, but rule set '%s' does not split the experts over it: every device holds all "
                "%d experts and 'expert' only splits the batch (sharding.rules=ep splits the experts)",
                axis_sizes["expert"], rules.name, self.n_experts)

    def capacity(self, seq_len: int) -> int:
        """Slots per expert and sequence of ``seq_len`` real tokens under ``routing: capacity`` (GShard's
        expert capacity; the layer sizes its buffers for the padded length and gives each sequence its
        own), in [1, seq_len]: an expert meets each token at most once, so more slots than tokens stay
        empty."""
        return min(seq_len, max(1, math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)))
