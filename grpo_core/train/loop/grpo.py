"""The GRPO stage: the run's steps of rollouts and policy updates (:func:`~grpo_core.train.loop.step.train_step`),
its held-out evaluation, and what its checkpoints hold beyond the loop's (the prompt position,
the components that carry state across steps). The last stage of every run.

Where the actor must be idle with the current weights (an evaluation, a checkpoint, the start
of an iterative-GRPO iteration), the stage says so with ``run.at_rest()``: an asynchronous feed
drops the batches it generated ahead and rewinds the prompt stream there. Iterative GRPO's
reward-model refresh (:mod:`grpo_core.train.loop.iterative`) is a hook of this stage, run
before the first step of each iteration.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from grpo_core import checkpoint as ckpt
from grpo_core.contracts import Stateful
from grpo_core.spec import Spec
from grpo_core.train.learner.learner import Learner
from grpo_core.train.learner.optim import Optimization
from grpo_core.train.loop.best import BestCheckpoints
from grpo_core.train.loop.evaluate import EvalSet, evaluate_sets
from grpo_core.train.loop.iterative import IterativeRefresh
from grpo_core.train.loop.state import BaseStage, Cadence, Run, StepRecord
from grpo_core.train.loop.step import train_step


class GrpoStage(BaseStage):
    """The GRPO steps (spec sections ``train``, ``eval``, ``checkpoint``, ``iterative``); see
    the module doc."""

    name = "grpo"
    label = ""
    watched = True

    def __init__(self, spec: Spec, learner: Learner, folder: Path, iterations: IterativeRefresh | None = None):
        self.spec, self.learner, self.folder, self.iterations = spec, learner, folder, iterations
        c, e = spec.checkpoint, spec.eval
        self.best = BestCheckpoints(c.best_metric, c.best_mode, c.keep_best) if c.best_metric is not None else None
        self.cadence = Cadence.of_checkpoint(
            c, eval_every=e.every, eval_at_start=e.at_start, eval_at_end=e.at_end,
            checkpoint_at_end=bool(c.every or c.every_minutes), tables_every=spec.train.log_completions_every)
        self.nonfinite_streak = 0

    @property
    def steps(self) -> int:
        return self.spec.train.steps

    @property
    def step(self) -> int:
        """The learner's policy version (one update per step), the run's one counter."""
        return self.learner.version

    def optimization(self, run: Run) -> Optimization:
        return self.learner.optimization

    def start(self, run: Run) -> None:
        # the feed generates no batch that a rest (a checkpoint, an evaluation) would drop, or that no step trains
        run.feed.start(run.model, self.step, self.next_rest, run.stopping)

    def next_rest(self, step: int) -> int:
        """The step before whose batch the loop next holds the actor at rest, for a feed
        (re)started at the batch of ``step``: ``step`` itself while an iteration of iterative
        GRPO is still to begin there, else the first later step after an evaluation
        (``eval.every``), a checkpoint by step count (``checkpoint.every``) or an iteration
        start, or ``train.steps`` (no batch past the last step). A checkpoint by time
        (``checkpoint.every_minutes``), a stop or a failure cannot be foreseen."""
        spec, iterations = self.spec, self.iterations
        ahead = [max(spec.train.steps, step)]
        for every in (spec.eval.every, spec.checkpoint.every):
            if every:
                ahead.append((step // every + 1) * every)
        if iterations is not None and iterations.iteration < iterations.section.iterations:
            begins = iterations.iteration * iterations.section.steps_per_iteration  # the next one to begin
            if begins >= step:
                ahead.append(begins)
        return min(ahead)

    def rest(self, run: Run) -> None:
        run.feed.stop(run.model, self.step)

    def at_rest(self, run: Run):
        return run.at_rest()

    def can_evaluate(self, run: Run) -> bool:
        return run.has_eval

    def evaluate(self, run: Run) -> dict[str, float]:
        return evaluate_run(run)

    def train_step(self, run: Run) -> StepRecord:
        """One GRPO step, with the iteration start of iterative GRPO before it and the KL
        controller's update after it."""
        spec, begun = self.spec, {}
        if self.iterations is not None and self.iterations.due(self.step):
            with run.at_rest():
                begun = self.iterations.begin(run.actor, run.model)
        result = train_step(run.feed, run.learner, self.step)
        metrics = run.dist.combine_metrics(result.metrics)
        if run.learner.kl is not None:  # adaptive beta and reference sync see the global step
            rows = spec.train.prompts_per_step * spec.rollout.group_size
            metrics.update(run.learner.kl.after_step(self.step, run.model, metrics.get("kl"), rows))
        metrics.update(begun)
        self.nonfinite_streak = self.nonfinite_streak + 1 if metrics["train/nonfinite_updates"] else 0
        metrics["train/nonfinite_streak"] = self.nonfinite_streak
        metrics["data/skipped_prompts"] = float(sum(run.prompts.skipped.values()))
        return StepRecord(metrics, {"completions": result.samples})

    def halt(self, metrics: dict[str, float]) -> str | None:
        limit = self.spec.train.max_nonfinite_updates
        if self.nonfinite_streak < limit:
            return None
        return (f"{self.nonfinite_streak} steps in a row had a non-finite loss or gradient "
                f"(train.max_nonfinite_updates = {limit}); stopped with the last good weights in {{folder}}. "
                "Lower train.lr or check the rewards.")

    def components(self, run: Run) -> dict[str, Stateful]:
        """The run's stateful components, and the iteration refresh's state (``iterative``)."""
        named: dict[str, Any] = dict(run.stateful())
        named["iterative"] = self.iterations
        return {k: v for k, v in named.items() if isinstance(v, Stateful)}

    def state_dict(self, run: Run) -> dict[str, Any]:
        """The prompt position (the actor's: the caller holds it at rest) and the components."""
        return {"data": run.prompts.state_dict(), "nonfinite_streak": self.nonfinite_streak,
                "components": {k: v.state_dict() for k, v in self.components(run).items()}}

    def load_state_dict(self, run: Run, state: dict[str, Any]) -> None:
        self.learner.version = int(state["step"])
        run.prompts.load_state_dict(state["data"])
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        saved = state.get("components", {})
        for key, component in self.components(run).items():
            if key in saved:
                component.load_state_dict(saved[key])

    def overridden(self, state: dict[str, Any]) -> list[str]:
        return ckpt.overridden_on_resume(state, self.spec)

    def postfix(self, metrics: dict[str, float], last_eval: dict[str, float]) -> dict[str, str]:
        shown = {"reward": metrics.get("reward"), "kl": metrics.get("kl"),
                 "len": metrics.get("completions/mean_length")}
        evals = {k: v for k, v in last_eval.items() if k.startswith("eval/rewards/")}
        shown.update({k.replace("eval/rewards/", "eval_"): v for k, v in evals.items()})
        return {k: f"{v:.3g}" for k, v in shown.items() if v is not None and math.isfinite(v)}


def evaluate_run(run: Run) -> dict[str, float]:
    """The held-out sets' metrics: the default set, then every named one (see
    :func:`evaluate_sets`). The caller holds the actor at rest."""
    sets = [EvalSet("eval/", run.eval_prompts, run.spec.data.prompt_column), *run.eval_sets.values()]
    with run.actor.weights():
        return evaluate_sets(run.spec, run.actor, sets)
