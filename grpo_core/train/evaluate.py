"""Held-out evaluation: greedy completions scored by the spec's reward functions."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from grpo_core.contracts import SamplingParams
from grpo_core.train.data import Prompt
from grpo_core.train.distributed import Dist
from grpo_core.train.rollout import Scorer, reward_means, sample_and_score
from grpo_core.train.scoring import Scores


def evaluate(
    backend: Any, scorer: Scorer, prompts: list[Prompt], sampling: SamplingParams, *,
    batch_size: int, dist: Dist | None = None, autocast: Callable = nullcontext,
) -> dict[str, float]:
    """``eval/reward`` and ``eval/rewards/<name>`` (mean over held-out prompts; for an
    accuracy reward that is the greedy accuracy), plus mean completion length.

    With several processes each evaluates every N-th prompt and the scores are gathered,
    so the figures are those of all held-out prompts."""
    if not prompts:
        return {}
    dist = dist or Dist()
    totals, per_fn, lengths, names = [], [], [], [fn.name for fn in scorer.rewards]
    mine = prompts[dist.rank::dist.world]
    for start in range(0, len(mine), batch_size):
        scored = sample_and_score(backend, scorer, mine[start:start + batch_size], 1, sampling, autocast)
        totals.append(scored.scores.total)
        per_fn.append(scored.scores.per_function)
        lengths.append(scored.rollout.completion_mask.sum(dim=1).float().cpu())
    parts = dist.gather((totals, per_fn, lengths)) if dist.active else [(totals, per_fn, lengths)]
    everyone = Scores(
        total=torch.cat([t for part in parts for t in part[0]]),
        per_function=torch.cat([t for part in parts for t in part[1]]),
        names=names,
    )
    out = {"eval/completions/mean_length": float(torch.cat([t for part in parts for t in part[2]]).mean()),
           "eval/reward": math.nan}
    out.update(reward_means(everyone, prefix="eval/"))
    out["eval/prompts"] = float(len(prompts))
    return out
