"""A stage: one part of a run (SFT, GRPO, or a stage of your own), driven by the one loop of
:mod:`grpo_core.train.loop.run`.

A stage is what is its own: its steps (:meth:`Stage.train_step`), its evaluation, the state
its checkpoints hold beyond the loop's, and its hand-over to the next stage. The loop owns
the rest, once for every stage: signals and stops, the cadences (:class:`Cadence`: evaluate,
log, checkpoint), the best checkpoints (:attr:`Stage.best`), the progress bar, writing
checkpoints and resuming from them (:mod:`grpo_core.train.loop.checkpoints`). A run's stages
are :attr:`grpo_core.train.loop.state.Run.stages`, in order; each trains on the run's policy.

:class:`BaseStage` holds the defaults a stage without a feed or a hand-over needs: a new stage
writes its name, folder and steps, one step, its evaluation and its state (see the test
``tests/core/test_stages.py`` for a whole one).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from grpo_core.train.learner.optim import Optimization
from grpo_core.train.loop.best import BestCheckpoints

if TYPE_CHECKING:
    from grpo_core.train.loop.state import Run


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
