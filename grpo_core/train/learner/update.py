"""The policy update: ``mu`` passes over a rollout batch, in mini-batches (one optimizer
step each) of micro-batches (one forward/backward each).

The aggregator's normalizers are those of the whole mini-batch (:class:`BatchStats`),
computed before micro-batching, so the gradient of a step does not depend on the
micro-batch size. Rows that cannot change the gradient (advantage 0, no KL in the loss,
no entropy bonus, a policy loss that declares ``zero_advantage_is_zero_loss``) get no
forward or backward at all.

The code reads as one process's math. What several processes change (sums over them, the
passes each adds to stay in lock-step, when gradients are reduced, which module runs the
forward) is asked of the learner's parallel strategy (:mod:`grpo_core.train.learner.parallel`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from grpo_core.contracts import BatchStats, LossAggregator, PolicyLoss, PolicyLossInputs, masked_fill_zero
from grpo_core.train.learner.batch import TrainBatch, forward_logprobs, micro_batches, shares_prompts
from grpo_core.train.learner.correction import rollout_correction
from grpo_core.train.learner.optim import Optimization, StepOutcome, optimizer_step, zero_gradient_passes

if TYPE_CHECKING:
    from grpo_core.train.learner.kl import KLTerm
    from grpo_core.train.learner.parallel import Forward


@dataclass
class Objective:
    """The built components of the loss and their engine-side settings."""

    policy_loss: PolicyLoss
    aggregator: LossAggregator
    kl: KLTerm | None  # the KL term when the KL is in the loss, else None
    entropy_coef: float
    early_stop_imp_ratio: float | None
    max_length: int
    correction: Any = None  # a RolloutCorrectionSection, or None: no sampler/trainer correction

    @property
    def skips_zero_advantage_rows(self) -> bool:
        return (
            self.policy_loss.zero_advantage_is_zero_loss
            and self.kl is None
            and self.entropy_coef == 0
        )


class _Tally:
    """Token-weighted sums and maxima of per-token metrics over a mini-batch."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.maxes: dict[str, float] = {}
        self.tokens = 0

    def add(self, metrics: dict[str, Tensor], mask: Tensor) -> None:
        self.tokens += int(mask.sum())
        for name, value in metrics.items():
            value = value.detach().float()
            if value.dim() == 0:
                self.sums[name] += float(value) * int(mask.sum())
            elif name.endswith("/max"):
                masked = torch.where(mask, value, torch.full((), -math.inf))
                self.maxes[name] = max(self.maxes.get(name, -math.inf), float(masked.max()))
            else:
                self.sums[name] += float(masked_fill_zero(value, mask).sum())

    def merge(self, gather: Callable[[Any], list]) -> None:
        """Fold in every process's tally, ``gather`` collecting one object of each (token-
        weighted sums stay exact)."""
        parts = gather((dict(self.sums), dict(self.maxes), self.tokens))
        if len(parts) == 1:
            return
        self.sums, self.maxes, self.tokens = defaultdict(float), {}, 0
        for sums, maxes, tokens in parts:
            self.tokens += tokens
            for k, v in sums.items():
                self.sums[k] += v
            for k, v in maxes.items():
                self.maxes[k] = max(self.maxes.get(k, -math.inf), v)

    def result(self) -> dict[str, float]:
        out = {k: v / self.tokens for k, v in self.sums.items()} if self.tokens else {}
        out.update({k: v for k, v in self.maxes.items() if math.isfinite(v)})
        return out


class Learning(Protocol):
    """What :func:`update` reads of the learner (:class:`~grpo_core.train.learner.learner.Learner`
    has these): the model and its optimizer, the objective, the parallel strategy and the
    settings of the passes. Written here so that the update depends on nothing above it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # the learning-rate schedule, stepped once per optimizer step
    scaler: Any  # a torch.amp.GradScaler under fp16, else None
    objective: Objective
    strategy: Any  # the parallel strategy (grpo_core.train.learner.parallel)
    settings: Any  # the learner's UpdateSettings

    autocast: Callable  # () -> the mixed-precision context of forward passes

    @property
    def trains_packed(self) -> bool: ...

    @property
    def optimization(self) -> Optimization: ...


def minibatches(num_prompts: int, group_size: int, count: int) -> list[Tensor]:
    """Row indices of each mini-batch: whole groups, in order."""
    per = num_prompts // count
    return [
        torch.arange(i * per * group_size, (i + 1) * per * group_size) for i in range(count)
    ]


def micro_batch_loss(
    forward: Forward, batch: TrainBatch, rows: Tensor, objective: Objective, stats: BatchStats,
    autocast: Callable = nullcontext, share_prompt: bool = True, packed: bool = False,
):
    """The aggregated loss of ``rows`` (a scalar to backpropagate), its per-token metrics
    ``(b, T)`` and the log-probs it used: ``(loss, metrics, logp, old_logp)``; ``forward`` is
    the policy's log-prob function.

    Per token: the policy loss, times the rollout-correction weight when the backend gave
    sampler log-probs, plus ``beta * KL`` when the KL is in the loss, minus the entropy
    bonus; aggregated with the mini-batch's normalizers ``stats``."""
    m = batch.mask[rows]
    with_entropy = objective.entropy_coef > 0
    with autocast():
        logp, entropy = forward_logprobs(
            forward, batch, rows, with_entropy=with_entropy, temperature=batch.temperature,
            share_prompt=share_prompt, packed=packed,
        )
    logp = logp.float()
    old = batch.old_logp[rows] if batch.old_logp is not None else logp.detach()
    sampled = batch.sampling_logp[rows] if batch.sampling_logp is not None else None
    out = objective.policy_loss(PolicyLossInputs(logp, old, batch.advantages[rows], m, sampling_logp=sampled))
    per_token, metrics = out.loss, dict(out.metrics)
    correction = objective.correction
    if sampled is not None and correction is not None and correction.active:
        weight, extra = rollout_correction(
            old, sampled, m, level=correction.level, mode=correction.mode, cap=correction.cap,
            lower=correction.lower, reject=correction.rejection, normalize=correction.normalize,
        )
        per_token = per_token * weight
        metrics.update(extra)
    if objective.kl is not None:
        penalty, metrics["kl"] = objective.kl.loss_term(logp, batch.ref_logp[rows], m)
        per_token = per_token + penalty
    if with_entropy:
        per_token = per_token - objective.entropy_coef * entropy
        metrics["entropy"] = entropy
    return objective.aggregator(per_token, m, stats), metrics, logp, old


def _minibatch_step(learner: Learning, batch: TrainBatch, rows: Tensor, tally: _Tally, counts) -> StepOutcome:
    """One optimizer step on the mini-batch ``rows`` (:func:`~grpo_core.train.learner.optim.optimizer_step`):
    every micro-batch's forward and backward with the mini-batch's normalizers; rows that
    cannot change the gradient are skipped (see the module doc). Dropped (``dropped``) when
    the mean importance ratio exceeds ``early_stop_imp_ratio``."""
    objective, strategy = learner.objective, learner.strategy
    forward = strategy.forward(learner.model)
    n_tokens, n_seqs = strategy.total([float(batch.mask[rows].sum()), float(batch.sequences(rows))])
    stats = BatchStats(int(n_tokens), int(n_seqs), objective.max_length)
    active = rows
    if objective.skips_zero_advantage_rows:
        # the test on the batch's device, the index on the rows' (the CPU): a CUDA mask cannot index them
        active = rows[(batch.advantages[rows] != 0).any(dim=1).to(rows.device)]
    counts["rows"] += len(rows)
    counts["rows_skipped"] += len(rows) - len(active)
    s, packed = learner.settings, learner.trains_packed
    micros = [mb for mb in micro_batches(batch, active, s.micro_batch_size, s.micro_batch_tokens, packed)
              if bool(batch.mask[mb].any())]

    def loss_of(micro: Tensor, share: bool) -> tuple[Tensor, list[float]]:
        m = batch.mask[micro]
        loss, metrics, logp, old = micro_batch_loss(
            forward, batch, micro, objective, stats, learner.autocast, share_prompt=share, packed=packed
        )
        tally.add(metrics, m)
        return loss, [float(masked_fill_zero((logp.detach() - old).exp(), m).sum()), float(m.sum())]

    def idle(count: int, share: bool) -> None:
        zero_gradient_passes(forward, batch, rows[: batch.group_size] if share else rows[:1], count,
                             learner.autocast, share, packed)

    def keep(extra: list[float]) -> bool:
        ratio_sum, ratio_tokens = extra
        mean_ratio = ratio_sum / ratio_tokens if ratio_tokens else 1.0
        return objective.early_stop_imp_ratio is None or mean_ratio <= objective.early_stop_imp_ratio

    # packed: one decoder call per micro-batch whatever its rows, prompts always encoded once
    shareable = packed or all(shares_prompts(batch, mb) for mb in micros)
    return optimizer_step(learner.model, learner.optimization, strategy, micros, loss_of, idle, shareable=shareable,
                          max_grad_norm=s.max_grad_norm, extras=2, keep=keep)


def update(learner: Learning, batch: TrainBatch) -> dict[str, float]:
    """Run the learner's updates of one rollout batch (``mu`` passes of ``mini_batches``
    optimizer steps each); return averaged metrics and phase times.

    A fp16 scaler (``learner.scaler``) scales each loss before backward so that small
    float16 gradients do not underflow; gradients are unscaled before clipping, and an
    overflow (inf gradients, finite loss) skips that step and lowers the scale instead of
    counting as a non-finite update, until the scale falls below 1.

    With several processes each holds its own groups of the batch: the normalizers, the
    loss, the importance-ratio sums and the gradients are summed over processes (by the
    strategy), so every process takes the same optimizer step as one process holding the
    whole batch would.
    """
    s, scaler = learner.settings, learner.scaler
    tally, counts, times = _Tally(), defaultdict(float), defaultdict(float)
    losses, grad_norms = [], []
    for _ in range(s.mu):
        for rows in minibatches(batch.prompt_ids.shape[0], batch.group_size, s.mini_batches):
            t0 = time.perf_counter()
            done = _minibatch_step(learner, batch, rows, tally, counts)
            times["forward_backward"] += time.perf_counter() - t0 - done.optimizer_seconds
            times["optimizer"] += done.optimizer_seconds
            counts[_OUTCOME_COUNTS[done.outcome]] += 1
            if done.outcome == "updated":
                grad_norms.append(done.grad_norm)
            losses.append(done.loss)
    tally.merge(learner.strategy.gather)
    result = _update_metrics(tally, losses, grad_norms, counts, times)
    if scaler is not None:
        result["train/scaler_overflows"] = counts["scaler_overflows"]
        result["train/loss_scale"] = scaler.get_scale()
    return result


#: The metric counting each outcome of an optimizer step (:class:`~grpo_core.train.learner.optim.StepOutcome`).
_OUTCOME_COUNTS = {
    "updated": "updates", "nonfinite": "nonfinite_updates", "dropped": "dropped_minibatches",
    "overflow": "scaler_overflows",
}


def _update_metrics(tally: _Tally, losses, grad_norms, counts, times) -> dict[str, float]:
    own = ("kl", "entropy", "rollout_correction")  # logged under their own names
    result = {f"policy/{k}" if not k.startswith(own) else k: v for k, v in tally.result().items()}
    result["loss"] = sum(losses) / len(losses)
    if grad_norms:
        result["grad_norm"] = sum(grad_norms) / len(grad_norms)
    result["perf/skipped_rows_frac"] = counts["rows_skipped"] / max(counts["rows"], 1)
    result["train/nonfinite_updates"] = counts["nonfinite_updates"]
    result["train/dropped_minibatches"] = counts["dropped_minibatches"]
    result["train/updates"] = counts["updates"]
    result.update({f"time/{k}": v for k, v in times.items()})
    return result
