"""One GRPO step as a composition of small stages: rollout, score, log-probs,
advantages, update, sync. Each stage calls plugins only through their contracts."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_core.contracts import AdvantageInputs, RolloutBatch, SamplingParams
from grpo_core.errors import RunError
from grpo_core.train.data import Prompt
from grpo_core.train.distributed import pad_cat
from grpo_core.train.scoring import Scores, score
from grpo_core.train.steps import StepLayout, split_steps, step_tensors
from grpo_core.train.update import TrainBatch, batch_logprobs, update


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


def needs_step_scores(run) -> bool:
    """The advantage estimator reads per-step scores (process supervision)."""
    return bool(getattr(run.estimator, "needs_step_scores", False))


def score_rollout(run, prompts: list[Prompt], rollout: RolloutBatch) -> tuple[Scores, StepLayout | None]:
    """Scores of the rollout, and its steps when a reward function or the estimator needs them."""
    row_prompts, completions = as_completions(prompts, rollout)
    columns = columns_of(prompts, rollout.group_size, run.spec.data.prompt_column)
    ids = [row[m].tolist() for row, m in zip(rollout.completion_ids, rollout.completion_mask)]
    layout = None
    if needs_step_scores(run) or any(fn.takes_steps for fn in run.rewards):
        layout = split_steps(run.splitter, run.spec.algorithm.step_splitter.name, rollout.completions)
    steps = layout.texts if layout is not None else None
    return score(run.rewards, row_prompts, completions, columns, ids, run.spec.train.reward_errors, steps), layout


def _advantage_inputs(run, rollout: RolloutBatch, scores: Scores, layout: StepLayout | None,
                      rewards: torch.Tensor, seq_kl: torch.Tensor | None, mask: torch.Tensor) -> AdvantageInputs:
    """What the estimator sees: sequence rewards, and per-step scores with the token index
    of each step's end when it needs them (a KL-in-reward penalty counts on the last step)."""
    g = rollout.group_size
    group_ids = torch.arange(rollout.prompt_ids.shape[0], device=mask.device).repeat_interleave(g)
    inputs = AdvantageInputs(rewards, group_ids, mask)
    if needs_step_scores(run):
        ends, step_mask = step_tensors(layout, run.tokenizer, rollout.completion_ids,
                                       rollout.completion_mask, rollout.completions)
        step_scores = scores.step_scores.to(mask.device, copy=True)
        if seq_kl is not None:
            last = step_mask.sum(dim=1).clamp(min=1) - 1
            rows = torch.arange(step_scores.shape[0], device=mask.device)
            step_scores[rows, last] = step_scores[rows, last] - seq_kl
        inputs.step_scores, inputs.step_ends, inputs.step_mask = step_scores, ends, step_mask
    return inputs


def global_advantages(run, inputs: AdvantageInputs) -> torch.Tensor:
    """The estimator's advantages ``(b, T)`` for this process's rows. With several
    processes, the inputs of all are gathered (groups renumbered, ``T`` and ``K`` padded)
    and the estimator runs on the global batch, so batch-scoped statistics match a
    single-process run; each process keeps its own rows and width."""
    dist = run.dist
    if not dist.active:
        return run.estimator(inputs).float()
    local = inputs
    parts = dist.gather(AdvantageInputs(*(None if t is None else t.cpu() for t in (
        inputs.scores, inputs.group_ids, inputs.mask, inputs.step_scores, inputs.step_ends, inputs.step_mask))))
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
    )
    adv = run.estimator(full).float()
    start = sum(p.scores.shape[0] for p in parts[: dist.rank])
    rows, width = local.mask.shape
    return adv[start: start + rows, :width].to(local.mask.device)


def _step_metrics(scores: Scores, layout: StepLayout | None) -> dict[str, float]:
    if layout is None:
        return {}
    out = {"steps/per_completion": sum(layout.counts) / max(1, len(layout.counts))}
    if scores.step_scores is not None:
        valid = scores.step_scores[~torch.isnan(scores.step_scores)]
        if valid.numel():
            out["steps/score_mean"] = float(valid.mean())
    return out


def _reward_metrics(scores: Scores, group_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    total = scores.total
    valid = ~torch.isnan(total)
    if valid.any():
        out["reward"] = float(total[valid].mean())
        out["reward_std"] = float(total[valid].std(unbiased=False))
    out["reward/unscorable_frac"] = float((~valid).float().mean())
    out["reward/failed"] = float(scores.failed)
    for j, name in enumerate(scores.names):
        col = scores.per_function[:, j]
        ok = ~torch.isnan(col)
        if ok.any():
            out[f"rewards/{name}/mean"] = float(col[ok].mean())
            out[f"rewards/{name}/std"] = float(col[ok].std(unbiased=False))
    groups = total.view(-1, group_size)
    spread = torch.nan_to_num(groups, nan=math.inf)
    zero_std = (spread == spread[:, :1]).all(dim=1)
    out["frac_reward_zero_std"] = float(zero_std.float().mean())
    return out


def _length_metrics(rollout: RolloutBatch) -> dict[str, float]:
    lengths = rollout.completion_mask.sum(dim=1).float()
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/max_length": float(lengths.max()),
        "completions/min_length": float(lengths.min()),
        "completions/clipped_ratio": float(rollout.truncated.float().mean()),
    }


def run_step(run, step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """One step; returns its metrics and a few sample rows for the completions table."""
    spec, timer = run.spec, Timer()
    t_start = time.perf_counter()
    g = spec.rollout.group_size
    prompts = run.prompts.next(spec.train.prompts_per_step)
    first, stop = run.dist.shard_bounds(len(prompts))
    prompts = prompts[first:stop]  # this process's groups (all of them with one process)
    # Each step's seeds are 65537 apart, so no two (step, prompt) pairs share one.
    sampling = run.sampling(seed=spec.train.seed * 1_000_003 + step * 65_537 + first)
    with timer("generate"), run.autocast():
        rollout = run.backend.generate([p.ids for p in prompts], g, sampling)
    with timer("score"):
        failure = None
        try:
            scores, layout = score_rollout(run, prompts, rollout)
        except RunError as exc:
            failure = exc
        if run.dist.active:  # every process stops together, with the first process's message
            failures = [f for f in run.dist.gather(None if failure is None else str(failure)) if f]
            if failures and failure is None:
                failure = RunError(failures[0])
        if failure is not None:
            raise failure

    mask = rollout.completion_mask.bool()
    if spec.rollout.mask_truncated_completions:
        mask = mask & ~rollout.truncated.bool()[:, None]
    batch = TrainBatch(rollout.prompt_ids, rollout.prompt_mask.bool(), rollout.completion_ids, mask,
                       torch.zeros(mask.shape, device=mask.device))
    if rollout.sampling_logp is not None:
        batch.sampling_logp = rollout.sampling_logp.to(mask.device, torch.float32)
    kl_cfg = spec.algorithm.kl
    micro = spec.train.micro_batch_size or mask.shape[0]
    rewards, seq_kl = scores.total.to(mask.device), None
    metrics: dict[str, float] = {}
    with timer("logprobs"):
        if spec.algorithm.mu > 1 or (kl_cfg.beta > 0 and kl_cfg.placement == "reward"):
            batch.old_logp = batch_logprobs(run.model, batch, micro, spec.rollout.temperature, run.autocast)
        if kl_cfg.beta > 0:
            with run.reference.active() as ref_model:
                batch.ref_logp = batch_logprobs(ref_model, batch, micro, spec.rollout.temperature, run.autocast)
    if kl_cfg.beta > 0 and kl_cfg.placement == "reward":
        kl = run.kl(batch.old_logp, batch.ref_logp, mask)
        seq_kl = kl_cfg.beta * kl.sum(dim=1)
        rewards = rewards - seq_kl
        metrics["kl"] = float(kl.sum() / mask.sum().clamp(min=1))
    with timer("advantage"):
        inputs = _advantage_inputs(run, rollout, scores, layout, rewards, seq_kl, mask)
        batch.advantages = global_advantages(run, inputs)

    objective = run.objective
    upd = update(
        run.model, run.optimizer, run.scheduler, batch, objective,
        mu=spec.algorithm.mu, mini_batches=spec.train.mini_batches,
        micro_batch_size=spec.train.micro_batch_size, max_grad_norm=spec.train.max_grad_norm,
        autocast=run.autocast, dist=run.dist, scaler=run.scaler,
    )
    with timer("sync"):
        run.backend.sync_weights(run.model)

    adv = batch.advantages[mask]
    metrics.update(_reward_metrics(scores, g))
    metrics.update(_step_metrics(scores, layout))
    metrics.update(_length_metrics(rollout))
    metrics.update(upd)
    metrics.update({f"time/{k}": v for k, v in timer.phases.items()})
    metrics["advantage/mean"] = float(adv.mean()) if adv.numel() else 0.0
    metrics["advantage/std"] = float(adv.std(unbiased=False)) if adv.numel() else 0.0
    metrics["advantage/abs_max"] = float(adv.abs().max()) if adv.numel() else 0.0
    metrics["learning_rate"] = run.scheduler.get_last_lr()[0]
    elapsed = time.perf_counter() - t_start
    metrics["time/step"] = elapsed
    metrics["perf/tokens_per_second"] = float(rollout.completion_mask.sum()) / max(timer.phases["generate"], 1e-9)
    samples = [
        {"prompt": prompts[i // g].text, "completion": rollout.completions[i],
         "reward": None if math.isnan(float(scores.total[i])) else float(scores.total[i]),
         "advantage": float(batch.advantages[i][mask[i]].mean()) if mask[i].any() else 0.0}
        for i in range(0, len(rollout.completions), max(1, g // 2))
    ]
    return metrics, samples
