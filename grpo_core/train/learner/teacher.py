"""The teacher of on-policy distillation, engine side: the log-probs of a step's sampled tokens
under the teacher an advantage estimator holds (:attr:`grpo_core.contracts.AdvantageEstimator.teacher`)
and under the policy, computed as the KL reference's are (micro-batches, the sampling temperature,
no gradients), and the check that the teacher reads the policy's token ids.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo_core.contracts import Teacher
from grpo_core.errors import RunError
from grpo_core.train.learner.batch import TrainBatch, batch_logprobs
from grpo_core.train.learner.parallel import forward_of

if TYPE_CHECKING:
    from grpo_core.train.learner.parallel import Forward


def check_vocabulary(teacher: Teacher, tokenizer: Any) -> None:
    """A :class:`RunError` naming the teacher when its vocabulary (``teacher.vocab``) is not the
    policy tokenizer's, with a few of the tokens that differ; nothing when either is unknown."""
    if teacher.vocab is None or tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return
    policy = tokenizer.get_vocab()
    if policy == teacher.vocab:
        return
    differ = sorted(
        (t for t in set(policy) | set(teacher.vocab) if policy.get(t) != teacher.vocab.get(t)),
        key=lambda t: (policy.get(t, teacher.vocab.get(t, 0)), t),
    )
    shown = ", ".join(f"{t!r}: policy {policy.get(t)} / teacher {teacher.vocab.get(t)}" for t in differ[:3])
    raise RunError(
        f"teacher {teacher.name}: its tokenizer is not the policy's ({len(differ)} tokens differ, e.g. {shown}); "
        "on-policy distillation scores the policy's token ids with the teacher, so both must share one "
        "tokenizer (same vocabulary and ids)"
    )


def teacher_forward(model: torch.nn.Module) -> Forward:
    """The log-prob function of ``model`` wherever its parameters are: the batch goes there,
    the log-probs come back to the batch's device."""
    inner = forward_of(model)
    device = next(model.parameters()).device

    def forward(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        logp, _ = inner(prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device),
                        completion_mask.to(device), **kwargs)
        return logp.to(completion_ids.device), None

    return forward


def teacher_logprobs(teacher: Teacher, batch: TrainBatch, micro: int | list[Tensor]) -> Tensor:
    """``float (B, T)``: the log-probs of ``batch``'s sampled tokens under ``teacher.model`` at the
    batch's temperature, 0 on padding (in the teacher's own dtype: no autocast); ``micro``: rows
    per forward, or the row indices of each forward."""
    logp = batch_logprobs(teacher_forward(teacher.model), batch, micro, batch.temperature, nullcontext)
    return logp.masked_fill(~batch.mask, 0.0)
