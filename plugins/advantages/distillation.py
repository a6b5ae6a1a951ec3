"""Advantage estimator ``opd``: on-policy distillation. A teacher (any transformers causal LM
sharing the policy's tokenizer) scores the tokens the policy sampled; the per-token reverse KL to
it is a dense reward, alone or mixed with the task's group-relative advantage.

Generalized knowledge distillation trains the student on its own samples (Agarwal et al. 2024,
"On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
https://arxiv.org/abs/2306.13649); the reverse KL's policy gradient with the sampled-token
estimate ``log pi(x_t) - log q(x_t)`` as a per-token reward is MiniLLM's (Gu et al. 2024,
https://arxiv.org/abs/2306.08543) and, with no discount, Thinking Machines' "On-Policy
Distillation" (Lu et al. 2025, https://thinkingmachines.ai/blog/on-policy-distillation/; the
tinker-cookbook's ``incorporate_kl_penalty``). Conventions: :mod:`grpo_plugins.advantages`.

The estimator holds the teacher (:class:`~grpo_core.contracts.Teacher`, loaded when the run is
built); the engine runs its forward each step, as it runs the KL reference's, and fills
``inputs.logp`` and ``inputs.teacher_logp``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from grpo_plugins.advantages.grpo import GRPOOptions, grpo_sequence_advantages
from grpo_plugins.rewards.common import resolve_device
from grpo_plugins.rewards.model import is_path_like, local_or_hub_id
from pydantic import Field, ValidationInfo, field_validator
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import AdvantageInputs, Teacher, masked_fill_zero
from grpo_core.errors import RunError
from grpo_core.groups import check_scores, per_token
from grpo_core.options import Options

__all__ = ["DistillationOptions", "OnPolicyDistillation", "TeacherOptions", "discounted_future_sum",
           "distillation_advantages", "load_teacher"]


class TeacherOptions(Options):
    """Where the teacher comes from and where its forward runs."""

    path: str = Field(
        min_length=1,
        description="The teacher: a transformers causal LM and its tokenizer, a local folder (save_pretrained format; "
        "relative to the spec's folder) or a Hugging Face Hub id (the local HF cache first; HF_HUB_OFFLINE=1 never "
        "downloads). Its tokenizer must be the policy's (same vocabulary and ids): the run stops before the first "
        "step where it is not.",
    )
    revision: str | None = Field(None, description="Hub revision of a Hub id; unset: the default branch.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "float32", description="The teacher's weights' dtype: float32 (default), bfloat16 or float16 (half the "
        "memory), or auto (the checkpoint's). Its forward runs in this dtype, without autocast.",
    )
    device: str = Field(
        "auto", min_length=1, description="torch device of the teacher ('cpu', 'cuda', 'cuda:1', ...): another GPU "
        "keeps it off the policy's; 'auto' is this process's GPU (cuda:LOCAL_RANK) when there is one, else cpu. The "
        "batch moves there for its forward and the log-probs come back.",
    )
    trust_remote_code: bool = Field(False, description="Run modelling code shipped with the checkpoint.")

    @field_validator("path")
    @classmethod
    def _local_or_hub(cls, value: str, info: ValidationInfo) -> str:
        return local_or_hub_id(value, (info.context or {}).get("base_dir"))


class DistillationOptions(Options):
    """Options of ``opd``."""

    teacher: TeacherOptions = Field(description="The teacher model.")
    kl_coef: float = Field(
        1.0, gt=0.0, allow_inf_nan=False,
        description="Weight of the reverse KL in the advantage: the per-token reward is -kl_coef * (log pi(x_t) - "
        "log q(x_t)). Default 1, the tinker-cookbook's kl_penalty_coef.",
    )
    discount: float = Field(
        0.0, ge=0.0, le=1.0,
        description="gamma of the per-token rewards' return: A_t = sum_{s >= t} gamma^(s-t) r_s. 0 (default, "
        "Thinking Machines' choice and the tinker-cookbook's kl_discount_factor): each token's own reverse KL; 1: "
        "the whole rest of the completion (MiniLLM's return).",
    )
    kl_clamp: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="Clamp each token's reverse-KL estimate to [-c, c] before it becomes a reward, or null (default, "
        "as the tinker-cookbook). verl's distillation loss clamps at 10 (loss_max_clamp).",
    )
    task_weight: float = Field(
        0.0, ge=0.0, allow_inf_nan=False,
        description="Weight of the task advantage, grpo's (with the `task` options) on the rewards, added on every "
        "token: 0 (default) distills alone (rewards are still computed and logged); 1 with kl_coef c is verl's "
        "distillation with use_task_rewards and distillation_loss_coef c (with one update per rollout).",
    )
    task: GRPOOptions = Field(default_factory=GRPOOptions, description="The task advantage's grpo options.")


def load_teacher(options: TeacherOptions) -> Teacher:
    """The teacher of ``options``: the model in eval mode, without gradients, on its device, with
    its tokenizer's vocabulary; a :class:`RunError` naming the path when it cannot load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(options.path)
    local = is_path_like(path)
    where: dict[str, Any] = {"local_files_only": True} if local else {"revision": options.revision}
    dtype = "auto" if options.dtype == "auto" else getattr(torch, options.dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=options.trust_remote_code, **where)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=options.trust_remote_code,
                                                     **where)
    except (OSError, ValueError) as exc:
        hint = "" if local else " (a Hub id: it must be in the local HF cache, or the Hub reachable)"
        raise RunError(f"advantage estimator 'opd' could not load its teacher from {path!r}{hint}: {exc}") from exc
    model = model.to(resolve_device(options.device)).eval().requires_grad_(False)
    return Teacher(model, name=repr(path), vocab=tokenizer.get_vocab())


def discounted_future_sum(rewards: Tensor, gamma: float) -> Tensor:
    """``out_t = sum_{s >= t} gamma^(s-t) rewards_s`` along the last dim ``(B, T)``; ``gamma = 0``
    is ``rewards`` itself. Positions count whether masked or not (the tinker-cookbook's
    ``discounted_future_sum_vectorized``)."""
    if gamma == 0.0:
        return rewards.clone()
    out = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return out


def distillation_advantages(
    logp: Tensor, teacher_logp: Tensor, scores: Tensor, group_ids: Tensor, mask: Tensor, *,
    kl_coef: float = 1.0, discount: float = 0.0, kl_clamp: float | None = None, task_weight: float = 0.0,
    task: dict | None = None,
) -> Tensor:
    """On-policy distillation's advantages (see the module doc for the papers).

    ``k_t = logp_t - teacher_logp_t`` (the sampled-token estimate of KL(pi || q) at token ``t``,
    clamped to ``[-kl_clamp, kl_clamp]`` when set); per-token reward ``r_t = -kl_coef * k_t`` on the
    completion tokens; ``A_t = sum_{s >= t} discount^(s-t) r_s + task_weight * G_i`` with ``G_i`` the
    grpo advantage of row ``i``'s score (0 for an unscorable row).

    Args:
        logp: ``float (B, T)`` the policy's log-probs of the sampled tokens (no gradient).
        teacher_logp: ``float (B, T)`` the teacher's.
        scores: ``float (B,)`` rewards (``NaN`` = unscorable); read only with ``task_weight > 0``.
        group_ids: ``long (B,)``; mask: ``bool (B, T)``.
        kl_coef, discount, kl_clamp, task_weight: as :class:`DistillationOptions`.
        task: ``grpo``'s options for ``G`` (``scale_by_std``, ``std``, ``std_scope``, ``eps``).

    Returns:
        ``float (B, T)``, zero on padding: each completion token's advantage.
    """
    scores = check_scores(scores, mask)
    if logp.shape != mask.shape or teacher_logp.shape != mask.shape:
        raise ValueError(f"logp and teacher_logp must be (B, T) = {tuple(mask.shape)}; got {tuple(logp.shape)} and "
                         f"{tuple(teacher_logp.shape)}")
    reverse_kl = masked_fill_zero(logp.detach(), mask) - masked_fill_zero(teacher_logp.detach(), mask)
    if kl_clamp is not None:
        reverse_kl = reverse_kl.clamp(-kl_clamp, kl_clamp)
    advantages = masked_fill_zero(discounted_future_sum(-kl_coef * reverse_kl, discount), mask)
    if task_weight > 0:
        task_adv = grpo_sequence_advantages(scores, group_ids, **(task or {}))
        advantages = advantages + task_weight * per_token(task_adv.to(advantages.dtype), mask)
    return advantages


class OnPolicyDistillation:
    """On-policy distillation: the per-token reverse KL to a teacher as a dense reward, alone or with grpo's (https://arxiv.org/abs/2306.13649)."""

    def __init__(self, options: DistillationOptions, teacher: Teacher | None = None):
        self.options = options
        self.teacher = teacher if teacher is not None else load_teacher(options.teacher)

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        if inputs.logp is None or inputs.teacher_logp is None:
            raise ValueError(
                "the 'opd' advantage estimator needs inputs.logp and inputs.teacher_logp, which the engine fills "
                "for an estimator with a teacher; call it through the engine, or set both"
            )
        o = self.options
        return distillation_advantages(
            inputs.logp, inputs.teacher_logp, inputs.scores, inputs.group_ids, inputs.mask, kl_coef=o.kl_coef,
            discount=o.discount, kl_clamp=o.kl_clamp, task_weight=o.task_weight, task=o.task.model_dump(),
        )


@hookimpl
def register_advantage_estimators(register):
    register.add("opd", OnPolicyDistillation, options=DistillationOptions)
