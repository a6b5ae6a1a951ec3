"""Held-out evaluation: greedy completions scored by the spec's reward functions."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Callable

import torch

from grpo_core.contracts import Episodes, SamplingParams
from grpo_core.train.data import Prompt
from grpo_core.train.distributed import Dist
from grpo_core.train.episodes import episode_metrics
from grpo_core.train.rollout import Scorer, reward_means, sample_and_score
from grpo_core.train.scoring import Scores


def evaluate(
    backend: Any, scorer: Scorer, prompts: list[Prompt], sampling: SamplingParams, *,
    batch_size: int, dist: Dist | None = None, autocast: Callable = nullcontext, episodes: Any = None,
) -> dict[str, float]:
    """``eval/reward`` and ``eval/rewards/<name>`` (mean over held-out prompts; for an
    accuracy reward that is the greedy accuracy), plus mean completion length.

    With several processes each evaluates every N-th prompt and the scores are gathered,
    so the figures are those of all held-out prompts. With multi-turn ``episodes`` the
    ``eval/env/...`` metrics of :func:`~grpo_core.train.episodes.episode_metrics` are
    added (those of this process's prompts)."""
    if not prompts:
        return {}
    dist = dist or Dist()
    totals, per_fn, lengths, names = [], [], [], [fn.name for fn in scorer.rewards]
    records, masks = [], []
    mine = prompts[dist.rank::dist.world]
    for start in range(0, len(mine), batch_size):
        scored = sample_and_score(backend, scorer, mine[start:start + batch_size], 1, sampling, autocast, episodes)
        if scored.rollout.episodes is not None:
            records.append(scored.rollout.episodes)
            masks.append(scored.rollout.completion_mask.cpu())
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
    if records:
        width = max(m.shape[1] for m in masks)
        mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])
        out.update(episode_metrics(Episodes.concat(records), mask, prefix="eval/"))
    return out
