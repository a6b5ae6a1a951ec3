"""Rolled-out completions scored (the one path from an episode driver's rollout to scored
completions, used by the training step, the held-out evaluation and the iteration start of
iterative GRPO), and rollouts selected and concatenated by group."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_core.contracts import Episodes, ExpertRoutes, RolloutBatch
from grpo_core.contracts.routes import NOT_ROUTED
from grpo_core.train.actor.data import Prompt
from grpo_core.train.actor.scoring import RewardFn, score
from grpo_core.train.experience import Scored, Scores
from grpo_core.train.reasoning_steps import StepLayout


def as_completions(prompts: list[Prompt], rollout: RolloutBatch) -> tuple[list, list]:
    """Prompts and completions per row in TRL's convention: strings, or chat messages
    (completion ``[{"role": "assistant", "content": text}]``) for conversational data;
    a multi-turn episode's completion is its whole conversation after the prompt
    (assistant turns and the environment's messages)."""
    g = rollout.group_size
    row_prompts = [p.prompt for p in prompts for _ in range(g)]
    if rollout.episodes is not None:
        completions = [list(messages) for messages in rollout.episodes.messages]
    elif prompts and isinstance(prompts[0].prompt, list):
        completions = [[{"role": "assistant", "content": text}] for text in rollout.completions]
    else:
        completions = list(rollout.completions)
    return row_prompts, completions


def shown_completion(rollout: RolloutBatch, row: int) -> str:
    """What tables show of a row: its completion, or why its agent failed."""
    episodes = rollout.episodes
    if episodes is not None and episodes.failed is not None and bool(episodes.failed[row]):
        return str(episodes.messages[row][-1].get("content", ""))
    return rollout.completions[row]


def columns_of(prompts: list[Prompt], group_size: int, exclude: str) -> dict[str, list]:
    """Every dataset column but the prompt, repeated per completion (None where a row lacks
    one: rows of several datasets, ``data.more_sources``, need not share their columns)."""
    if not prompts:
        return {}
    keys = [k for k in dict.fromkeys(k for p in prompts for k in p.row) if k != exclude]
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


def score_rollout(scorer: Scorer, prompts: list[Prompt], rollout: RolloutBatch) -> Scored:
    """Score ``rollout`` (generated for ``prompts``) with every reward function."""
    row_prompts, completions = as_completions(prompts, rollout)
    columns = columns_of(prompts, rollout.group_size, scorer.prompt_column)
    if rollout.episodes is not None:
        columns["env_reward"] = list(rollout.episodes.env_rewards)
    ids = [row[m].tolist() for row, m in zip(rollout.completion_ids, rollout.completion_mask)]
    layout = None
    if scorer.split is not None and (scorer.with_steps or any(fn.takes_steps for fn in scorer.rewards)):
        layout = scorer.split(rollout.completions)
    steps = layout.texts if layout is not None else None
    scores = score(scorer.rewards, row_prompts, completions, columns, ids, scorer.on_error, steps)
    return Scored(prompts, rollout, scores, layout)


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


def _pad_right(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def _pad_left(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=1)


def select_rollout(r: RolloutBatch, groups: list[int]) -> RolloutBatch:
    """The prompts ``groups`` (indices, in that order) of ``r``, with their ``G`` rows each."""
    g = r.group_size
    rows = [i * g + j for i in groups for j in range(g)]
    idx, pidx = torch.tensor(rows, dtype=torch.long), torch.tensor(groups, dtype=torch.long)
    return RolloutBatch(
        r.prompt_ids[pidx], r.prompt_mask[pidx], r.completion_ids[idx], r.completion_mask[idx], r.truncated[idx],
        [r.completions[i] for i in rows], None if r.sampling_logp is None else r.sampling_logp[idx],
        None if r.episodes is None else r.episodes.select(rows),
        None if r.prompt_images is None else [r.prompt_images[i] for i in groups],
        None if r.token_versions is None else r.token_versions[idx],
        None if r.routes is None else r.routes.select(pidx, idx),
    )


def concat_rollouts(rs: list[RolloutBatch]) -> RolloutBatch:
    """Several rollouts of one group size as one: prompts left-padded, completions
    right-padded (padding outside the masks is 0); sampler log-probs, token versions and expert
    routes only if every part has them."""
    if len(rs) == 1:
        return rs[0]
    width_p, width_c = max(r.prompt_ids.shape[1] for r in rs), max(r.completion_ids.shape[1] for r in rs)
    with_logp = all(r.sampling_logp is not None for r in rs)
    return RolloutBatch(
        torch.cat([_pad_left(r.prompt_ids, width_p, 0) for r in rs]),
        torch.cat([_pad_left(r.prompt_mask, width_p, False) for r in rs]),
        torch.cat([_pad_right(r.completion_ids, width_c, 0) for r in rs]),
        torch.cat([_pad_right(r.completion_mask, width_c, False) for r in rs]),
        torch.cat([r.truncated for r in rs]),
        [c for r in rs for c in r.completions],
        torch.cat([_pad_right(r.sampling_logp, width_c, 0.0) for r in rs]) if with_logp else None,
        None if rs[0].episodes is None else Episodes.concat([r.episodes for r in rs]),
        _concat_images(rs),
        torch.cat([_pad_right(r.token_versions, width_c, 0) for r in rs])
        if all(r.token_versions is not None for r in rs) else None,
        _concat_routes(rs, width_p, width_c),
    )


def _concat_routes(rs: list[RolloutBatch], width_p: int, width_c: int) -> ExpertRoutes | None:
    """The parts' expert routes padded as their prompts and completions are (not routed there),
    or None unless every part has them."""
    if any(r.routes is None for r in rs):
        return None
    return ExpertRoutes(torch.cat([_pad_left(r.routes.prompt, width_p, NOT_ROUTED) for r in rs]),
                        torch.cat([_pad_right(r.routes.completion, width_c, NOT_ROUTED) for r in rs]))


def _concat_images(rs: list[RolloutBatch]) -> list | None:
    """The parts' prompt images in order (None entries for a text-only part), or None."""
    if all(r.prompt_images is None for r in rs):
        return None
    return [i for r in rs for i in (r.prompt_images or [None] * r.prompt_ids.shape[0])]


def select_groups(scored: Scored, groups: list[int]) -> Scored:
    """The prompts ``groups`` (indices) of ``scored``, with their ``G`` rows each."""
    g = scored.rollout.group_size
    rows = [i * g + j for i in groups for j in range(g)]
    s, lay = scored.scores, scored.layout
    idx = torch.tensor(rows, dtype=torch.long)
    rollout = select_rollout(scored.rollout, groups)
    scores = Scores(s.total[idx], s.per_function[idx], s.names, s.failed,
                    None if s.step_scores is None else s.step_scores[idx], s.weights)
    layout = None if lay is None else StepLayout([lay.spans[i] for i in rows], [lay.texts[i] for i in rows])
    return Scored([scored.prompts[i] for i in groups], rollout, scores, layout)


def concat_scored(parts: list[Scored]) -> Scored:
    """Several scored rollouts as one: prompts left-padded, completions right-padded (padding
    outside the masks is 0), step scores padded with NaN."""
    if len(parts) == 1:
        return parts[0]
    rollout = concat_rollouts([p.rollout for p in parts])
    ss = [p.scores for p in parts]
    step_scores = None
    if ss[0].step_scores is not None:
        k = max(s.step_scores.shape[1] for s in ss)
        step_scores = torch.cat([_pad_right(s.step_scores, k, math.nan) for s in ss])
    scores = Scores(torch.cat([s.total for s in ss]), torch.cat([s.per_function for s in ss]), ss[0].names,
                    sum(s.failed for s in ss), step_scores, ss[0].weights)
    layout = None
    if parts[0].layout is not None:
        layout = StepLayout([x for p in parts for x in p.layout.spans], [x for p in parts for x in p.layout.texts])
    return Scored([q for p in parts for q in p.prompts], rollout, scores, layout)
