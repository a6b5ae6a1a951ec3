"""The run's record: what a step uses (the actor, the learner and the feed between them), the
held-out data, the loop's counters, and what a checkpoint saves and restores of it all."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core import checkpoint as ckpt
from grpo_core.contracts import Stateful
from grpo_core.spec import LoadedSpec, Spec
from grpo_core.tracking import RunLog
from grpo_core.train.actor.actor import Actor
from grpo_core.train.actor.data import Prompt, PromptSource
from grpo_core.train.distributed import Dist
from grpo_core.train.feed import Feed
from grpo_core.train.learner.learner import Learner
from grpo_core.train.loop.best import BestCheckpoints, MissingMetric
from grpo_core.train.loop.evaluate import EvalSet
from grpo_core.train.loop.iterative import IterativeStage
from grpo_core.train.loop.sft import SftStage

log = logging.getLogger("grpo.checkpoint")


@dataclass
class Hooks:
    """What a caller of the loop watches (the Python trainer's callbacks), on every process
    with the same values: ``on_step(step, metrics)`` after each step's metrics are logged,
    ``on_eval(step, metrics)`` after each held-out evaluation, ``on_save(step, folder)`` after
    each checkpoint. ``on_step`` and ``on_eval`` return True to stop the run after this step
    (it then ends as a finished run does: final evaluation, checkpoint, model)."""

    on_step: Callable[[int, dict[str, float]], bool] = lambda step, metrics: False
    on_eval: Callable[[int, dict[str, float]], bool] = lambda step, metrics: False
    on_save: Callable[[int, Path], None] = lambda step, folder: None


@dataclass
class Run:
    """A run: the actor and learner a step uses and the feed between them, the held-out data,
    and the loop's own state. Built by :func:`grpo_core.train.loop.assemble.build_run`."""

    spec: Spec
    loaded: LoadedSpec
    output_dir: Path
    actor: Actor
    learner: Learner
    feed: Feed  # SyncFeed, or the Pipeline under rollout.max_staleness > 0
    eval_prompts: list[Prompt]
    log: RunLog
    iterative: IterativeStage | None = None  # the iteration stage of iterative GRPO
    eval_sets: dict[str, EvalSet] = field(default_factory=dict)  # the named sets of eval.sets
    processor: Any = None  # the model's processor when prompts have images (saved with the weights)
    nonfinite_streak: int = 0
    last_eval: dict[str, float] = field(default_factory=dict)
    saved_step: int | None = None  # the step of the last checkpoint this process wrote
    saved_at: float = field(default_factory=time.monotonic)  # when it was written (or the run began)
    trajectory: str = field(default_factory=ckpt.new_trajectory)  # this line of steps' id
    hooks: Hooks = field(default_factory=lambda: Hooks())
    stop_asked: bool = False  # a hook asked to stop after the current step
    best: BestCheckpoints | None = None  # the best checkpoints by checkpoint.best_metric
    sft: SftStage | None = None  # the SFT stage before the GRPO steps (spec section sft)

    def __post_init__(self) -> None:
        c = self.spec.checkpoint
        if c.best_metric is not None and self.best is None:
            self.best = BestCheckpoints(c.best_metric, c.best_mode, c.keep_best)

    @property
    def step(self) -> int:
        """Steps trained so far: the learner's policy version (one update per step), the run's
        one counter (checkpoints restore it)."""
        return self.learner.version

    def at_rest(self):
        """The context in which the actor is idle with the learner's current weights and the
        prompt stream stands at the first untrained batch (the feed's ``at_rest``): around
        evaluations, checkpoints and the start of an iteration."""
        return self.feed.at_rest(self.model, self.step)

    def next_rest(self, step: int) -> int:
        """The step before whose batch the loop next holds the actor at rest, for a feed
        (re)started at the batch of ``step``: ``step`` itself while an iteration of iterative
        GRPO is still to begin there, else the first later step after an evaluation
        (``eval.every``), a checkpoint by step count (``checkpoint.every``) or an iteration
        start, or ``train.steps`` (no batch past the last step). A checkpoint by time
        (``checkpoint.every_minutes``), a stop or a failure cannot be foreseen."""
        spec, iterative = self.spec, self.iterative
        ahead = [max(spec.train.steps, step)]
        for every in (spec.eval.every, spec.checkpoint.every):
            if every:
                ahead.append((step // every + 1) * every)
        if iterative is not None and iterative.iteration < iterative.section.iterations:
            begins = iterative.iteration * iterative.section.steps_per_iteration  # the next one to begin
            if begins >= step:
                ahead.append(begins)
        return min(ahead)

    def save_model(self, folder: Path) -> Path:
        """The policy as it is now (a LoRA adapter under LoRA) and its tokenizer or processor,
        saved to ``folder`` in the Hugging Face layout by the main process, every process
        taking part (a sharded model is gathered); returns ``folder``."""
        weights = self.learner.strategy.model_state(self.model)
        if self.dist.is_main:
            self.model.save_pretrained(folder, state_dict=weights)
            (self.processor or self.tokenizer).save_pretrained(folder)
        self.dist.barrier()
        return folder

    @property
    def has_eval(self) -> bool:
        """Some held-out set has prompts: the default one or a named one."""
        return bool(self.eval_prompts) or any(s.prompts for s in self.eval_sets.values())

    @property
    def model(self):
        return self.learner.model

    @property
    def tokenizer(self):
        return self.learner.tokenizer

    @property
    def prompts(self) -> PromptSource:
        """The training prompts (the actor draws them)."""
        return self.actor.source

    @property
    def dist(self) -> Dist:
        return self.learner.dist

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def stateful(self) -> dict[str, Any]:
        """Components that carry state across steps (:class:`~grpo_core.contracts.Stateful`)."""
        named = {"rollout": self.actor.backend, "advantage": self.learner.estimator}
        named.update({f"rewards.{fn.name}": fn.fn for fn in self.actor.scorer.rewards})
        named.update({f"tracking.{name}": tracker for name, tracker in self.log.trackers.items()})
        named["kl"] = self.learner.kl
        named["iterative"] = self.iterative
        named["sft"] = self.sft
        return {k: v for k, v in named.items() if isinstance(v, Stateful)}

    def state_dict(self) -> dict[str, Any]:
        """Everything but the weights; the prompt position is the actor's, so the actor must be
        at rest (:meth:`at_rest`)."""
        learner = self.learner
        optimizer, optimizer_format = learner.strategy.optimizer_state(learner.model, learner.optimizer)
        return {
            "step": self.step,
            "trajectory": self.trajectory,
            "run_id": self.log.run_id,
            "optimizer": optimizer,
            "optimizer_format": optimizer_format,
            "scheduler": learner.scheduler.state_dict(),
            "rng": ckpt.rng_state(),
            "data": self.prompts.state_dict(),
            "nonfinite_streak": self.nonfinite_streak,
            "last_eval": dict(self.last_eval),
            "components": {k: v.state_dict() for k, v in self.stateful().items()},
            "scaler": learner.scaler.state_dict() if learner.scaler is not None else None,
            "best": self.best.state_dict() if self.best is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        learner = self.learner
        learner.version = int(state["step"])
        learner.strategy.load_optimizer_state(self.model, learner.optimizer, state["optimizer"],
                                              state.get("optimizer_format", "native"))
        learner.scheduler.load_state_dict(state["scheduler"])
        self.prompts.load_state_dict(state["data"])
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        self.last_eval = dict(state.get("last_eval", {}))
        for key, component in self.stateful().items():
            if key in state.get("components", {}):
                component.load_state_dict(state["components"][key])
        if self.best is not None and state.get("best"):
            self.best.load_state_dict(state["best"])
        if learner.scaler is not None and state.get("scaler"):
            learner.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])

    def restore(self, found: ckpt.Loaded) -> None:
        """Continue from the checkpoint ``found``: its weights (through the strategy, which
        loads what it saved), its state, and the line of steps that follows it."""
        ckpt.load_model_weights(self.model, found.folder, self.learner.strategy.load_model_state)
        self.load_state_dict(found.state)
        self.trajectory = ckpt.trajectory_after_resume(self.checkpoint_dir, found)
        self.log.rewind(self.step)

    def save_checkpoint(self, alone: bool = False, again: bool = False) -> Path:
        """Checkpoint the current step (call it with the actor at rest, :meth:`at_rest`); a step
        this process already saved is not written twice. With several processes the main one
        writes and the others wait for it; a sharded model's weights and optimizer state are
        gathered by every process. ``alone``: the main process writes without the others (they
        failed, or cannot be reached), which only whole copies (not shards) allow. ``again``:
        rewrite a step already saved (its state changed: an evaluation ranked it)."""
        folder = ckpt.step_folder(self.checkpoint_dir, self.step)
        if not again and self.saved_step == self.step and folder.is_dir():
            return folder
        sharded = self.learner.strategy.sharded
        if alone and sharded:
            raise ValueError("save_checkpoint(alone=True): a sharded model's checkpoint needs every process")
        weights = self.learner.strategy.model_state(self.model)
        state = self.state_dict() if sharded or self.dist.is_main else None
        if self.dist.is_main:
            folder = ckpt.write_checkpoint(
                self.checkpoint_dir, self.step, self.model, state, self.spec.checkpoint.keep,
                self.trajectory, weights=weights, protect=self.best.steps if self.best is not None else set(),
            )
        if not alone:
            self.dist.barrier()
        self.saved_step = self.step
        self.saved_at = time.monotonic()
        self.hooks.on_save(self.step, folder)
        return folder

    def after_eval(self) -> None:
        """Rank the step just evaluated by ``checkpoint.best_metric`` and checkpoint it when it
        is among the best (call it with the actor at rest, right after the evaluation). An
        evaluation without the metric checkpoints the step, then raises :class:`MissingMetric`."""
        if self.best is None or not self.last_eval:
            return
        try:
            ranked = self.best.offer(self.step, self.last_eval)
        except MissingMetric as exc:  # the trained steps are kept before the run stops
            raise exc.keeping(f"the checkpoint {self.save_checkpoint()}") from None
        if ranked:
            # recorded before writing: the checkpoint's own state lists its folder, so a run
            # resumed from it can still export it as the best
            self.best.saved(self.step, ckpt.step_folder(self.checkpoint_dir, self.step))
            self.save_checkpoint(again=True)  # the last step was saved before its final evaluation
            if self.dist.is_main:  # a step saved before its evaluation was not pruned with this ranking
                ckpt.prune(self.checkpoint_dir, self.spec.checkpoint.keep, self.trajectory, self.best.steps)
                self.best.write(self.checkpoint_dir)

    def best_folder(self) -> Path | None:
        """The best checkpoint's folder under ``checkpoint.final: best`` (None otherwise, or
        when no evaluation ranked a step)."""
        if self.spec.checkpoint.final != "best" or self.best is None or self.best.best_step is None:
            return None
        folder = self.best.best_folder()
        if folder is None:
            log.warning("checkpoint.final is best, but the checkpoint of step %d is gone; the final model is the "
                        "last step's", self.best.best_step)
        return folder
