"""The ``train.parallel`` section of a spec: how several processes share the model.

``ddp`` keeps a whole copy of the weights, gradients and optimizer state in every process
(data parallelism; gradients summed over processes). ``fsdp2`` shards all three over the
processes with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``, per-parameter
sharding on DTensor): each process holds ``1/N`` of them at rest and gathers a layer's
weights only while that layer runs, the memory layout of ZeRO stage 3 (Rajbhandari et al.
2020, https://arxiv.org/abs/1910.02054). ``sequence: N`` splits each sequence of the learner's
forwards over groups of ``N`` processes (Ulysses sequence parallelism,
:mod:`grpo_core.train.learner.sequence_parallel`), under either strategy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_core.spec.slots import Section


class ParallelSection(Section):
    """Data parallelism across processes: whole copies (ddp) or shards (fsdp2)."""

    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="ddp: every process holds the whole model, gradients and AdamW state; "
        "gradients are summed over processes after backward. fsdp2: PyTorch FSDP2 "
        "(torch.distributed.fsdp.fully_shard) on each decoder layer, on the input embeddings and "
        "on the root (final norm and output layer; tied input/output embeddings stay one unit "
        "there): each process keeps 1/N of the weights, gradients and optimizer state (ZeRO-3 "
        "layout, arXiv:1910.02054); weights are all-gathered per unit for forward and backward, "
        "gradients reduce-scattered. With one process both are the same step.",
    )
    reshard_after_forward: bool = Field(
        True,
        description="fsdp2: free each unit's gathered weights after its forward and gather them "
        "again for backward (least memory, ZeRO-3); false keeps them from forward to backward "
        "(one all-gather fewer per unit and step, more memory, ZeRO-2-like).",
    )
    offload: bool = Field(
        False,
        description="fsdp2: keep the weight shards, gradient shards and optimizer state in CPU "
        "memory (torch CPUOffloadPolicy); the optimizer step runs on the CPU. Least device memory, "
        "slowest step.",
    )
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="fsdp2 mixed precision (torch MixedPrecisionPolicy.param_dtype): the dtype the "
        "weights are gathered and computed in; the shards and the optimizer keep model.dtype. "
        "bfloat16 halves all-gather traffic and gathered-weight memory. null: model.dtype. This "
        "replaces train.mixed_precision (autocast) under fsdp2, which casts per operation and would "
        "gather full-precision weights; the two are not combined.",
    )
    reduce_dtype: Literal["float32", "bfloat16"] | None = Field(
        "float32",
        description="fsdp2: dtype of the gradient reduce-scatter (MixedPrecisionPolicy.reduce_dtype); "
        "float32 sums bf16 gradients without rounding each process's share. null: param_dtype.",
    )
    sequence: int = Field(
        1,
        ge=1,
        description="Sequence parallelism (DeepSpeed-Ulysses, arXiv:2309.14509): each forward of the learner "
        "(old, reference and trained log-probs, SFT) is split over groups of this many consecutive processes, "
        "each holding 1/N of the sequence's tokens (about 1/N of the activations); attention trades heads for "
        "positions with an all-to-all so that every process attends over the whole sequence on 1/N of the heads. "
        "The processes of a group run their micro-batches in turn; ddp or fsdp2 still spans every process. "
        "Must divide the process count and the model's attention and key/value heads; full-attention text models "
        "only (those train.packing runs), without model.gradient_checkpointing. 1: off.",
    )
    timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Longest wait, in seconds, of the training processes for one another: joining the "
        "process group, and each collective (gradient sums, gathers, barriers) after it "
        "(torch.distributed's process-group timeout; 1800 is PyTorch's gloo default). A process whose "
        "peer is gone or unreachable (a node down, a cut link) stops with an error after at most this "
        "long instead of hanging; with ddp the main process then checkpoints the last completed step. "
        "Long enough for the slowest process's longest lone work: its share of a step, or the main "
        "process writing a checkpoint while the others wait.",
    )


def sequence_conflicts(spec) -> list[str]:
    """What in ``spec`` cannot run with ``train.parallel.sequence > 1``; empty when it is 1."""
    size = spec.train.parallel.sequence
    if size == 1:
        return []
    out = []
    if spec.model.gradient_checkpointing:
        out.append("model.gradient_checkpointing: checkpointed layers recompute attention in backward, outside "
                   "the split forward; drop it (the split already divides the activations by the group size)")
    if spec.data.image_column is not None:
        out.append("data.image_column: prompts with images are not split over processes; set sequence: 1")
    return [f"train.parallel.sequence = {size}, but {problem}" for problem in out]


def parallel_conflicts(spec, parallel: ParallelSection | None = None) -> list[str]:
    """What in ``spec`` cannot run under ``parallel`` (default ``spec.train.parallel``) when its
    strategy is fsdp2; empty under ddp."""
    if (parallel or spec.train.parallel).strategy != "fsdp2":
        return []
    out = []
    if spec.train.mixed_precision != "no":
        out.append(
            f"train.mixed_precision: {spec.train.mixed_precision} (autocast) is not combined with fsdp2; "
            "set train.parallel.param_dtype: bfloat16 (FSDP2's mixed precision: bf16 compute, "
            "float32 shards and gradient reduction) and train.mixed_precision: no"
        )
    if spec.model.lora is not None:
        out.append("model.lora: LoRA adapters are not sharded yet; use train.parallel.strategy: ddp "
                   "(an adapter's weights are small) or drop model.lora")
    if spec.algorithm.kl.ref_sync is not None:
        out.append("algorithm.kl.ref_sync: moving a sharded reference model is not supported yet; "
                   "use train.parallel.strategy: ddp or drop ref_sync")
    if spec.algorithm.kl.reference_dtype is not None:
        out.append("algorithm.kl.reference_dtype: a reference in its own dtype is not sharded yet; drop it "
                   "(under fsdp2 the reference follows train.parallel.param_dtype)")
    if spec.train.optimizer.state_dtype == "bfloat16":  # auto is float32 under fsdp2
        out.append(f"train.optimizer.state_dtype: {spec.train.optimizer.state_dtype} moments are not "
                   "implemented for sharded (DTensor) parameters yet; use float32 (sharding already divides "
                   "the moments by the number of processes) or train.parallel.strategy: ddp")
    return out
