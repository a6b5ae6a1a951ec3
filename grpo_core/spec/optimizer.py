"""The ``train.optimizer`` section of a spec: which AdamW implementation keeps the optimizer
state, and in what dtype (lr, betas, eps and weight decay stay in ``train``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_core.spec.slots import Section


class OptimizerSection(Section):
    """AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019) and the dtype
    of its two moments. Float32 AdamW keeps 8 bytes of state per trainable parameter;
    bfloat16 keeps 4 (SmolLM2-135M: 1.08 GB -> 0.54 GB)."""

    name: Literal["adamw"] = Field("adamw", description="The optimizer; AdamW is the one offered.")
    state_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="dtype of AdamW's first and second moments. float32: torch.optim.AdamW (fused "
        "where torch has the kernel). bfloat16: grpo-core's BF16StateAdamW, the same update computed "
        "in float32 with the moments stored in bfloat16, stochastically rounded so the slow-moving "
        "second moment is unbiased (Zamirai et al. 2020, 'Revisiting BFloat16 Training'); half "
        "the optimizer memory, one fused pass per slice (about 2x float32 AdamW's step time, a "
        "percent of a training step). auto: bfloat16 under train.mixed_precision: bf16 (a run that "
        "already computes in bf16) with float32 weights and no fsdp2 sharding, float32 otherwise. "
        "Weights and gradients keep model.dtype either way.",
    )

    def resolved_state_dtype(self, *, mixed_precision: str, strategy: str | None, weights: str) -> str:
        """``state_dtype`` with ``auto`` decided (see its description)."""
        if self.state_dtype != "auto":
            return self.state_dtype
        lean = mixed_precision == "bf16" and strategy != "fsdp2" and weights == "float32"
        return "bfloat16" if lean else "float32"
