"""One GRPO training step as a composition of stages with explicit inputs and outputs:
collect (rollout, score), prepare (log-probs, KL in the reward, advantages), update,
sync. Each stage calls plugins only through their contracts."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from grpo_core.contracts import AdvantageInputs, RolloutBatch, SamplingParams
from grpo_core.errors import RunError
from grpo_core.train.baseline import greedy_baseline_scores
from grpo_core.train.data import Prompt, PromptSource
from grpo_core.train.distributed import Dist, pad_cat
from grpo_core.train.episodes import episode_metrics
from grpo_core.train.kl import KLTerm
from grpo_core.train.reasoning_steps import step_tensors
from grpo_core.train.rollout import (
    Scored,
    Scorer,
    concat_scored,
    generate_rollout,
    reward_means,
    score_rollout,
    select_groups,
    zero_spread_groups,
)
from grpo_core.train.sharding import rollout_weights
from grpo_core.train.update import Objective, TrainBatch, batch_logprobs, update


@dataclass
class Timer:
    phases: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0


@dataclass(frozen=True)
class StepSettings:
    """The spec values a step reads (``train``, ``rollout``, ``algorithm``)."""

    group_size: int
    prompts_per_step: int
    seed: int
    mu: int
    mini_batches: int
    micro_batch_size: int | None
    max_grad_norm: float | None
    mask_truncated: bool
    sampling: SamplingParams
    dynamic: Any = None  # a DynamicSamplingSection (DAPO's dynamic sampling), or None

    @classmethod
    def from_spec(cls, spec) -> StepSettings:
        r, t = spec.rollout, spec.train
        sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            stop=tuple(r.stop),
        )
        return cls(
            group_size=r.group_size, prompts_per_step=t.prompts_per_step, seed=t.seed, mu=spec.algorithm.mu,
            mini_batches=t.mini_batches, micro_batch_size=t.micro_batch_size, max_grad_norm=t.max_grad_norm,
            mask_truncated=r.mask_truncated_completions, sampling=sampling,
            dynamic=spec.algorithm.dynamic_sampling,
        )

    def step_seed(self, step: int, first_prompt: int, round_: int = 0) -> int:
        """The rollout seed of ``step`` (its rollout round ``round_``, under dynamic sampling)
        for the process whose groups start at ``first_prompt``. Steps are 65537 apart and
        rounds ``prompts_per_step`` apart, so no two (step, round, prompt) share a seed."""
        return self.seed * 1_000_003 + step * 65_537 + round_ * self.prompts_per_step + first_prompt


@dataclass
class Engine:
    """The built components a training step uses: its explicit inputs."""

    model: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    backend: Any
    scorer: Scorer
    estimator: Any
    objective: Objective
    settings: StepSettings
    kl: KLTerm | None = None
    dist: Dist = field(default_factory=Dist)
    autocast: Callable = nullcontext  # () -> the mixed-precision context of forward passes
    scaler: Any = None  # a torch.amp.GradScaler under fp16 mixed precision
    episodes: Any = None  # an EpisodeRunner (rollout.environment: multi-turn episodes), or None

    @property
    def needs_step_scores(self) -> bool:
        """The advantage estimator reads per-step scores (process supervision)."""
        return self.estimator.needs_step_scores


@dataclass
class StepResult:
    metrics: dict[str, float]
    samples: list[dict[str, Any]]  # a few rows for the completions table


# ----------------------------------------------------------------------------- collect
def _score_everywhere(engine: Engine, prompts: list[Prompt], rollout: RolloutBatch) -> Scored:
    """Score this process's rollout; with several processes a reward failure on any one
    stops all of them, with the first failing process's message."""
    failure, scored = None, None
    try:
        scored = score_rollout(engine.scorer, prompts, rollout)
    except RunError as exc:
        failure = exc
    if engine.dist.active:
        failures = [f for f in engine.dist.gather(None if failure is None else str(failure)) if f]
        if failures and failure is None:
            failure = RunError(failures[0])
    if failure is not None:
        raise failure
    return scored


def rollout_round(engine: Engine, source: PromptSource, step: int, timer: Timer, round_: int = 0) -> Scored:
    """Draw ``prompts_per_step`` prompts, keep this process's groups, generate ``G``
    completions of each and score them."""
    s = engine.settings
    prompts = source.next(s.prompts_per_step)
    first, stop = engine.dist.shard_bounds(len(prompts))
    prompts = prompts[first:stop]  # this process's groups (all of them with one process)
    sampling = replace(s.sampling, seed=s.step_seed(step, first, round_))
    with timer("generate"), engine.autocast():
        rollout = generate_rollout(engine.backend, prompts, s.group_size, sampling, engine.episodes)
    with timer("score"):
        return _score_everywhere(engine, prompts, rollout)


def _spread_metric(scored: Scored, metric: str) -> torch.Tensor:
    """``(B,)``: the values whose spread within a group decides whether it is kept."""
    scores = scored.scores
    if metric == "reward":
        return scores.total
    column = next(j for j, n in enumerate(scores.names) if n == metric or n.startswith(f"{metric}#"))
    return scores.per_function[:, column]


def collect(engine: Engine, source: PromptSource, step: int, timer: Timer) -> tuple[Scored, dict[str, float]]:
    """The step's scored groups. Under dynamic sampling (DAPO), rounds of prompts are rolled
    out until each process holds its share of ``prompts_per_step`` groups whose metric has a
    spread, or ``max_rounds`` ran out; then the first zero-spread groups fill the rest."""
    ds = engine.settings.dynamic
    if ds is None:
        return rollout_round(engine, source, step, timer), {}
    kept: list[Scored] = []
    spare: list[Scored] = []  # zero-spread groups, in order: the fill when rounds run out
    n_kept = n_spare = n_seen = rounds = 0
    while True:
        scored = rollout_round(engine, source, step, timer, rounds)
        rounds, need = rounds + 1, len(scored.prompts)
        n_seen += need
        flat = zero_spread_groups(_spread_metric(scored, ds.metric), scored.rollout.group_size).tolist()
        spread = [i for i, flat_i in enumerate(flat) if not flat_i][: need - n_kept]
        kept.append(select_groups(scored, spread))
        n_kept += len(spread)
        if n_spare < need:
            zero = [i for i, flat_i in enumerate(flat) if flat_i][: need - n_spare]
            spare.append(select_groups(scored, zero))
            n_spare += len(zero)
        if rounds >= ds.max_rounds or not engine.dist.any(n_kept < need):
            break
    filled = need - n_kept
    parts = [p for p in kept if p.prompts]
    if filled:
        parts.append(select_groups(concat_scored([p for p in spare if p.prompts]), list(range(filled))))
    metrics = {
        "dynamic_sampling/rounds": float(rounds), "dynamic_sampling/groups_kept": float(n_kept),
        "dynamic_sampling/groups_filled": float(filled), "dynamic_sampling/groups_dropped": float(n_seen - need),
        "dynamic_sampling/prompts_consumed": float(n_seen),
    }
    return concat_scored(parts), metrics


# ----------------------------------------------------------------------------- prepare
def train_batch(rollout: RolloutBatch, mask_truncated: bool) -> TrainBatch:
    """The rollout as a :class:`TrainBatch`; the loss mask drops truncated completions
    when ``mask_truncated`` (``rollout.mask_truncated_completions``)."""
    mask = rollout.completion_mask.bool()
    if mask_truncated:
        mask = mask & ~rollout.truncated.bool()[:, None]
    batch = TrainBatch(rollout.prompt_ids, rollout.prompt_mask.bool(), rollout.completion_ids, mask,
                       torch.zeros(mask.shape, device=mask.device))
    if rollout.sampling_logp is not None:
        batch.sampling_logp = rollout.sampling_logp.to(mask.device, torch.float32)
    return batch


def advantage_inputs(scored: Scored, rewards: torch.Tensor, penalty: torch.Tensor | None, mask: torch.Tensor,
                     *, with_steps: bool = False, tokenizer: Any = None) -> AdvantageInputs:
    """What the estimator sees: sequence rewards ``(B,)``, and with ``with_steps`` per-step
    scores with the token index of each step's end (found with ``tokenizer``); a KL-in-reward
    ``penalty (B,)`` counts on the last step."""
    rollout = scored.rollout
    group_ids = torch.arange(rollout.prompt_ids.shape[0], device=mask.device).repeat_interleave(rollout.group_size)
    inputs = AdvantageInputs(rewards, group_ids, mask)
    if with_steps:
        ends, step_mask = step_tensors(scored.layout, tokenizer, rollout.completion_ids,
                                       rollout.completion_mask, rollout.completions)
        step_scores = scored.scores.step_scores.to(mask.device, copy=True)
        if penalty is not None:
            last = step_mask.sum(dim=1).clamp(min=1) - 1
            rows = torch.arange(step_scores.shape[0], device=mask.device)
            step_scores[rows, last] = step_scores[rows, last] - penalty
        inputs.step_scores, inputs.step_ends, inputs.step_mask = step_scores, ends, step_mask
    return inputs


def global_advantages(estimator: Any, dist: Dist, inputs: AdvantageInputs) -> torch.Tensor:
    """The estimator's advantages ``(b, T)`` for this process's rows. With several
    processes, the inputs of all are gathered (groups renumbered, ``T`` and ``K`` padded)
    and the estimator runs on the global batch, so batch-scoped statistics match a
    single-process run; each process keeps its own rows and width."""
    if not dist.active:
        return estimator(inputs).float()
    parts = dist.gather(AdvantageInputs(*(None if t is None else t.cpu() for t in (
        inputs.scores, inputs.group_ids, inputs.mask, inputs.step_scores, inputs.step_ends, inputs.step_mask,
        inputs.baseline_scores))))
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + int(part.group_ids.max()) + 1 if part.group_ids.numel() else offsets[-1])
    steps = parts[0].step_scores is not None
    full = AdvantageInputs(
        torch.cat([p.scores for p in parts]),
        torch.cat([p.group_ids + off for p, off in zip(parts, offsets)]),
        pad_cat([p.mask for p in parts], False),
        pad_cat([p.step_scores for p in parts], 0.0) if steps else None,
        pad_cat([p.step_ends for p in parts], 0) if steps else None,
        pad_cat([p.step_mask for p in parts], False) if steps else None,
        None if parts[0].baseline_scores is None else torch.cat([p.baseline_scores for p in parts]),
    )
    adv = estimator(full).float()
    start = sum(p.scores.shape[0] for p in parts[: dist.rank])
    rows, width = inputs.mask.shape
    return adv[start: start + rows, :width].to(inputs.mask.device)


def prepare(engine: Engine, scored: Scored, timer: Timer,
            baseline: torch.Tensor | None = None) -> tuple[TrainBatch, dict[str, float]]:
    """The batch to update on: old and reference log-probs where needed, the KL penalty
    when it is in the reward, and the advantages (``baseline``: the greedy baseline's
    scores ``(B,)`` for an estimator that asks for them)."""
    s, kl = engine.settings, engine.kl
    batch = train_batch(scored.rollout, s.mask_truncated)
    micro = s.micro_batch_size or batch.mask.shape[0]
    temperature = engine.objective.temperature
    rewards, penalty, metrics = scored.scores.total.to(batch.mask.device), None, {}
    with timer("logprobs"):
        # the sampling policy's log-probs: the current ones serve only while no optimizer step
        # has moved the policy since the rollout (one pass, one mini-batch) and no KL-in-reward needs them first
        if s.mu > 1 or s.mini_batches > 1 or (kl is not None and kl.in_reward):
            batch.old_logp = batch_logprobs(engine.model, batch, micro, temperature, engine.autocast)
        if kl is not None:
            with kl.reference.active() as ref_model:
                batch.ref_logp = batch_logprobs(ref_model, batch, micro, temperature, engine.autocast)
    if kl is not None and kl.in_reward:
        rewards, penalty, metrics["kl"] = kl.penalize(rewards, batch.old_logp, batch.ref_logp, batch.mask)
    with timer("advantage"):
        inputs = advantage_inputs(scored, rewards, penalty, batch.mask,
                                  with_steps=engine.needs_step_scores, tokenizer=engine.tokenizer)
        inputs.baseline_scores = None if baseline is None else baseline.to(batch.mask.device)
        batch.advantages = global_advantages(engine.estimator, engine.dist, inputs)
    return batch, metrics


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
    if scored.layout is not None:
        out["steps/per_completion"] = sum(scored.layout.counts) / max(1, len(scored.layout.counts))
        if scores.step_scores is not None:
            found = scores.step_scores[~torch.isnan(scores.step_scores)]
            if found.numel():
                out["steps/score_mean"] = float(found.mean())
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
    g, total, mask = scored.rollout.group_size, scored.scores.total, batch.mask
    return [
        {"prompt": scored.prompts[i // g].text, "completion": scored.rollout.completions[i],
         "reward": None if math.isnan(float(total[i])) else float(total[i]),
         "advantage": float(batch.advantages[i][mask[i]].mean()) if mask[i].any() else 0.0}
        for i in range(0, len(scored.rollout.completions), max(1, g // 2))
    ]


# ----------------------------------------------------------------------------- the step
def grpo_step(engine: Engine, source: PromptSource, step: int) -> StepResult:
    """One step: collect, prepare, update, sync the backend's weights; its metrics."""
    timer, t_start, s = Timer(), time.perf_counter(), engine.settings
    with rollout_weights(engine.backend, engine.model):  # a sharded policy, gathered to generate
        scored, sampled = collect(engine, source, step, timer)
        baseline = None
        if getattr(engine.estimator, "needs_greedy_baseline", False):  # ReMax: one greedy completion per prompt
            with timer("baseline"):
                baseline = greedy_baseline_scores(engine.backend, partial(_score_everywhere, engine), scored.prompts,
                                                  s.group_size, s.sampling, engine.autocast, engine.episodes)
    batch, metrics = prepare(engine, scored, timer, baseline)
    metrics.update(sampled)
    upd = update(
        engine.model, engine.optimizer, engine.scheduler, batch, engine.objective,
        mu=s.mu, mini_batches=s.mini_batches, micro_batch_size=s.micro_batch_size,
        max_grad_norm=s.max_grad_norm, autocast=engine.autocast, dist=engine.dist, scaler=engine.scaler,
    )
    with timer("sync"):
        engine.backend.sync_weights(engine.model)
    metrics.update(reward_metrics(scored))
    metrics.update(rollout_metrics(scored.rollout, timer.phases["generate"]))
    metrics.update(upd)
    metrics.update({f"time/{k}": v for k, v in timer.phases.items()})
    metrics.update(advantage_metrics(batch))
    metrics["learning_rate"] = engine.scheduler.get_last_lr()[0]
    metrics["time/step"] = time.perf_counter() - t_start
    return StepResult(metrics, samples(scored, batch))
