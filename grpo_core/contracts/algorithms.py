"""The contracts of the objective's components: advantage estimators, KL penalties, policy
losses and loss aggregators (shapes: :mod:`grpo_core.contracts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


# --------------------------------------------------------------------------- advantages
@dataclass
class AdvantageInputs:
    """What an advantage estimator sees.

    Attributes:
        scores: ``float (B,)`` sequence scores; ``NaN`` marks an unscorable completion
            (a reward function returned ``None``), which gets advantage 0 and is left out
            of its group's statistics.
        group_ids: ``long (B,)`` which prompt each row belongs to (``0 .. P-1``).
        mask: ``bool (B, T)`` completion tokens.
        step_scores: ``float (B, K)`` per-step scores for process supervision, or ``None``.
        step_ends: ``long (B, K)`` token index (into ``T``) where each step ends, or ``None``.
        step_mask: ``bool (B, K)`` which steps exist, or ``None``.
        baseline_scores: ``float (B,)`` the score of one greedy completion of each row's
            prompt (the same on every row of a group; ``NaN`` where it was unscorable), or
            ``None``; filled for an estimator that declares ``needs_greedy_baseline``.
    """

    scores: Tensor
    group_ids: Tensor
    mask: Tensor
    step_scores: Tensor | None = None
    step_ends: Tensor | None = None
    step_mask: Tensor | None = None
    baseline_scores: Tensor | None = None


@runtime_checkable
class AdvantageEstimator(Protocol):
    """``estimator(inputs) -> advantages float (B, T)``, zero where ``inputs.mask`` is False.

    It sees the whole step: with several processes the engine gathers every process's rows
    (groups renumbered, ``T`` and ``K`` padded) and calls it once on them, so a statistic over
    the batch (REINFORCE++'s whitening, say) is the one a single process would compute.

    Attributes:
        needs_step_scores: True for an estimator that reads ``inputs.step_scores``/
            ``step_ends``/``step_mask``: the engine then cuts completions into steps and
            fills them (an outcome reward's score counts on the last step). Default False.
        needs_greedy_baseline: True for an estimator that reads ``inputs.baseline_scores``
            (ReMax): the engine then generates one greedy completion per prompt with the
            rollout backend (the step's sampling settings with ``greedy=True``), scores it
            with the step's reward functions and fills them. Default False.
    """

    needs_step_scores: bool = False
    needs_greedy_baseline: bool = False

    def __call__(self, inputs: AdvantageInputs) -> Tensor: ...


# --------------------------------------------------------------------------- KL penalties
@runtime_checkable
class KLPenalty(Protocol):
    """``kl(logp, ref_logp, mask) -> float (B, T)``: a per-token estimate of KL(pi || pi_ref).

    ``logp`` and ``ref_logp`` are ``float (B, T)`` log-probabilities of the sampled tokens
    under the policy and the reference model; the output is zero where ``mask`` is False.
    """

    def __call__(self, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor: ...


# --------------------------------------------------------------------------- policy losses
@dataclass
class PolicyLossInputs:
    """What a policy loss sees; every tensor is ``(B, T)`` for the rows of one micro-batch.

    Attributes:
        logp: log-probs of the sampled tokens under the current policy (with grad).
        old_logp: log-probs under the policy that sampled them (no grad); equal to
            ``logp.detach()`` when each rollout gets one update (``mu = 1``).
        advantages: per-token advantages.
        mask: ``bool`` completion tokens.
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor


@dataclass
class PolicyLossOutput:
    """``loss``: ``float (B, T)`` per-token loss to minimise, zero on padding.

    ``metrics``: name -> tensor statistics for logging. Per-token statistics are returned
    as ``(B, T)`` tensors (zero on padding) so the engine can average them over a whole
    mini-batch; scalars are logged as they are. Conventional names: ``ratio``,
    ``clip/low``, ``clip/high``, ``clip/region``.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


@runtime_checkable
class PolicyLoss(Protocol):
    """``loss(inputs) -> PolicyLossOutput``.

    Attributes:
        zero_advantage_is_zero_loss: True when rows whose advantage is 0 contribute
            exactly 0 loss and gradient: the engine then skips their forward and backward
            when nothing else (KL, entropy) needs them. Default False.
    """

    zero_advantage_is_zero_loss: bool = False

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput: ...


# --------------------------------------------------------------------------- aggregation
@dataclass(frozen=True)
class BatchStats:
    """Normalizers of one optimizer mini-batch, computed before micro-batching and summed
    over processes, so that the gradient of a step does not depend on how the mini-batch
    is split.

    Attributes:
        num_tokens: valid completion tokens in the whole mini-batch.
        num_sequences: completions (rows) in the whole mini-batch.
        max_length: the rollout's ``max_new_tokens``: the constant of Dr. GRPO's norm.
    """

    num_tokens: int
    num_sequences: int
    max_length: int


@runtime_checkable
class LossAggregator(Protocol):
    """``aggregate(loss, mask, stats) -> scalar``.

    ``loss`` is ``float (b, T)`` for one micro-batch of ``b`` rows, ``mask`` its ``bool (b, T)``.
    The result must be a *sum of per-row contributions divided by a normalizer taken from
    ``stats``*, so that summing it over the micro-batches of a mini-batch gives the
    mini-batch's loss.
    """

    def __call__(self, loss: Tensor, mask: Tensor, stats: BatchStats) -> Tensor: ...


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with every position outside ``mask`` set to exactly 0 (NaN/inf included)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
