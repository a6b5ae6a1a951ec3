"""The contracts of datasets, trackers, and components that carry state across steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable


# --------------------------------------------------------------------------- data
@runtime_checkable
class Dataset(Protocol):
    """Rows of a task: each a dict with the prompt column plus any other columns.

    ``load(split)`` returns the rows of ``"train"`` or ``"eval"`` (an empty list when the
    task has no held-out split). Relative paths in its options are resolved by the spec. The
    training split may instead be a :class:`RowStream` (or a ``datasets.IterableDataset``):
    it is then read through a seeded shuffle buffer, each process reading its share. A dataset
    whose options model has a ``streaming`` field says so with it (true: ``load("train")``
    streams), so that the spec refuses at validation what a stream cannot take.
    """

    def load(self, split: str) -> list[dict[str, Any]]: ...


class RowStream:
    """A training split read as a stream instead of held in memory: what a dataset's
    ``load("train")`` may return (a ``datasets.IterableDataset`` is taken as one too).

    ``open()`` returns a new iterator over the rows from the first, once per epoch and again
    when a run resumes (it then skips the rows read before). ``name`` says where the rows come
    from, in messages. ``once``: ``open`` can be called only once (a generator object), so the
    stream holds one epoch; a second is an error naming it.
    """

    def __init__(self, open: Callable[[], Iterator[dict[str, Any]]], name: str, *, once: bool = False):
        self._open, self.name, self.once = open, name, once
        self.opened = 0

    def open(self) -> Iterator[dict[str, Any]]:
        from grpo_core.errors import RunError

        if self.once and self.opened:
            raise RunError(f"data: {self.name} is a generator, read once, and the run needs its rows again (a new "
                           "epoch, or a resume): pass a function that returns a new iterator, or a "
                           "datasets.IterableDataset")
        self.opened += 1
        return iter(self._open())

    def first(self) -> dict[str, Any] | None:
        """The first row (to check its columns), or None when the stream is empty; a stream read
        once is not opened for it."""
        if self.once:
            return None
        return next(self.open(), None)

    @classmethod
    def of(cls, data: Any, name: str) -> RowStream | None:
        """``data`` as a stream when it is one (a RowStream, a ``datasets.IterableDataset``, a
        function of no arguments returning an iterator, a generator object); None for rows in
        memory."""
        import inspect

        if isinstance(data, RowStream):
            return data
        if type(data).__name__ == "IterableDataset":
            return cls(lambda: iter(data), name)
        if inspect.isgenerator(data):
            return cls(lambda: data, name, once=True)
        if callable(data) and not isinstance(data, type):
            return cls(data, name)
        return None


@runtime_checkable
class PromptSampler(Protocol):
    """Chooses which training rows are drawn, and in what order (``data.sampler``; without
    one, each epoch is a seeded shuffle of the rows).

    ``start(rows, seed)`` is called once, before any draw, with the training rows (dicts of
    columns; read them, do not change them) and ``train.seed``. ``draw(n)`` returns the
    indices (``0 <= i < len(rows)``) of the next ``n``
    rows; a row that cannot be used (an empty or too long prompt) is replaced by further
    draws. After each rollout round is scored, ``observe(rows, rewards)`` gets, for each
    group of that round (every process's), its row index and the mean of its completions'
    total rewards (NaN when none was scorable). A sampler is :class:`Stateful`: its
    ``state_dict`` must hold everything its next draws depend on (a resumed run draws what
    the uninterrupted one did), in plain data (numbers, strings, lists, dicts).
    """

    def start(self, rows: list[dict[str, Any]], seed: int) -> None: ...

    def draw(self, n: int) -> list[int]: ...

    def observe(self, rows: list[int], rewards: list[float]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# --------------------------------------------------------------------------- tracking
@runtime_checkable
class Tracker(Protocol):
    """Receives run events; must never raise for a failure of its own backend.

    ``start(run_name, resume_id)`` returns the run id (or None); ``log_params`` gets the
    resolved spec flattened to dotted keys; ``log_metrics(metrics, step)``;
    ``log_artifact(path)``; ``log_table(name, rows, step)``; ``finish(status)`` with
    status one of ``FINISHED``, ``FAILED``, ``KILLED``.

    Attributes:
        run_id: the tracker's run id once it has one, else None; checkpointed, so that a
            resumed run logs into the same tracker run. Default None.
        tracking_uri: where the run can be browsed (the end-of-run summary prints it), or
            None. Default None.
        log_model: ``log_model(folder) -> uri or None``, called with the final model's
            folder after training, for a tracker that stores models; None for one that does
            not. Default None.
    """

    run_id: str | None = None
    tracking_uri: str | None = None
    log_model: Any = None

    def start(self, run_name: str, resume_id: str | None = None) -> str | None: ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: str) -> None: ...

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None: ...

    def finish(self, status: str) -> None: ...


# --------------------------------------------------------------------------- state
@runtime_checkable
class Stateful(Protocol):
    """A component whose state carries across steps (an adaptive controller, a replay
    buffer, a sampler's position), of any kind: the engine checkpoints ``state_dict()`` with
    the run and hands it back to ``load_state_dict(state)`` on resume, before the first
    resumed step. The state is pickled with ``torch.save``; tensors in it are fine.

    A component has both methods or neither (:func:`grpo_core.registry.conform` refuses one
    without the other).
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
