"""The run's record: what its stages use (the actor, the learner and the feed between them),
the held-out data, its stages and what the loop keeps of each."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core.contracts import Stateful
from grpo_core.spec import LoadedSpec, Spec
from grpo_core.tracking import RunLog
from grpo_core.train.actor.actor import Actor
from grpo_core.train.actor.data import Prompt, PromptSource
from grpo_core.train.distributed import Dist
from grpo_core.train.feed import Feed
from grpo_core.train.learner.learner import Learner
from grpo_core.train.loop.checkpoints import Books
from grpo_core.train.loop.evaluate import EvalSet
from grpo_core.train.loop.stage import Stage

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
    """A run: the actor and learner its stages use and the feed between them, the held-out data,
    its stages in order (:class:`~grpo_core.train.loop.stage.Stage`: an SFT stage, then GRPO;
    the last is the run's own, whose folder is the run folder) and what the loop keeps of each
    (:class:`~grpo_core.train.loop.checkpoints.Books`). Built by
    :func:`grpo_core.train.loop.assemble.build_run`."""

    spec: Spec
    loaded: LoadedSpec
    output_dir: Path
    actor: Actor
    learner: Learner
    feed: Feed  # SyncFeed, or the Pipeline under rollout.max_staleness > 0
    eval_prompts: list[Prompt]
    log: RunLog
    stages: list[Stage]
    eval_sets: dict[str, EvalSet] = field(default_factory=dict)  # the named sets of eval.sets
    processor: Any = None  # the model's processor when prompts have images (saved with the weights)
    hooks: Hooks = field(default_factory=lambda: Hooks())
    stop_asked: bool = False  # a hook asked to stop after the current step
    books: dict[str, Books] = field(init=False)

    def __post_init__(self) -> None:
        names = [stage.name for stage in self.stages]
        if not names or len(set(names)) < len(names):
            raise ValueError(f"a run needs stages with distinct names, got {names}")
        self.books = {}
        for stage in self.stages:
            log = self.log if stage.folder == self.output_dir else RunLog(self.log.trackers, stage.folder,
                                                                           enabled=self.dist.is_main)
            self.books[stage.name] = Books(log, stage.folder / "checkpoints")

    @property
    def step(self) -> int:
        """Steps trained so far: the learner's policy version (one update per step), the run's
        one counter (checkpoints restore it)."""
        return self.learner.version

    @property
    def last_eval(self) -> dict[str, float]:
        """The last evaluation of the run's last stage (restored on resume)."""
        return self.books[self.stages[-1].name].last_eval

    def at_rest(self):
        """The context in which the actor is idle with the learner's current weights and the
        prompt stream stands at the first untrained batch (the feed's ``at_rest``): around
        evaluations, checkpoints and the start of an iteration."""
        return self.feed.at_rest(self.model, self.step)

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
        return {k: v for k, v in named.items() if isinstance(v, Stateful)}

    def best_folder(self) -> Path | None:
        """The best checkpoint's folder of the last stage under ``checkpoint.final: best`` (None
        otherwise, or when no evaluation ranked a step)."""
        best = self.stages[-1].best
        if self.spec.checkpoint.final != "best" or best is None or best.best_step is None:
            return None
        folder = best.best_folder()
        if folder is None:
            log.warning("checkpoint.final is best, but the checkpoint of step %d is gone; the final model is the "
                        "last step's", best.best_step)
        return folder
