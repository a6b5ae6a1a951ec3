"""How experience reaches the learner: one interface, a synchronous and an asynchronous feed.

The loop (:mod:`grpo_core.train.loop.run`) sees one object, the run's feed, whatever the mode:

- ``take(step)``: the :class:`~grpo_core.train.experience.Experience` of ``step`` and the
  feed's own metrics;
- ``publish(model, version)``: the learner's weights after ``version`` updates, for the
  batches to come;
- ``at_rest(model, version)``: a context in which the actor is idle, holds the learner's
  current weights and its prompt stream stands at the first batch not yet trained (the
  batch of step ``version``): evaluation, checkpoints and the start of an iterative-GRPO
  iteration run inside it. An exception inside leaves the actor at rest (an asynchronous
  feed does not start its thread again) and the prompt stream where it stood;
- ``start(model, version, next_rest, stopping)`` / ``stop(model, version)`` /
  ``close(wait)``: before the first step, after the last one (or a failed one), and when the
  run ends. ``next_rest(step)`` says where the loop will next want the actor at rest after a
  (re)start at ``step`` (the step after the last one included), and ``stopping()`` whether it
  will stop after the step it is on, so that an actor running ahead generates and scores no
  batch that would be dropped there or never trained.

:class:`SyncFeed` is the synchronous loop: ``take`` collects the batch then and there, with
the weights of the last ``publish``. :class:`~grpo_core.train.pipeline.Pipeline` is the
asynchronous one (``rollout.max_staleness: k``): an actor thread collects up to ``k``
versions ahead. ``k = 0`` is the synchronous feed, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from grpo_core.train.experience import Experience


class Collector(Protocol):
    """What a feed asks of the actor (:class:`~grpo_core.train.actor.actor.Actor` has these):
    written here so that the feeds, beneath both sides, import neither."""

    version: int  # the policy version of the weights it generates with
    source: Any  # the prompt stream: ``state_dict()`` / ``load_state_dict(state)`` give and set its position
    dist: Any  # its process group (grpo_core.train.distributed.Dist)

    def receive(self, model: Any, version: int) -> None: ...

    def collect(self, step: int) -> Experience: ...


class Feed(Protocol):
    """What the loop asks of a feed; see the module doc."""

    def start(self, model: Any, version: int, next_rest: Callable[[int], int] | None = None,
              stopping: Callable[[], bool] | None = None) -> None: ...

    def take(self, step: int) -> tuple[Experience, dict[str, float]]: ...

    def publish(self, model: Any, version: int) -> None: ...

    def at_rest(self, model: Any, version: int): ...

    def stop(self, model: Any, version: int) -> None: ...

    def close(self, wait: bool = True) -> None: ...


@dataclass
class SyncFeed:
    """The actor and the learner take turns: ``take`` collects the step's batch in the caller's
    thread. It remembers the prompt position before the batch it handed out until the
    learner publishes the update made from it, so that a step that failed before its update
    rewinds to that batch (:meth:`stop`), as the asynchronous feed does."""

    actor: Collector
    _before: tuple[int, dict[str, Any]] | None = None  # (step, prompt position before its batch)

    def start(self, model: Any, version: int, next_rest: Callable[[int], int] | None = None,
              stopping: Callable[[], bool] | None = None) -> None:
        """Give the actor the learner's weights unless it holds them (a resumed run's). It
        collects nothing ahead, so the rests and stops to come are not its concern."""
        if self.actor.version != version:
            self.actor.receive(model, version)

    def take(self, step: int) -> tuple[Experience, dict[str, float]]:
        self._before = (step, self.actor.source.state_dict())
        return self.actor.collect(step), {}

    def publish(self, model: Any, version: int) -> None:
        self._before = None
        self.actor.receive(model, version)

    @contextmanager
    def at_rest(self, model: Any, version: int):
        self.stop(model, version)
        with kept_position(self.actor):
            yield

    def stop(self, model: Any, version: int) -> None:
        """Rewind the prompt stream to the batch of step ``version`` if it was taken and not
        trained on (the step failed before its update)."""
        if self._before is not None and self._before[0] == version:
            self.actor.source.load_state_dict(self._before[1])
        self._before = None

    def close(self, wait: bool = True) -> None:
        """Nothing runs beside the caller."""


@contextmanager
def kept_position(actor: Collector):
    """The actor's prompt position put back if the body raises (a partly done iteration start
    drew prompts), so that a checkpoint of the failed step resumes exactly."""
    mark = actor.source.state_dict()
    try:
        yield
    except BaseException:
        actor.source.load_state_dict(mark)
        raise
