"""Held-out evaluation: greedy completions scored by the spec's reward functions."""

from __future__ import annotations

import math

import torch

from grpo_core.train.data import Prompt
from grpo_core.train.step import as_completions, columns_of
from grpo_core.train.scoring import score


def evaluate(run) -> dict[str, float]:
    """``eval/reward`` and ``eval/rewards/<name>`` (mean over held-out prompts; for an
    accuracy reward that is the greedy accuracy), plus mean completion length.

    With several processes each evaluates every N-th prompt and the scores are gathered,
    so the figures are those of all held-out prompts."""
    spec = run.spec
    everything: list[Prompt] = run.eval_prompts
    if not everything:
        return {}
    dist = run.dist
    prompts = everything[dist.rank::dist.world]
    sampling = run.sampling(greedy=True, max_new_tokens=spec.eval.max_new_tokens or spec.rollout.max_new_tokens)
    totals, per_fn, lengths = [], [], []
    names: list[str] = [fn.name for fn in run.rewards]
    for start in range(0, len(prompts), spec.eval.batch_size):
        chunk = prompts[start:start + spec.eval.batch_size]
        with run.autocast():
            rollout = run.backend.generate([p.ids for p in chunk], 1, sampling)
        row_prompts, completions = as_completions(chunk, rollout)
        columns = columns_of(chunk, 1, spec.data.prompt_column)
        ids = [r[m].tolist() for r, m in zip(rollout.completion_ids, rollout.completion_mask)]
        scores = score(run.rewards, row_prompts, completions, columns, ids, spec.train.reward_errors)
        totals.append(scores.total)
        per_fn.append(scores.per_function)
        names = scores.names
        lengths.append(rollout.completion_mask.sum(dim=1).float().cpu())
    local = (totals, per_fn, lengths)
    parts = dist.gather(local) if dist.active else [local]
    total = torch.cat([t for part in parts for t in part[0]])
    table = torch.cat([t for part in parts for t in part[1]])
    out = {"eval/completions/mean_length": float(torch.cat([t for part in parts for t in part[2]]).mean())}
    valid = ~torch.isnan(total)
    out["eval/reward"] = float(total[valid].mean()) if valid.any() else math.nan
    for j, name in enumerate(names):
        col = table[:, j]
        ok = ~torch.isnan(col)
        if ok.any():
            out[f"eval/rewards/{name}"] = float(col[ok].mean())
    out["eval/prompts"] = float(len(everything))
    return out
