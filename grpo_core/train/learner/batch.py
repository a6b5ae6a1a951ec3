"""The training batch (:class:`TrainBatch`) and the passes over it: how its rows are split
into micro-batches (by rows or by packed tokens), and their log-probs under a model without
gradients (old policy, reference, teacher).

The update (:mod:`grpo_core.train.learner.update`) trains on it; the teacher of on-policy
distillation (:mod:`grpo_core.train.learner.teacher`) scores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo_core.train.learner.packing import needed_lengths
from grpo_core.train.learner.samples import SampleRows

if TYPE_CHECKING:
    from grpo_core.train.learner.parallel import Forward
    from grpo_core.train.learner.routing import Replay

@dataclass
class TrainBatch:
    """One rollout batch ready for updates (``P`` prompts, ``B = P*G`` rows, prompt-major).

    ``mask`` is the loss mask (completion tokens, minus truncated completions when the
    spec says so); ``old_logp`` is None when ``mu == 1`` with one mini-batch (the detached
    current log-probs serve); ``ref_logp`` is None unless the KL is in the loss;
    ``temperature`` is the one the rows were sampled at: every log-prob of the batch divides
    the logits by it. ``samples``: when agent episodes were split, where each row comes from
    (:mod:`grpo_core.train.learner.samples`): the rows are then training samples, ``G'`` per
    prompt; None: row ``i`` is the rollout's row ``i``. ``routes``: with routing replay, the
    experts the sampler routed every token to, which every forward of the batch forces
    (:mod:`grpo_core.train.learner.routing`).
    """

    prompt_ids: Tensor  # long (P, L)
    prompt_mask: Tensor  # bool (P, L)
    completion_ids: Tensor  # long (B, T)
    mask: Tensor  # bool (B, T)
    advantages: Tensor  # float (B, T)
    old_logp: Tensor | None = None  # float (B, T)
    ref_logp: Tensor | None = None  # float (B, T)
    sampling_logp: Tensor | None = None  # float (B, T): the sampler's, when the backend gives them
    temperature: float = 1.0
    prompt_images: list | None = None  # P PromptImages (or None each) when the prompts have images
    samples: SampleRows | None = None  # the rows' episodes when agent episodes were split
    routes: Replay | None = None  # the sampler's expert routes, forced in every forward (algorithm.routing_replay)

    def per_episode(self, t: Tensor, fill: float | bool | int = 0) -> Tensor:
        """A per-row tensor ``(B', T')`` at its rollout rows' places ``(B, T)`` (itself when no
        episode was split)."""
        return t if self.samples is None else self.samples.collapse(t, fill)

    def per_sample(self, t: Tensor, fill: float | bool | int = 0) -> Tensor:
        """A tensor of the rollout's rows ``(B, T)`` at this batch's rows ``(B', T')``."""
        return t if self.samples is None else self.samples.expand(t, fill)

    def sequences(self, rows: Tensor) -> int:
        """How many of ``rows`` are sequences for the loss aggregator (padding rows are not)."""
        return len(rows) if self.samples is None else self.samples.real(rows)

    @property
    def group_size(self) -> int:
        return self.completion_ids.shape[0] // self.prompt_ids.shape[0]


def forward_logprobs(
    forward: Forward, batch: TrainBatch, rows: Tensor, *, with_entropy: bool, temperature: float,
    mask: Tensor | None = None, share_prompt: bool = True, packed: bool = False,
):
    """Log-probs ``(b, T)`` of ``rows`` (of the tokens of ``mask``, default the batch's) by the
    log-prob function ``forward`` (:meth:`grpo_core.train.learner.parallel.OneProcess.forward`). With
    ``packed`` the rows run as one padding-free sequence, each of their prompts once
    (:mod:`grpo_core.train.learner.packing`); otherwise, with ``share_prompt``, the prompt is encoded
    once per prompt when the rows hold the same number of completions of each prompt."""
    prompt_of = rows // batch.group_size
    mask = batch.mask[rows] if mask is None else mask
    common = {"with_entropy": with_entropy, "temperature": temperature, "share_prompt": share_prompt}
    if packed:
        prompts, index = torch.unique(prompt_of, return_inverse=True)
        if batch.routes is not None:  # only then: forwards without routes keep their signature
            common["routes"] = batch.routes.select(prompts, rows)
        return forward(batch.prompt_ids[prompts], batch.prompt_mask[prompts], batch.completion_ids[rows], mask,
                       packed=True, prompt_index=index, **common)
    prompts = torch.unique_consecutive(prompt_of) if shares_prompts(batch, rows) else prompt_of  # else ragged
    if batch.prompt_images is not None:  # only then: text-only forwards keep their signature
        common["images"] = [batch.prompt_images[int(p)] for p in prompts]
    if batch.routes is not None:
        common["routes"] = batch.routes.select(prompts, rows)
    return forward(batch.prompt_ids[prompts], batch.prompt_mask[prompts], batch.completion_ids[rows], mask, **common)


def shares_prompts(batch: TrainBatch, rows: Tensor) -> bool:
    """Whether ``rows`` hold the same number (> 1) of consecutive completions of each of their
    prompts, so that each prompt can be encoded once for them."""
    prompt_of = rows // batch.group_size
    prompts, counts = torch.unique_consecutive(prompt_of, return_counts=True)
    whole = bool((counts == counts[0]).all()) and len(prompts) == len(torch.unique(prompt_of))
    return whole and int(counts[0]) > 1


def micro_batch_rows(batch: TrainBatch, micro_batch_size: int | None, micro_batch_tokens: int) -> int:
    """Rows per padded forward: ``micro_batch_size``, or whole groups of ``batch`` holding at
    most ``micro_batch_tokens`` prompt + completion positions (at least one group)."""
    if micro_batch_size:
        return micro_batch_size
    group = batch.group_size
    per_group = group * (batch.prompt_ids.shape[1] + batch.completion_ids.shape[1])
    return group * max(1, micro_batch_tokens // max(per_group, 1))


def packed_tokens(batch: TrainBatch, rows: Tensor) -> Tensor:
    """``long (b,)``: what each row adds to a packed sequence (its completion up to the token
    before its last masked one, :mod:`grpo_core.train.learner.packing`), plus its prompt's real tokens
    on the first row of each prompt that has something to run."""
    need = needed_lengths(batch.mask[rows])
    cost = (need - 1).clamp(min=0)
    prompt_of = rows // batch.group_size
    prompt_len = batch.prompt_mask.sum(dim=1)[prompt_of.to(batch.prompt_mask.device)].to(cost.device)
    active = need > 0
    seen: set[int] = set()
    for i, (prompt, runs) in enumerate(zip(prompt_of.tolist(), active.tolist())):
        if runs and prompt not in seen:
            seen.add(prompt)
            cost[i] += prompt_len[i]
    return cost


def micro_batches(batch: TrainBatch, rows: Tensor, micro_batch_size: int | None, micro_batch_tokens: int,
                  packed: bool = False) -> list[Tensor]:
    """``rows`` in micro-batches (one forward each): ``micro_batch_size`` rows each when set;
    else whole groups, as many as hold at most ``micro_batch_tokens`` positions (at least one
    group): padded positions (``micro_batch_rows``), or with ``packed`` the tokens of the packed
    sequence (:func:`packed_tokens`), so that rows of short completions fill a forward."""
    if micro_batch_size or not packed:
        return list(rows.split(micro_batch_rows(batch, micro_batch_size, micro_batch_tokens)))
    if not len(rows):
        return []
    prompt_of = rows // batch.group_size
    _, counts = torch.unique_consecutive(prompt_of, return_counts=True)
    costs = [int(c.sum()) for c in packed_tokens(batch, rows).split(counts.tolist())]
    micros, start, size, filled = [], 0, 0, 0
    for count, cost in zip(counts.tolist(), costs):
        if size and filled + cost > micro_batch_tokens:
            micros.append(rows[start:start + size])
            start, size, filled = start + size, 0, 0
        size, filled = size + count, filled + cost
    micros.append(rows[start:start + size])
    return micros


@torch.no_grad()
def batch_logprobs(forward: Forward, batch: TrainBatch, micro: int | list[Tensor], temperature: float, autocast,
                   *, packed: bool = False, strategy: Any = None) -> Tensor:
    """Log-probs ``(B, T)`` of every row by the log-prob function ``forward``, without
    gradients (old policy, reference); ``micro``: rows per forward, or the row indices of each
    forward (:func:`micro_batches`); ``packed``: each forward padding-free; ``strategy``: the
    parallel strategy of a model it shards or splits, whose processes then make as many forwards
    each, in the order it says (:meth:`grpo_core.train.learner.parallel.OneProcess.no_grad_passes`,
    :meth:`~grpo_core.train.learner.parallel.OneProcess.interleave`)."""
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=batch.completion_ids.device)
    rows = torch.arange(batch.completion_ids.shape[0])
    splits = list(rows.split(micro)) if isinstance(micro, int) else micro
    extra = strategy.no_grad_passes(len(splits)) if strategy is not None else 0  # agreed before any forward
    plan = strategy.interleave(splits) if strategy is not None else splits
    # a whole group, so that the padded path encodes its prompt once as the other processes' do
    idle = rows[: batch.group_size]
    for rows_of in plan + [None] * extra:
        with autocast():
            if rows_of is None:  # a pass of another process's: no token of this one's
                forward_logprobs(forward, batch, idle, with_entropy=False, temperature=temperature,
                                 mask=torch.zeros_like(batch.mask[idle]), packed=packed)
                continue
            logp, _ = forward_logprobs(forward, batch, rows_of, with_entropy=False, temperature=temperature,
                                       packed=packed)
        out[rows_of] = logp.float()
    return out
