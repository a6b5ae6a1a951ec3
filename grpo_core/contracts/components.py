"""The contracts of datasets, trackers, and components that carry state across steps."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


# --------------------------------------------------------------------------- data
@runtime_checkable
class Dataset(Protocol):
    """Rows of a task: each a dict with the prompt column plus any other columns.

    ``load(split)`` returns the rows of ``"train"`` or ``"eval"`` (an empty list when the
    task has no held-out split). Relative paths in its options are resolved by the spec.
    """

    def load(self, split: str) -> list[dict[str, Any]]: ...


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
