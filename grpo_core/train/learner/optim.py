"""AdamW and the learning-rate schedule (linear warm-up, then constant, cosine or linear decay),
and the one optimizer step every objective goes through (:func:`optimizer_step`: the GRPO
update's mini-batches and the SFT stage's steps alike)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_core.spec.models import TrainSection
from grpo_core.train.learner.batch import forward_logprobs
from grpo_core.train.learner.lean_adamw import BF16StateAdamW


def lr_factor(step: int, *, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress  # linear


def make_optimizer(model, train: TrainSection, total_updates: int):
    """AdamW with the moments in ``train.optimizer.state_dtype`` (``auto`` decided here from the
    mixed precision, the strategy and the weights' dtype), and its schedule.

    float32: torch's AdamW, fused (one kernel over all parameters) where torch supports it:
    about 10x faster than the per-tensor loop on a CPU, same update up to float rounding.
    bfloat16: :class:`~grpo_core.train.learner.lean_adamw.BF16StateAdamW` (half the state memory).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=train.lr, betas=tuple(train.adam_betas), eps=train.adam_eps, weight_decay=train.weight_decay)
    weights = "float32" if params and params[0].dtype == torch.float32 else "other"
    state_dtype = train.optimizer.resolved_state_dtype(
        mixed_precision=train.mixed_precision, strategy=train.parallel.strategy, weights=weights)
    if state_dtype == "bfloat16":
        optimizer = BF16StateAdamW(params, seed=train.seed, **kwargs)
    else:
        try:
            optimizer = torch.optim.AdamW(params, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):  # a dtype or device without a fused kernel
            optimizer = torch.optim.AdamW(params, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, warmup=train.warmup_steps, total=total_updates, schedule=train.schedule),
    )
    return optimizer, scheduler


# ----------------------------------------------------------------------------- the optimizer step
@dataclass
class Optimization:
    """What one optimizer step moves besides the weights: the optimizer, its learning-rate
    schedule (stepped once per optimizer step) and, under fp16, the gradient scaler. The
    learner has one for the GRPO updates; a stage with an optimizer of its own (SFT) another."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None = None


@dataclass
class StepOutcome:
    """How :func:`optimizer_step` ended: ``outcome`` is ``updated``, ``nonfinite`` (a non-finite
    loss or gradient: skipped), ``overflow`` (fp16: inf gradients of a finite loss, skipped and
    the scale lowered) or ``dropped`` (the objective's ``keep`` refused it); ``loss`` and
    ``extra`` are summed over micro-batches and processes; ``grad_norm`` is before clipping;
    ``optimizer_seconds`` the time from the last backward to the end."""

    outcome: str
    loss: float
    grad_norm: float
    extra: list[float]
    optimizer_seconds: float = 0.0


def zero_gradient_passes(forward: Callable, batch: Any, rows: Tensor, count: int, autocast: Callable,
                         share: bool, packed: bool) -> None:
    """``count`` forward/backward passes on ``rows`` that add exactly zero to every gradient: what
    the parallel strategy has a process run when it has fewer micro-batches than another, so
    that every process takes part in each collective."""
    for _ in range(count):
        with autocast():
            logp, _ = forward_logprobs(forward, batch, rows, with_entropy=False, temperature=batch.temperature,
                                       mask=torch.zeros_like(batch.mask[rows]), share_prompt=share, packed=packed)
        (logp.float().sum() * 0.0).backward()


def optimizer_step(
    model: torch.nn.Module, opt: Optimization, strategy: Any, micros: list[Tensor],
    loss_of: Callable[[Tensor, bool], tuple[Tensor, list[float]]], idle: Callable[[int, bool], None], *,
    shareable: bool, max_grad_norm: float | None, extras: int = 0,
    keep: Callable[[list[float]], bool] = lambda extra: True,
) -> StepOutcome:
    """One optimizer step of ``model``, whatever the objective: the micro-batches' forward and
    backward (``loss_of(rows, share_prompt) -> (loss, extra sums)``: the objective's share of
    the step's loss, already divided by the step's normalizers; ``extras`` sums of its own,
    such as the importance ratio's, totalled with the loss), the lock-step passes of the
    parallel ``strategy`` (``idle``, see :func:`zero_gradient_passes`; the passes in the order
    of ``strategy.interleave``), the sums over processes, then unscale (fp16), clip to
    ``max_grad_norm``, and step the optimizer and its schedule unless the loss or the
    gradient is not finite or ``keep(extra)`` refuses.
    Gradients are freed after it; the scaler is updated (a lower scale after an overflow)."""
    optimizer, scaler = opt.optimizer, opt.scaler
    params = [p for p in model.parameters() if p.requires_grad]
    if scaler is not None:  # its scale is made on first use: a process with no micro-batch has none
        scaler.scale(torch.zeros((), device=params[0].device))
    share = strategy.lockstep(len(micros), shareable, idle)
    plan = strategy.interleave(micros)  # None: a pass of another process's, joined with no rows
    loss, extra = 0.0, [0.0] * extras
    for i, micro in enumerate(plan):
        with strategy.grad_sync(last=i == len(plan) - 1):
            if micro is None:
                idle(1, share)
                continue
            part, sums = loss_of(micro, share)
            (scaler.scale(part) if scaler is not None else part).backward()
        loss += float(part.detach())
        extra = [a + b for a, b in zip(extra, sums, strict=True)]
    t0 = time.perf_counter()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    loss, *extra = strategy.total([loss, *extra])
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf)
    # Sharded gradients (DTensor): the norm is over the shards of every process.
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not (math.isfinite(loss) and math.isfinite(norm)):
        overflow = scaler is not None and math.isfinite(loss) and scaler.get_scale() >= 1
        outcome = "overflow" if overflow else "nonfinite"
    elif not keep(extra):
        outcome = "dropped"
    else:
        scaler.step(optimizer) if scaler is not None else optimizer.step()
        opt.scheduler.step()
        outcome = "updated"
    optimizer.zero_grad(set_to_none=True)  # no gradient memory between updates (rollout, scoring)
    if scaler is not None:
        scaler.update()  # lowers the scale after an overflow, raises it after a long run without
    return StepOutcome(outcome, loss, norm, extra, time.perf_counter() - t0)
