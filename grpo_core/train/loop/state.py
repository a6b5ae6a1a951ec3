"""The run's record (:class:`Run`): what its stages use (the actor, the learner and the feed
between them), the held-out data, its stages and what the loop keeps of each (:class:`Books`);
and what a stage is (:class:`Stage`).

A stage is one part of a run (SFT, GRPO, or a stage of your own), driven by the one loop of
:mod:`grpo_core.train.loop.run`. It is what is its own: its steps (:meth:`Stage.train_step`),
its evaluation, the state its checkpoints hold beyond the loop's, and its hand-over to the
next stage. The loop owns the rest, once for every stage: signals and stops, the cadences
(:class:`Cadence`: evaluate, log, checkpoint), the best checkpoints (:attr:`Stage.best`), the
progress bar, writing checkpoints and resuming from them
(:mod:`grpo_core.train.loop.checkpoints`). :class:`BaseStage` holds the defaults a stage
without a feed or a hand-over needs: a new stage writes its name, folder and steps, one step,
its evaluation and its state (``tests/core/test_stages.py`` has a whole one).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from grpo_core import checkpoint as ckpt
from grpo_core.contracts import Stateful
from grpo_core.spec import LoadedSpec, Spec
from grpo_core.tracking import RunLog
from grpo_core.train.actor.actor import Actor
from grpo_core.train.actor.data import Prompt, PromptSource
from grpo_core.train.distributed import Dist
from grpo_core.train.feed import Feed
from grpo_core.train.learner.learner import Learner
from grpo_core.train.learner.optim import Optimization
from grpo_core.train.loop.best import BestCheckpoints
from grpo_core.train.loop.evaluate import EvalSet

log = logging.getLogger("grpo.checkpoint")


@dataclass(frozen=True)
class Cadence:
    """When the loop evaluates, logs tables and checkpoints a stage (steps count from 1).

    Evaluations: before the first step of a fresh stage (``eval_at_start``, a row of its own
    at step 0); after every ``eval_every``-th step, merged into that step's row, the last step
    too when ``eval_with_last``; after the last step in a row of its own (``eval_at_end``).
    Checkpoints: every ``checkpoint_every`` steps or ``checkpoint_minutes`` minutes, and after
    the last step when ``checkpoint_at_end``. Tables (a step's ``tables``): every
    ``tables_every`` steps (0: never)."""

    eval_every: int = 0
    eval_at_start: bool = False
    eval_with_last: bool = False
    eval_at_end: bool = False
    checkpoint_every: int = 0
    checkpoint_minutes: float = 0.0
    checkpoint_at_end: bool = True
    tables_every: int = 0

    def evaluates_after(self, step: int, steps: int) -> bool:
        """Whether the row of ``step`` (of ``steps``) carries an evaluation."""
        if step == steps:
            return self.eval_with_last
        return bool(self.eval_every) and step % self.eval_every == 0

    @classmethod
    def of_checkpoint(cls, section: Any, **others: Any) -> Cadence:
        """The cadence with the spec's ``checkpoint`` section's ``every`` and ``every_minutes``."""
        return cls(checkpoint_every=section.every, checkpoint_minutes=section.every_minutes, **others)


@dataclass
class StepRecord:
    """What one step of a stage hands the loop: its metrics (logged as the step's row) and
    tables (logged at the cadence's ``tables_every``)."""

    metrics: dict[str, float]
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


class Stage(Protocol):
    """What the loop drives; see the module doc. ``name``: unique in a run, the progress bar's
    label and what checkpoints record; ``label``: how messages name its steps (``"SFT"``: "SFT
    step 3"; ``""``: "step 3"); ``folder``: where its ``metrics.jsonl`` and ``checkpoints/``
    go (the run folder for the run's last stage); ``best``: its best steps by an evaluation
    metric, ranked and kept by the loop (None: none); ``watched``: the caller's hooks
    (:class:`~grpo_core.train.loop.state.Hooks`) see its steps, evaluations and checkpoints."""

    name: str
    label: str
    folder: Path
    cadence: Cadence
    best: BestCheckpoints | None
    watched: bool

    @property
    def steps(self) -> int:
        """How many steps the stage trains."""

    @property
    def step(self) -> int:
        """Steps trained so far."""

    def optimization(self, run: Run) -> Optimization:
        """The optimizer, schedule and scaler its steps move (made here on first call), which
        its checkpoints save."""

    def prepare(self, run: Run) -> None:
        """Before its first step, fresh or resumed."""

    def start(self, run: Run) -> None:
        """After the starting evaluation, before the first step (GRPO starts its feed)."""

    def rest(self, run: Run) -> None:
        """Before a checkpoint outside a step (the stage's end, a stop, a failed step): the
        data position at the first untrained step (GRPO stops its feed)."""

    def at_rest(self, run: Run) -> contextlib.AbstractContextManager:
        """The context of an evaluation or a checkpoint after a step."""

    def train_step(self, run: Run) -> StepRecord:
        """One step; :attr:`step` counts one more."""

    def can_evaluate(self, run: Run) -> bool:
        """Whether it has something to evaluate on."""

    def evaluate(self, run: Run) -> dict[str, float]:
        """The metrics of the weights now (the caller holds the stage at rest)."""

    def halt(self, metrics: dict[str, float]) -> str | None:
        """A reason to stop the run after this step's bookkeeping (None: go on); the loop
        checkpoints, then raises a RunError with it, ``{folder}`` replaced by the checkpoint."""

    def state_dict(self, run: Run) -> dict[str, Any]:
        """What its checkpoints hold beyond the loop's own (weights, optimizer, schedule, scaler,
        RNG states, step, best ranking, last evaluation)."""

    def load_state_dict(self, run: Run, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (``state["step"]`` is the step to continue after)."""

    def overridden(self, state: dict[str, Any]) -> list[str]:
        """Notes on settings a resume from ``state`` does not use."""

    def hand_over(self, run: Run) -> None:
        """After its last step: what the next stage starts from."""

    def resumed_past(self, run: Run) -> None:
        """A later stage is resumed: restore what this stage handed over."""

    def postfix(self, metrics: dict[str, float], last_eval: dict[str, float]) -> dict[str, str]:
        """What the progress bar shows after a step."""


class BaseStage:
    """Defaults for the parts of :class:`Stage` a simple stage has no use for."""

    label = ""
    best: BestCheckpoints | None = None
    watched = False
    cadence = Cadence()

    def prepare(self, run: Run) -> None:
        return None

    def start(self, run: Run) -> None:
        return None

    def rest(self, run: Run) -> None:
        return None

    def at_rest(self, run: Run) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def can_evaluate(self, run: Run) -> bool:
        return True

    def halt(self, metrics: dict[str, float]) -> str | None:
        return None

    def overridden(self, state: dict[str, Any]) -> list[str]:
        return []

    def hand_over(self, run: Run) -> None:
        return None

    def resumed_past(self, run: Run) -> None:
        return None

    def postfix(self, metrics: dict[str, float], last_eval: dict[str, float]) -> dict[str, str]:
        loss = metrics.get("loss")
        return {"loss": f"{loss:.3g}"} if loss is not None else {}


@dataclass
class Books:
    """What the loop keeps of one stage: its metrics log, its checkpoint folder, the line of
    steps its checkpoints belong to, the step it last saved and when, its last evaluation."""

    log: RunLog
    checkpoint_dir: Path
    trajectory: str = field(default_factory=ckpt.new_trajectory)
    saved_step: int | None = None
    saved_at: float = field(default_factory=time.monotonic)  # when it was written (or the run began)
    last_eval: dict[str, float] = field(default_factory=dict)


@dataclass
class Hooks:
    """What a caller of the loop watches (the Python trainer's callbacks) of the stages that are
    ``watched`` (GRPO's), on every process with the same values: ``on_step(step, metrics)``
    after each step's metrics are logged,
    ``on_eval(step, metrics)`` after each held-out evaluation, ``on_save(step, folder)`` after
    each checkpoint. ``on_step`` and ``on_eval`` return True to stop the run after this step
    (it then ends as a finished run does: final evaluation, checkpoint, model)."""

    on_step: Callable[[int, dict[str, float]], bool] = lambda step, metrics: False
    on_eval: Callable[[int, dict[str, float]], bool] = lambda step, metrics: False
    on_save: Callable[[int, Path], None] = lambda step, folder: None


@dataclass
class Run:
    """A run: the actor and learner its stages use and the feed between them, the held-out data,
    its stages in order (:class:`~grpo_core.train.loop.state.Stage`: an SFT stage, then GRPO;
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
    # whether the loop will stop after the step it is on (a signal or a hook); the loop sets it
    stopping: Callable[[], bool] = field(default=lambda: False)
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
