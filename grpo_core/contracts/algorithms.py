"""The contracts of the objective's components: advantage estimators, KL penalties, policy
losses and loss aggregators (shapes: :mod:`grpo_core.contracts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


# --------------------------------------------------------------------------- advantages
@dataclass
class Teacher:
    """A model that scores the policy's sampled tokens (on-policy distillation): a causal LM
    sharing the policy's tokenizer, held by the advantage estimator that reads its log-probs
    (:attr:`AdvantageEstimator.teacher`).

    Attributes:
        model: a transformers causal LM (``get_decoder()``, ``get_output_embeddings()``, as the
            policy), in eval mode; never trained. Its forward runs where its parameters are
            (another GPU, say): the engine moves the batch there and the log-probs back.
        name: how messages name it (its path, say).
        vocab: its tokenizer's vocabulary (token -> id), or None. The engine checks before the
            first step that it equals the policy tokenizer's and stops the run, naming the
            teacher, where it does not: a teacher reading other token ids scores nonsense.
    """

    model: torch.nn.Module
    name: str = "teacher"
    vocab: dict[str, int] | None = None


@dataclass
class AdvantageInputs:
    """What an advantage estimator sees. Fields are added over versions, never removed or
    renamed; the ones after ``baseline_scores`` are None unless the engine fills them (the
    reward table always, the log-probs for an estimator with a ``teacher``).

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
        reward_scores: ``float (B, F)`` each reward function's score of each row, ``NaN``
            where that function said None; one column per entry of ``rewards`` in the spec, plus
            a last column ``"kl_penalty"`` (``-beta * sum_t KL_t``, weight 1) when the KL is in
            the reward. Filled by the engine for every estimator.
        reward_weights: ``float (F,)`` the weight of each column: wherever a row has a score,
            ``scores`` is ``sum_k reward_weights[k] * reward_scores[:, k]`` over its non-NaN
            columns.
        reward_names: ``tuple[str, ...]`` of ``F`` column names (``name#i`` when a reward is
            listed twice).
        logp: ``float (B, T)`` the policy's log-probs of the sampled tokens, computed by the
            trainer before the update (the policy the batch is trained from), 0 on padding.
            Filled, with ``teacher_logp``, for an estimator with a ``teacher``.
        teacher_logp: ``float (B, T)`` the teacher's log-probs of the same tokens at the same
            temperature, 0 on padding.
    """

    scores: Tensor
    group_ids: Tensor
    mask: Tensor
    step_scores: Tensor | None = None
    step_ends: Tensor | None = None
    step_mask: Tensor | None = None
    baseline_scores: Tensor | None = None
    reward_scores: Tensor | None = None
    reward_weights: Tensor | None = None
    reward_names: tuple[str, ...] | None = None
    logp: Tensor | None = None
    teacher_logp: Tensor | None = None


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
        teacher: a :class:`Teacher`, or None (default). When set, the engine computes each
            step the log-probs of the sampled tokens under the teacher and under the policy
            (a reference-model-like forward of each, in the learner's micro-batches, without
            gradients) and fills ``inputs.teacher_logp`` and ``inputs.logp``.
    """

    needs_step_scores: bool = False
    needs_greedy_baseline: bool = False
    teacher: Teacher | None = None

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
        sampling_logp: log-probs under the sampler that generated the tokens (no grad), as
            the rollout backend returned them (vLLM; ``hf`` from its bf16 copy), or the
            behaviour policy's of an asynchronous run; None when the tokens were sampled from
            the trained weights themselves. For losses that tell the sampler's
            drift from the update's (off-policy sequence masking, M2PO).
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    sampling_logp: Tensor | None = None


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
