"""The KL penalty to a reference policy, engine side: the reference model, the estimator
plugin, ``beta`` and where the penalty goes (the loss or the reward). The one place the
engine reads ``algorithm.kl``."""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_core.contracts import policy_copy

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Reference:
    """Log-probs under the reference policy: the base weights with the adapter disabled
    under LoRA (no second copy), else a frozen copy of the initial policy, in ``dtype``
    (``algorithm.kl.reference_dtype``; None keeps the policy's)."""

    def __init__(self, policy, dtype: str | None = None):
        self.uses_adapter = hasattr(policy, "disable_adapter")
        self.model = None
        if self.uses_adapter and dtype is not None:
            raise ValueError("reference_dtype needs a reference copy; under LoRA the reference is the policy")
        if not self.uses_adapter:
            self.model = policy_copy(policy, dtype=_DTYPES[dtype] if dtype is not None else None)
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

    @torch.no_grad()
    def mix_toward(self, policy, alpha: float) -> None:
        """``ref <- alpha * policy + (1 - alpha) * ref``, parameter by parameter (TR-DPO)."""
        if self.model is None:
            raise RuntimeError("the reference is the adapter-disabled policy; there is no copy to move")
        for ref, new in zip(self.model.parameters(), policy.parameters()):
            ref.lerp_(new.detach().to(ref.dtype), alpha)


@dataclass
class KLTerm:
    """``beta * KL(policy || reference)`` per token, estimated by the ``estimator`` plugin
    (``(logp, ref_logp, mask) -> (B, T)``), added to the loss (``placement="loss"``) or
    subtracted from each completion's reward as ``beta * sum_t KL_t`` (``"reward"``)."""

    estimator: Any
    beta: float
    placement: str = "loss"
    reference: Reference | None = None
    sync: Any = None  # a RefSyncSection: move the reference toward the policy every few steps
    adaptive: Any = None  # an AdaptiveKLSection: steer beta toward a target KL
    syncs: int = 0  # reference syncs so far

    @classmethod
    def from_spec(cls, section, policy) -> KLTerm | None:
        """The term for ``algorithm.kl``, or None when ``beta`` is 0 (no reference at all)."""
        if section.beta <= 0:
            return None
        return cls(section.build(), section.beta, section.placement, Reference(policy, section.reference_dtype),
                   sync=section.ref_sync, adaptive=section.adaptive)

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

    def after_step(self, step: int, policy, kl: float | None, rows: int) -> dict[str, float]:
        """Bookkeeping after training step ``step`` (counted from 1): adapt ``beta`` to the
        step's mean KL per token ``kl`` over its ``rows`` completions (all processes'), and
        move the reference when a sync is due. Returns ``kl/beta`` (the coefficient the
        next step uses) and ``kl/ref_syncs``."""
        if self.adaptive is not None and kl is not None and math.isfinite(kl):
            self.beta = adapted_beta(self.beta, kl, rows, target=self.adaptive.target, horizon=self.adaptive.horizon)
        if self.sync is not None and step % self.sync.every == 0:
            self.reference.mix_toward(policy, self.sync.alpha)
            self.syncs += 1
        return {"kl/beta": self.beta, "kl/ref_syncs": float(self.syncs)}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"beta": self.beta, "syncs": self.syncs}
        if self.syncs and self.reference is not None and self.reference.model is not None:
            state["reference"] = self.reference.model.state_dict()  # no longer the initial policy
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the reference syncs and, under the adaptive controller, ``beta`` (its
        state); a fixed ``beta`` comes from the spec, so ``--resume --set algorithm.kl.beta=X``
        trains with X."""
        if self.adaptive is not None:
            if float(state["beta"]) != self.beta:
                print(f"grpo-run: --resume: the adaptive KL controller continues from the checkpoint's beta "
                      f"{float(state['beta']):.6g}, not algorithm.kl.beta = {self.beta:.6g} (its start value)",
                      file=sys.stderr)
            self.beta = float(state["beta"])
        self.syncs = int(state.get("syncs", 0))
        if "reference" in state:
            self.reference.model.load_state_dict(state["reference"])


def adapted_beta(beta: float, kl: float, rows: int, *, target: float, horizon: int) -> float:
    """The adaptive KL controller's next coefficient (Ziegler et al. 2019, "Fine-Tuning
    Language Models from Human Preferences", sec. 2.2, https://arxiv.org/abs/1909.08593):
    ``beta * (1 + clip(kl / target - 1, -0.2, 0.2) * min(1, rows / horizon))``.

    ``horizon`` counts completions (rows); ``rows`` is one step's, over all processes.
    Ziegler et al. clip the proportional error to +-0.2 and take ``rows / horizon`` small
    (horizon 10,000); here the factor ``rows / horizon`` is also capped at 1, so one step
    moves beta by at most 20% whatever the horizon: the new beta is within
    ``[0.8 * beta, 1.2 * beta]``, positive whenever beta is (uncapped, a horizon below
    ``rows / 5`` drove beta negative: the penalty became a bonus)."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * min(1.0, rows / horizon))
