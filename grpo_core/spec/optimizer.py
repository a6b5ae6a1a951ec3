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
    state_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of AdamW's first and second moments. float32: torch.optim.AdamW (fused "
        "where torch has the kernel). bfloat16: grpo-core's BF16StateAdamW, the same update computed "
        "in float32 with the moments stored in bfloat16, stochastically rounded so the slow-moving "
        "second moment is unbiased (Zamirai et al. 2020, 'Revisiting BFloat16 Training'); half "
        "the optimizer memory. Weights and gradients keep model.dtype either way.",
    )
