"""Held-out evaluation: greedy completions, and ``n`` sampled completions per prompt
(mean@n, pass@k), scored by the spec's reward functions, on the default held-out set
(the held-out split of ``data``, metrics ``eval/...``) and on each named set of
``eval.sets`` (metrics ``eval/<name>/...``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from grpo_core.contracts import Episodes, SamplingParams
from grpo_core.errors import RunError
from grpo_core.train import seeds
from grpo_core.train.actor.actor import Actor
from grpo_core.train.actor.data import Prompt, PromptSource, check_columns
from grpo_core.train.actor.drivers.episodes import episode_metrics
from grpo_core.train.actor.rollout import Scorer, reward_means
from grpo_core.train.actor.scoring import Scores
from grpo_core.train.loop.passk import mean_at_n, mean_pass_at_k


def evaluate(
    actor: Actor, scorer: Scorer, prompts: list[Prompt], sampling: SamplingParams, *, batch_size: int,
    prefix: str = "eval/",
) -> dict[str, float]:
    """``eval/reward`` and ``eval/rewards/<name>`` (mean over held-out prompts; for an
    accuracy reward that is the greedy accuracy), plus mean completion length.

    With several processes each evaluates every N-th prompt and the scores are gathered,
    so the figures are those of all held-out prompts. With multi-turn ``episodes`` the
    ``eval/env/...`` metrics of :func:`~grpo_core.train.actor.drivers.episodes.episode_metrics` are
    added (those of this process's prompts)."""
    if not prompts:
        return {}
    dist = actor.dist
    totals, per_fn, lengths, names = [], [], [], [fn.name for fn in scorer.rewards]
    records, masks = [], []
    mine = prompts[dist.rank::dist.world]
    for start in range(0, len(mine), batch_size):
        scored = actor.sample(mine[start:start + batch_size], 1, sampling, scorer)
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
    out = {f"{prefix}completions/mean_length": float(torch.cat([t for part in parts for t in part[2]]).mean()),
           f"{prefix}reward": math.nan}
    out.update(reward_means(everyone, prefix=prefix))
    out[f"{prefix}prompts"] = float(len(prompts))
    if records:
        width = max(m.shape[1] for m in masks)
        mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])
        out.update(episode_metrics(Episodes.concat(records), mask, prefix=prefix))
    return out


# ----------------------------------------------------------------------------- sampled
@dataclass(frozen=True)
class Sampled:
    """How a sampled evaluation draws and judges: ``n`` completions per prompt, pass@k for
    each of ``ks``; a sample is correct when reward function number ``correct`` scores it
    ``>= threshold``."""

    n: int
    ks: list[int]
    correct: int = 0
    threshold: float = 1.0


def evaluate_sampled(
    actor: Actor, scorer: Scorer, prompts: list[Prompt], sampling: SamplingParams, how: Sampled, *,
    batch_size: int, prefix: str = "eval/",
) -> dict[str, float]:
    """``how.n`` sampled completions per prompt: ``<prefix>mean@n`` (mean total reward over
    every sample), ``<prefix>rewards/<name>/mean@n`` per function, ``<prefix>pass@k`` for
    each of ``how.ks`` (Chen et al.'s unbiased estimator) and ``<prefix>sampled/mean_length``.

    ``sampling.seed`` seeds the draw: each process offsets it by its rank and each batch by
    its first prompt (:func:`grpo_core.train.seeds.eval_batch`), so an evaluation is
    reproducible for a given number of processes."""
    if not prompts:
        return {}
    dist, n = actor.dist, how.n
    totals, tables, hits, lengths = [], [], [], []
    mine = prompts[dist.rank::dist.world]
    for start in range(0, len(mine), batch_size):
        chunk = mine[start:start + batch_size]
        seed = None if sampling.seed is None else seeds.eval_batch(sampling.seed, dist.rank, start)
        scored = actor.sample(chunk, n, replace(sampling, seed=seed), scorer)
        totals.append(scored.scores.total)
        tables.append(scored.scores.per_function)
        hit = scored.scores.per_function[:, how.correct] >= how.threshold  # NaN (unscorable) compares False
        hits.append(hit.view(len(chunk), n).sum(dim=1))
        lengths.append(scored.rollout.completion_mask.sum(dim=1).float().cpu())
    local = (totals, tables, hits, lengths)
    parts = dist.gather(local) if dist.active else [local]
    cat = [torch.cat([t for part in parts for t in part[i]]) for i in range(4)]
    out = sampled_metrics(prefix, n, how.ks, [fn.name for fn in scorer.rewards], *cat)
    out[f"{prefix}prompts"] = float(len(prompts))
    return out


def sampled_metrics(prefix: str, n: int, ks: list[int], names: list[str], total: torch.Tensor,
                    table: torch.Tensor, correct: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """The sampled metrics from ``total (R,)``, ``table (R, F)`` and ``lengths (R,)`` of
    ``R = prompts * n`` samples and ``correct (prompts,)`` counts of correct samples."""
    out = {f"{prefix}mean@{n}": mean_at_n(total.tolist())}
    for j, name in enumerate(names):
        value = mean_at_n(table[:, j].tolist())
        if not math.isnan(value):
            out[f"{prefix}rewards/{name}/mean@{n}"] = value
    counts = [int(c) for c in correct.tolist()]
    for k in ks:
        out[f"{prefix}pass@{k}"] = mean_pass_at_k(n, counts, k)
    out[f"{prefix}sampled/mean_length"] = float(lengths.mean()) if lengths.numel() else math.nan
    return out


def correct_index(spec, rewards: list) -> int:
    """Index, among the reward functions, of the one whose score decides correctness:
    ``eval.correct.reward`` (a reward listed twice: its first entry), else ``accuracy``
    when listed, else the first one."""
    wanted = spec.eval.correct.reward
    names = [fn.name.split("#")[0] for fn in rewards]
    for candidate in ([wanted] if wanted else ["accuracy"]):
        if candidate in names:
            return names.index(candidate)
    if wanted:
        raise RunError(f"eval.correct.reward '{wanted}' is not a reward function of this run ({', '.join(names)})")
    return 0


# ----------------------------------------------------------------------------- sets
@dataclass
class EvalSet:
    """One held-out set: its rendered prompts, their prompt column, its metrics' prefix."""

    prefix: str  # "eval/" for the default set, "eval/<name>/" for a named one
    prompts: list[Prompt]
    prompt_column: str


def evaluate_sets(spec, actor: Actor, sets: list[EvalSet]) -> dict[str, float]:
    """Every set's metrics, generated and scored by the ``actor``: greedy ones
    (:func:`evaluate`) unless ``eval.greedy`` is off, sampled ones (:func:`evaluate_sampled`)
    when ``eval.n > 0``, with the actor's sampling settings changed as ``eval`` says.

    The sampled draw is seeded from ``train.seed``, the same at every evaluation, so two
    evaluations of a run differ by the weights, not by the draw."""
    e, sampling, scorer = spec.eval, actor.settings.sampling, actor.scorer
    length = e.max_new_tokens or spec.rollout.max_new_tokens
    greedy = replace(sampling, greedy=True, max_new_tokens=length)
    sampled = replace(sampling, temperature=e.temperature, top_p=e.top_p, max_new_tokens=length,
                      seed=seeds.sampled_eval(spec.train.seed))
    out: dict[str, float] = {}
    for eval_set in sets:
        if not eval_set.prompts:
            continue
        set_scorer = replace(scorer, prompt_column=eval_set.prompt_column)
        if e.greedy:
            out.update(evaluate(actor, set_scorer, eval_set.prompts, greedy, batch_size=e.batch_size,
                                prefix=eval_set.prefix))
        if e.n:
            how = Sampled(e.n, e.ks(), correct_index(spec, scorer.rewards), e.correct.threshold)
            out.update(evaluate_sampled(actor, set_scorer, eval_set.prompts, sampled, how, batch_size=e.batch_size,
                                        prefix=eval_set.prefix))
    return out


def load_eval_sets(
    spec, tokenizer, max_tokens: int, required: dict[str, str], tools: list[dict] | None = None,
    processor: Any = None,
) -> dict[str, EvalSet]:
    """The named sets of ``eval.sets``, loaded and rendered (with the environment's ``tools``
    shown to the chat template, and images by the model's ``processor``); ``required`` maps
    each column the reward functions need to who needs it."""
    out: dict[str, EvalSet] = {}
    for name, section in spec.eval.sets.items():
        dataset = section.data.build()
        try:
            rows = dataset.load(section.split)
        except RunError:
            raise
        except Exception as exc:
            raise RunError(
                f"eval.sets.{name}.data: dataset '{section.data.name}' failed to load: {type(exc).__name__}: {exc}"
            ) from exc
        if not rows:
            raise RunError(f"eval.sets.{name}: dataset '{section.data.name}' has no rows in its {section.split} split")
        needed = {section.data.prompt_column: f"eval.sets.{name}.data.prompt_column", **required}
        check_columns(rows, needed, f"eval set '{name}'")
        source = PromptSource(rows, tokenizer, section.data, seed=0, max_tokens=max_tokens, shuffle=False, tools=tools,
                              processor=processor, split=f"eval set '{name}'")
        prompts = [p for p in map(source.render, rows) if p is not None][: section.max_prompts]
        out[name] = EvalSet(f"eval/{name}/", prompts, section.data.prompt_column)
    return out
