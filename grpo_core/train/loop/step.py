"""One GRPO training step: the feed hands over a scored batch (rollout, score) that the actor
collected, the learner prepares it (log-probs, KL in the reward, advantages) and updates, and
the new weights go back through the feed (sync). What passes from the actor to the learner is
one :class:`~grpo_core.train.experience.Experience`: the batch, its sampler log-probs and the
policy version it was sampled with; the step is the same whichever feed
(:mod:`grpo_core.train.feed`) carries it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.contracts import RolloutBatch
from grpo_core.train.actor.drivers.episodes import episode_metrics
from grpo_core.train.actor.rollout import reward_means, shown_completion, zero_spread_groups
from grpo_core.train.experience import Experience, Scored, Timer
from grpo_core.train.feed import Feed
from grpo_core.train.learner.batch import TrainBatch
from grpo_core.train.learner.learner import Learner


@dataclass
class StepResult:
    metrics: dict[str, float]
    samples: list[dict[str, Any]]  # a few rows for the completions table


# ----------------------------------------------------------------------------- metrics
def reward_metrics(scored: Scored) -> dict[str, float]:
    scores, out = scored.scores, reward_means(scored.scores, suffix="/mean")
    total = scores.total
    valid = ~torch.isnan(total)
    if valid.any():
        out["reward_std"] = float(total[valid].std(unbiased=False))
    out["reward/unscorable_frac"] = float((~valid).float().mean())
    out["reward/failed"] = float(scores.failed)
    for j, name in enumerate(scores.names):
        col = scores.per_function[:, j]
        ok = ~torch.isnan(col)
        if ok.any():
            out[f"rewards/{name}/std"] = float(col[ok].std(unbiased=False))
    out["frac_reward_zero_std"] = float(zero_spread_groups(total, scored.rollout.group_size).float().mean())
    out.update(source_metrics(scored))
    if scored.layout is not None:
        out["steps/per_completion"] = sum(scored.layout.counts) / max(1, len(scored.layout.counts))
        if scores.step_scores is not None:
            found = scores.step_scores[~torch.isnan(scores.step_scores)]
            if found.numel():
                out["steps/score_mean"] = float(found.mean())
    return out


def source_metrics(scored: Scored) -> dict[str, float]:
    """With data.source_column: each source's number of the step's prompts and mean total
    reward (with its count of scored rows, ``/rows``, so that processes combine exactly)."""
    if not scored.prompts or scored.prompts[0].source is None:
        return {}
    g, total, out = scored.rollout.group_size, scored.scores.total, {}
    for source in sorted({p.source for p in scored.prompts}):
        groups = [i for i, p in enumerate(scored.prompts) if p.source == source]
        values = torch.cat([total[i * g:(i + 1) * g] for i in groups])
        out[f"data/source/{source}/prompts"] = float(len(groups))
        found = values[~torch.isnan(values)]
        if found.numel():
            out[f"reward/source/{source}"] = float(found.mean())
            out[f"reward/source/{source}/rows"] = float(found.numel())
    return out


def rollout_metrics(rollout: RolloutBatch, generate_seconds: float) -> dict[str, float]:
    """Completion lengths count model tokens only (an episode's environment tokens are in
    the ``env/`` metrics)."""
    lengths = rollout.completion_mask.sum(dim=1).float()
    out = {
        "completions/mean_length": float(lengths.mean()),
        "completions/max_length": float(lengths.max()),
        "completions/min_length": float(lengths.min()),
        "completions/clipped_ratio": float(rollout.truncated.float().mean()),
        "perf/tokens_per_second": float(lengths.sum()) / max(generate_seconds, 1e-9),
    }
    if rollout.episodes is not None:
        out.update(episode_metrics(rollout.episodes, rollout.completion_mask))
    return out


def advantage_metrics(batch: TrainBatch) -> dict[str, float]:
    adv = batch.advantages[batch.mask]
    if not adv.numel():
        return {"advantage/mean": 0.0, "advantage/std": 0.0, "advantage/abs_max": 0.0}
    return {"advantage/mean": float(adv.mean()), "advantage/std": float(adv.std(unbiased=False)),
            "advantage/abs_max": float(adv.abs().max())}


def samples(scored: Scored, batch: TrainBatch) -> list[dict[str, Any]]:
    """Every ``G/2``-th row: prompt, completion, reward and mean advantage."""
    g, total = scored.rollout.group_size, scored.scores.total
    mask, advantages = batch.per_episode(batch.mask, False), batch.per_episode(batch.advantages)  # rows: episodes
    return [
        {"prompt": scored.prompts[i // g].text, "completion": shown_completion(scored.rollout, i),
         "reward": None if math.isnan(float(total[i])) else float(total[i]),
         "advantage": float(advantages[i][mask[i]].mean()) if mask[i].any() else 0.0}
        for i in range(0, len(scored.rollout.completions), max(1, g // 2))
    ]


# ----------------------------------------------------------------------------- the step
def train_step(feed: Feed, learner: Learner, step: int) -> StepResult:
    """One step: the feed hands over the experience of ``step``, the learner prepares and
    updates, the feed takes the new weights; the step's metrics (the feed's own among them:
    an asynchronous feed's staleness and waits, whose ``generate`` and ``score`` times are the
    actor's, spent while the learner trained on earlier batches)."""
    t_start = time.perf_counter()
    experience, feed_metrics = feed.take(step)
    batch, metrics, learner_times = learner.learn(experience)
    timer = Timer({**experience.times, **learner_times})
    with timer("sync"):
        feed.publish(learner.model, learner.version)
    metrics.update(feed_metrics)
    return _result(experience, batch, metrics, timer, learner, t_start)


def _result(experience: Experience, batch: TrainBatch, metrics: dict[str, float], timer: Timer, learner: Learner,
            t_start: float) -> StepResult:
    scored = experience.scored
    metrics.update(experience.metrics)
    metrics.update(reward_metrics(scored))
    metrics.update(rollout_metrics(scored.rollout, timer.phases["generate"]))
    metrics.update({f"time/{k}": v for k, v in timer.phases.items()})
    metrics.update(advantage_metrics(batch))
    metrics["learning_rate"] = learner.scheduler.get_last_lr()[0]
    metrics["time/step"] = time.perf_counter() - t_start
    return StepResult(metrics, samples(scored, batch))
