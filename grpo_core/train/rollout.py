"""Rollout then score: the one path from prompts to scored completions, used by the
training step, the held-out evaluation and the iteration start of iterative GRPO."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from grpo_core.contracts import RolloutBatch, SamplingParams
from grpo_core.train.data import Prompt
from grpo_core.train.reasoning_steps import StepLayout
from grpo_core.train.scoring import RewardFn, Scores, score


def as_completions(prompts: list[Prompt], rollout: RolloutBatch) -> tuple[list, list]:
    """Prompts and completions per row in TRL's convention: strings, or chat messages
    (completion ``[{"role": "assistant", "content": text}]``) for conversational data."""
    g = rollout.group_size
    row_prompts = [p.prompt for p in prompts for _ in range(g)]
    if prompts and isinstance(prompts[0].prompt, list):
        completions = [[{"role": "assistant", "content": text}] for text in rollout.completions]
    else:
        completions = list(rollout.completions)
    return row_prompts, completions


def columns_of(prompts: list[Prompt], group_size: int, exclude: str) -> dict[str, list]:
    """Every dataset column but the prompt, repeated per completion."""
    if not prompts:
        return {}
    keys = [k for k in prompts[0].row if k != exclude]
    return {k: [p.row.get(k) for p in prompts for _ in range(group_size)] for k in keys}


@dataclass
class Scorer:
    """The reward functions and how to call them.

    ``split``: completions -> :class:`StepLayout` (the spec's step splitter), used when a
    reward function takes ``steps`` or ``with_steps`` asks for the layout (process
    supervision). ``on_error``: ``train.reward_errors``."""

    rewards: list[RewardFn]
    prompt_column: str
    on_error: str = "raise"
    split: Callable[[list], StepLayout] | None = None
    with_steps: bool = False


@dataclass
class Scored:
    """``P`` prompts, their rollout (``B = P*G`` rows), its scores and, when cut, its steps."""

    prompts: list[Prompt]
    rollout: RolloutBatch
    scores: Scores
    layout: StepLayout | None = None


def score_rollout(scorer: Scorer, prompts: list[Prompt], rollout: RolloutBatch) -> Scored:
    """Score ``rollout`` (generated for ``prompts``) with every reward function."""
    row_prompts, completions = as_completions(prompts, rollout)
    columns = columns_of(prompts, rollout.group_size, scorer.prompt_column)
    ids = [row[m].tolist() for row, m in zip(rollout.completion_ids, rollout.completion_mask)]
    layout = None
    if scorer.split is not None and (scorer.with_steps or any(fn.takes_steps for fn in scorer.rewards)):
        layout = scorer.split(rollout.completions)
    steps = layout.texts if layout is not None else None
    scores = score(scorer.rewards, row_prompts, completions, columns, ids, scorer.on_error, steps)
    return Scored(prompts, rollout, scores, layout)


def sample_and_score(
    backend: Any, scorer: Scorer, prompts: list[Prompt], group_size: int, sampling: SamplingParams,
    autocast: Callable = nullcontext,
) -> Scored:
    """Generate ``group_size`` completions of each prompt, then score them."""
    with autocast():
        rollout = backend.generate([p.ids for p in prompts], group_size, sampling)
    return score_rollout(scorer, prompts, rollout)


def reward_means(scores: Scores, prefix: str = "", suffix: str = "") -> dict[str, float]:
    """``{prefix}reward`` and ``{prefix}rewards/<name>{suffix}``: means over the rows each
    function scored (rows it scored None are left out)."""
    out: dict[str, float] = {}
    valid = ~torch.isnan(scores.total)
    if valid.any():
        out[f"{prefix}reward"] = float(scores.total[valid].mean())
    for j, name in enumerate(scores.names):
        col = scores.per_function[:, j]
        ok = ~torch.isnan(col)
        if ok.any():
            out[f"{prefix}rewards/{name}{suffix}"] = float(col[ok].mean())
    return out


def zero_spread_groups(total: torch.Tensor, group_size: int) -> torch.Tensor:
    """``bool (P,)``: groups whose ``G`` rewards are all equal (NaN equal to NaN), which carry
    no gradient under group-relative advantages."""
    groups = torch.nan_to_num(total.view(-1, group_size), nan=math.inf)
    return (groups == groups[:, :1]).all(dim=1)
