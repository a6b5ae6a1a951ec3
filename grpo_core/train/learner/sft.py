"""The supervised update of the SFT stage: next-token cross-entropy on the completion tokens of
demonstrations, token-mean over the whole optimizer batch.

A demonstration batch is a :class:`~grpo_core.train.learner.batch.TrainBatch` with one row per
prompt (``G = 1``): the prompt left-padded, the completion right-padded, and ``mask`` the
tokens that train (the completion; in a conversation only the assistant turns, the other
turns being context, as a multi-turn episode's tool output is). So the forwards are the
policy's own (:func:`~grpo_core.train.learner.batch.forward_logprobs`, padded or packed), and

    loss = - sum_{i,t} mask[i,t] * log p(y[i,t] | y[i,<t], x_i) / sum_{i,t} mask[i,t]

with the sum in the denominator over every micro-batch and process of the optimizer step
(as TRL's SFTTrainer normalizes by the number of items in the batch), so that the gradient
does not depend on the micro-batch size or the number of processes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_core.train.learner.batch import TrainBatch, batch_logprobs, forward_logprobs, micro_batches
from grpo_core.train.learner.optim import Optimization, optimizer_step, zero_gradient_passes
from grpo_core.train.learner.parallel import OneProcess, Strategy


@dataclass(frozen=True)
class SftSettings:
    """What the SFT update reads: micro-batching (``micro_batch_size`` rows, else
    ``micro_batch_tokens`` positions), whether the forward is packed, the clipping norm."""

    micro_batch_size: int | None = None
    micro_batch_tokens: int = 2048
    packed: bool = False
    max_grad_norm: float | None = None


def demo_batch(prompts: list[list[int]], completions: list[list[int]], masks: list[list[bool]], pad_id: int,
               device: torch.device | str = "cpu") -> TrainBatch:
    """A :class:`TrainBatch` of ``b`` demonstrations (``G = 1``): prompts left-padded ``(b, L)``,
    completions right-padded ``(b, T)``, ``mask`` ``bool (b, T)`` the trained tokens."""
    b = len(prompts)
    length = max((len(p) for p in prompts), default=1)
    steps = max(1, max((len(c) for c in completions), default=1))
    prompt_ids = torch.full((b, length), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, length), dtype=torch.bool)
    completion_ids = torch.full((b, steps), pad_id, dtype=torch.long)
    mask = torch.zeros((b, steps), dtype=torch.bool)
    for i, (p, c, m) in enumerate(zip(prompts, completions, masks)):
        if p:
            prompt_ids[i, length - len(p):] = torch.tensor(p)
            prompt_mask[i, length - len(p):] = True
        if c:
            completion_ids[i, : len(c)] = torch.tensor(c)
            mask[i, : len(c)] = torch.tensor(m, dtype=torch.bool)
    return TrainBatch(prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device), mask.to(device),
                      advantages=torch.zeros(mask.shape, device=device))


def sft_micro_loss(forward: Callable, batch: TrainBatch, rows: Tensor, n_tokens: float,
                   autocast: Callable = nullcontext, packed: bool = False) -> Tensor:
    """``- sum(log p of the masked tokens of rows) / n_tokens``: this micro-batch's share of the
    optimizer step's token-mean cross-entropy (``n_tokens``: the step's masked tokens, all
    processes)."""
    with autocast():
        logp, _ = forward_logprobs(forward, batch, rows, with_entropy=False, temperature=1.0,
                                   share_prompt=False, packed=packed)
    return -(logp.float() * batch.mask[rows]).sum() / max(n_tokens, 1.0)


def sft_update(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, batch: TrainBatch,
               settings: SftSettings, strategy: Strategy | None = None, autocast: Callable = nullcontext,
               scaler: torch.amp.GradScaler | None = None) -> dict[str, float]:
    """One optimizer step on this process's rows of a demonstration batch; with several
    processes the token count, loss and gradients are summed over them (the strategy), so the
    step is the one a single process holding every row would take. A non-finite loss or
    gradient skips the step (``sft/nonfinite_updates``); with a fp16 scaler, inf gradients of a
    finite loss are an overflow instead, as in the GRPO update: the step is skipped and the
    scale lowered (``sft/scaler_overflows``, ``sft/loss_scale``) while the scale is at least 1."""
    strategy = strategy or OneProcess()
    forward = strategy.forward(model)
    rows = torch.arange(len(batch.mask))
    (n_tokens,) = strategy.total([float(batch.mask.sum())])
    micros = [mb for mb in micro_batches(batch, rows, settings.micro_batch_size, settings.micro_batch_tokens,
                                         settings.packed) if bool(batch.mask[mb].any())]

    def loss_of(micro: Tensor, share: bool) -> tuple[Tensor, list[float]]:
        return sft_micro_loss(forward, batch, micro, n_tokens, autocast, settings.packed), []

    def idle(count: int, share: bool) -> None:
        zero_gradient_passes(forward, batch, rows[:1], count, autocast, False, settings.packed)

    lr = optimizer.param_groups[0]["lr"]
    done = optimizer_step(model, Optimization(optimizer, scheduler, scaler), strategy, micros, loss_of, idle,
                          shareable=False, max_grad_norm=settings.max_grad_norm)
    metrics = {"sft/loss": done.loss, "sft/grad_norm": done.grad_norm, "sft/lr": lr, "sft/tokens": n_tokens,
               "sft/nonfinite_updates": float(done.outcome == "nonfinite")}
    if scaler is not None:
        metrics["sft/scaler_overflows"] = float(done.outcome == "overflow")
        metrics["sft/loss_scale"] = scaler.get_scale()
    return metrics


def heldout_loss(model: Any, batch: TrainBatch, settings: SftSettings, strategy: Strategy | None = None,
                 autocast: Callable = nullcontext) -> tuple[float, float]:
    """``(summed negative log-likelihood, tokens)`` of the masked tokens of ``batch`` (this
    process's held-out rows), summed over processes; no gradients."""
    strategy = strategy or OneProcess()
    rows = torch.arange(len(batch.mask))
    micro = micro_batches(batch, rows, settings.micro_batch_size, settings.micro_batch_tokens, settings.packed)
    logp = batch_logprobs(strategy.forward(model), batch, micro, 1.0, autocast, packed=settings.packed,
                          strategy=strategy)
    nll, tokens = strategy.total([float(-(logp * batch.mask).sum()), float(batch.mask.sum())])
    return nll, tokens
