"""What the tracker tests share (imported as ``from .conftest import ...``): completion rows, and
the events a run sends a tracker."""

from __future__ import annotations

from pathlib import Path

ROWS = [
    {"prompt": "What is 2 + 3?", "completion": "5 | five\nyes", "reward": 1.0},
    {"prompt": "What is 2 + 3?", "completion": "6", "reward": 0.0},
]


def events(tracker, spec_file: Path) -> None:
    """The events a run sends, in a run's order."""
    assert tracker.start("unit-run") is None  # no run id to mix up with MLflow's
    tracker.log_params({"train.lr": 0.001, "model.path": "tiny"})
    tracker.log_artifact(str(spec_file))
    tracker.log_metrics({"reward": 0.25, "kl": 0.5}, 1)
    tracker.log_metrics({"reward": 0.75, "kl": 0.25}, 2)
    tracker.log_table("completions", ROWS, 2)
    tracker.finish("FINISHED")
