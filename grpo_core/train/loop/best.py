"""The best checkpoints by an evaluation metric (``checkpoint.best_metric``), kept beside the
last ones.

After each evaluation the step is offered with its metrics: when its value of the metric
ranks among the ``keep_best`` best seen so far (higher is better under ``best_mode: max``;
a tie goes to the earlier step; a NaN never ranks), the loop checkpoints that step, and
pruning spares the steps listed here. The list is part of the run's state (a resumed run
goes on ranking where the checkpoint stood) and is written to ``checkpoints/best.json`` each
time it changes; with ``checkpoint.final: best`` the final model is the best checkpoint's.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from grpo_core.errors import RunError

__all__ = ["BestCheckpoints", "BEST_FILE", "MissingMetric"]

BEST_FILE = "best.json"


class MissingMetric(RunError):
    """An evaluation logged no value of ``checkpoint.best_metric`` (a name the spec logs, but
    missing this time: its reward function scored no held-out completion, say). The loop
    writes the trained steps before it stops with it; ``kept`` says where they are."""

    def __init__(self, problem: str, kept: str = ""):
        self.problem, self.kept = problem, kept
        super().__init__(problem + (f". The steps trained are kept: {kept}. Set checkpoint.best_metric to a logged "
                                    "metric (or drop it) and resume" if kept else ""))

    def keeping(self, more: str) -> MissingMetric:
        """The same failure, with ``more`` of the trained steps kept."""
        return MissingMetric(self.problem, f"{self.kept} and {more}" if self.kept else more)


class BestCheckpoints:
    """The ``keep`` best (value, step) pairs by ``metric`` (``mode``: max or min)."""

    def __init__(self, metric: str, mode: str, keep: int):
        self.metric, self.mode, self.keep = metric, mode, keep
        self.entries: list[tuple[float, int]] = []  # best first
        self.folders: dict[int, str] = {}  # step -> its checkpoint (another run's folder after a resume)

    def _rank(self, entry: tuple[float, int]) -> tuple[float, int]:
        value, step = entry
        return (-value if self.mode == "max" else value), step

    def offer(self, step: int, metrics: dict[str, float]) -> bool:
        """Rank ``step`` by its evaluation ``metrics``; True when it is among the best (the
        caller then checkpoints it). A :class:`MissingMetric` naming the metrics there are when
        the metric is not among them."""
        if self.metric not in metrics:
            known = ", ".join(sorted(k for k in metrics if k.startswith("eval/"))) or "none"
            raise MissingMetric(f"checkpoint.best_metric: the evaluation logged no metric {self.metric!r}; "
                                f"it logged: {known}")
        value = float(metrics[self.metric])
        if math.isnan(value):
            return False
        entries = [e for e in self.entries if e[1] != step] + [(value, step)]
        self.entries = sorted(entries, key=self._rank)[: self.keep]
        self.folders = {s: f for s, f in self.folders.items() if s in self.steps}
        return step in self.steps

    @property
    def steps(self) -> set[int]:
        return {step for _, step in self.entries}

    @property
    def best_step(self) -> int | None:
        return self.entries[0][1] if self.entries else None

    def saved(self, step: int, folder: Path) -> None:
        """Where the checkpoint of ``step`` (one of the best) was written."""
        self.folders[step] = str(folder.resolve())

    def best_folder(self) -> Path | None:
        """The best step's checkpoint folder, None when there is none or it is gone."""
        folder = self.folders.get(self.best_step) if self.entries else None
        return Path(folder) if folder is not None and Path(folder).is_dir() else None

    def write(self, checkpoint_dir: Path) -> None:
        """``checkpoints/best.json``: the metric, the mode and the best checkpoints, best first."""
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        listing = {"metric": self.metric, "mode": self.mode,
                   "best": [{"step": step, "value": value, "folder": self.folders.get(step)}
                            for value, step in self.entries]}
        tmp = checkpoint_dir / f".{BEST_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(listing, indent=1) + "\n")
        tmp.replace(checkpoint_dir / BEST_FILE)

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "entries": [[v, s] for v, s in self.entries],
                "folders": {str(s): f for s, f in self.folders.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The ranking of a checkpoint; dropped when it ranked another metric or mode."""
        if state.get("metric") != self.metric or state.get("mode") != self.mode:
            self.entries = []
            return
        entries = [(float(v), int(s)) for v, s in state.get("entries", [])]
        self.entries = sorted(entries, key=self._rank)[: self.keep]
        self.folders = {int(s): str(f) for s, f in state.get("folders", {}).items() if int(s) in self.steps}
