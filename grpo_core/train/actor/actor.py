"""The actor: prompts in, scored rollouts out.

An :class:`Actor` holds what generates and scores (the rollout backend, the episode driver
that runs a prompt's episodes with it, :mod:`grpo_core.train.actor.drivers`, the reward
functions, the sampling settings and the random streams they draw from,
:mod:`grpo_core.train.seeds`) and the prompt stream. Its one product is an
:class:`~grpo_core.train.experience.Experience`: the scored groups of a step, with the
sampler's log-probs when the backend gives them, the sampling temperature and the policy
version they were sampled with. That value is all the learner (:mod:`grpo_core.train.learner.learner`)
sees of the actor, and it is defined on neither side, so a queue or a process boundary can
stand between the two: a :mod:`feed <grpo_core.train.feed>` hands it over.

The actor generates with the weights it was last given (:meth:`Actor.receive`), or, for a
backend that generates with the policy module itself (its capabilities say
``generates_with_policy``), with the learner's live model: ``weights`` is then the context
that makes that model whole (FSDP2 gathers it; one process needs nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from grpo_core.contracts import EpisodeDriver, RolloutBackend, SamplingParams, WeightPush
from grpo_core.errors import RunError
from grpo_core.train import seeds
from grpo_core.train.actor.baseline import greedy_baseline_scores
from grpo_core.train.actor.data import Prompt, PromptSource
from grpo_core.train.actor.drivers.single_turn import SingleTurn
from grpo_core.train.actor.rollout import (
    Scorer,
    concat_scored,
    score_rollout,
    select_groups,
    zero_spread_groups,
)
from grpo_core.train.distributed import Dist
from grpo_core.train.experience import Experience, Scored, Timer


@dataclass(frozen=True)
class RolloutSettings:
    """The spec values the actor reads (``rollout``, ``train.prompts_per_step``, ``train.seed``,
    ``algorithm.dynamic_sampling``)."""

    group_size: int
    prompts_per_step: int
    seed: int
    sampling: SamplingParams
    dynamic: Any = None  # a DynamicSamplingSection (DAPO's dynamic sampling), or None

    @classmethod
    def from_spec(cls, spec) -> RolloutSettings:
        r = spec.rollout
        sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            stop=tuple(r.stop),
        )
        return cls(group_size=r.group_size, prompts_per_step=spec.train.prompts_per_step, seed=spec.train.seed,
                   sampling=sampling, dynamic=spec.algorithm.dynamic_sampling)


@dataclass
class Actor:
    """Turns prompts into scored rollouts; see the module doc."""

    backend: RolloutBackend
    scorer: Scorer
    settings: RolloutSettings
    source: PromptSource | None = None  # the training prompts (None for an evaluation-only actor)
    dist: Dist = field(default_factory=Dist)
    autocast: Callable = nullcontext  # () -> the mixed-precision context of generation
    driver: EpisodeDriver = field(default_factory=SingleTurn)  # how a prompt's G episodes run
    weights: Callable[[], Any] = nullcontext  # () -> the context of a rollout phase (see the module doc)
    greedy_baseline: bool = False  # also score one greedy completion per prompt (needs_greedy_baseline)
    version: int = 0  # the policy version of the backend's weights
    pushed: WeightPush | None = None  # the last push (setup's, then sync_weights'): sync/push_* of each step

    # ----------------------------------------------------------------- weights
    def receive(self, model: Any, version: int) -> None:
        """The learner's weights after ``version`` updates, for the next rollouts (every
        process calls it: a sharded model is gathered for the push)."""
        pushed = self.backend.sync_weights(model)
        if pushed is not None:  # the push these rollouts sample after (a skipped one keeps the last)
            self.pushed = pushed
        self.version = version

    # ----------------------------------------------------------------- sampling
    def sample(self, prompts: list[Prompt], group_size: int, sampling: SamplingParams,
               scorer: Scorer | None = None) -> Scored:
        """``group_size`` completions (or episodes) of each prompt, scored by ``scorer``
        (default the actor's). The caller holds :attr:`weights`."""
        with self.autocast():
            rollout = self.driver.run(self.backend, prompts, group_size, sampling)
        return score_rollout(scorer or self.scorer, prompts, rollout)

    def collect(self, step: int) -> Experience:
        """Training step ``step``'s scored groups, drawn from :attr:`source`. Under dynamic
        sampling (DAPO), rounds of prompts are rolled out until each process holds its share
        of ``prompts_per_step`` groups whose metric has a spread, or ``max_rounds`` ran out;
        then the first zero-spread groups fill the rest. With :attr:`greedy_baseline`, one
        greedy completion of each kept prompt is generated and scored too."""
        timer = Timer()
        baseline = None
        started = self.version  # partial rollouts may move it mid-batch: the oldest token's counts
        with self.weights():
            if self.settings.dynamic is None:
                scored, metrics = self.rollout_round(step, timer), {}
            else:
                scored, metrics = self._dynamic_rounds(step, timer)
            if self.greedy_baseline:
                with timer("baseline"):
                    baseline = greedy_baseline_scores(
                        self.backend, self._score_everywhere, scored.prompts, self.settings.group_size,
                        self.settings.sampling, self.driver, self.autocast,
                    )
        if self.pushed is not None:  # the push these rollouts sampled after
            metrics = {**metrics, **self.pushed.metrics()}
        return Experience(step, scored, started, self.settings.sampling.temperature, metrics, timer.phases,
                          baseline)

    def rollout_round(self, step: int, timer: Timer, round_: int = 0) -> Scored:
        """Draw ``prompts_per_step`` prompts, keep this process's groups, generate ``G``
        completions of each and score them."""
        s = self.settings
        if getattr(self.source, "sharded", False):  # a stream: each process reads only its own rows
            first, stop = self.dist.shard_bounds(s.prompts_per_step)
            prompts = self.source.next(stop - first)
        else:
            prompts = self.source.next(s.prompts_per_step)
            first, stop = self.dist.shard_bounds(len(prompts))
            prompts = prompts[first:stop]  # this process's groups (all of them with one process)
        seed = seeds.rollout(s.seed, step, first, round_=round_, prompts_per_step=s.prompts_per_step)
        with timer("generate"), self.autocast():
            rollout = self.driver.run(self.backend, prompts, s.group_size, replace(s.sampling, seed=seed))
        with timer("score"):
            scored = self._score_everywhere(prompts, rollout)
        sampler = getattr(self.source, "sampler", None)
        if sampler is not None:  # every process's groups, in draw order
            means = group_means(scored.scores.total, s.group_size)
            parts = self.dist.gather(([p.index for p in prompts], means))
            sampler.observe([i for rows, _ in parts for i in rows], [m for _, ms in parts for m in ms])
        return scored

    def _score_everywhere(self, prompts: list[Prompt], rollout) -> Scored:
        """Score this process's rollout; with several processes a reward failure on any one
        stops all of them, with the first failing process's message."""
        failure, scored = None, None
        try:
            scored = score_rollout(self.scorer, prompts, rollout)
        except RunError as exc:
            failure = exc
        if self.dist.active:
            failures = [f for f in self.dist.gather(None if failure is None else str(failure)) if f]
            if failures and failure is None:
                failure = RunError(failures[0])
        if failure is not None:
            raise failure
        return scored

    def _dynamic_rounds(self, step: int, timer: Timer) -> tuple[Scored, dict[str, float]]:
        ds = self.settings.dynamic
        kept: list[Scored] = []
        spare: list[Scored] = []  # zero-spread groups, in order: the fill when rounds run out
        n_kept = n_spare = n_seen = rounds = 0
        while True:
            scored = self.rollout_round(step, timer, rounds)
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
            if rounds >= ds.max_rounds or not self.dist.any(n_kept < need):
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


def _spread_metric(scored: Scored, metric: str) -> torch.Tensor:
    """``(B,)``: the values whose spread within a group decides whether it is kept."""
    scores = scored.scores
    if metric == "reward":
        return scores.total
    column = next(j for j, n in enumerate(scores.names) if n == metric or n.startswith(f"{metric}#"))
    return scores.per_function[:, column]


def group_means(totals: torch.Tensor, group_size: int) -> list[float]:
    """Each group's mean total reward over its scorable (non-NaN) completions; NaN for a
    group with none."""
    out = []
    for group in totals.reshape(-1, group_size).tolist():
        finite = [v for v in group if v == v]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out
