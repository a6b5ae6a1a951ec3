"""The KL penalty to a reference policy, engine side: the reference model, the estimator
plugin, ``beta`` and where the penalty goes (the loss or the reward). The one place the
engine reads ``algorithm.kl``."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class Reference:
    """Log-probs under the reference policy: the base weights with the adapter disabled
    under LoRA (no second copy), else a frozen copy of the initial policy."""

    def __init__(self, policy):
        self.uses_adapter = hasattr(policy, "disable_adapter")
        self.model = None
        if not self.uses_adapter:
            self.model = copy.deepcopy(policy).eval()
            self.model.requires_grad_(False)
        self.policy = policy

    @contextmanager
    def active(self):
        """Yields the model to run for reference log-probs."""
        if self.uses_adapter:
            with self.policy.disable_adapter():
                yield self.policy
        else:
            yield self.model

    def reset_to(self, policy) -> None:
        """Make the reference equal to the current policy (iterative GRPO)."""
        if self.model is not None:
            self.model.load_state_dict(policy.state_dict())


@dataclass
class KLTerm:
    """``beta * KL(policy || reference)`` per token, estimated by the ``estimator`` plugin
    (``(logp, ref_logp, mask) -> (B, T)``), added to the loss (``placement="loss"``) or
    subtracted from each completion's reward as ``beta * sum_t KL_t`` (``"reward"``)."""

    estimator: Any
    beta: float
    placement: str = "loss"
    reference: Reference | None = None

    @classmethod
    def from_spec(cls, section, policy) -> KLTerm | None:
        """The term for ``algorithm.kl``, or None when ``beta`` is 0 (no reference at all)."""
        if section.beta <= 0:
            return None
        return cls(section.build(), section.beta, section.placement, Reference(policy))

    @property
    def in_loss(self) -> bool:
        return self.placement == "loss"

    @property
    def in_reward(self) -> bool:
        return self.placement == "reward"

    def loss_term(self, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``(beta * KL_t, KL_t)``, both ``(b, T)``, for the per-token loss."""
        kl = self.estimator(logp, ref_logp, mask)
        return self.beta * kl, kl

    def penalize(self, rewards: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, float]:
        """KL in the reward: ``(rewards - beta * sum_t KL_t, beta * sum_t KL_t, mean KL per token)``;
        ``rewards`` and the penalty are ``(B,)``."""
        kl = self.estimator(logp, ref_logp, mask)
        penalty = self.beta * kl.sum(dim=1)
        return rewards - penalty, penalty, float(kl.sum() / mask.sum().clamp(min=1))
