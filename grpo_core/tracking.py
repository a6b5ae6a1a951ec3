"""The run's log: every event goes to ``metrics.jsonl`` in the run folder first, then to
each tracker. A tracker that raises is reported and never stops training."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("grpo.tracking")


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [2]}`` -> ``{"a.b": 1, "c.0": 2}``."""
    out: dict[str, Any] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
    elif isinstance(data, list) and data:
        for index, value in enumerate(data):
            out.update(flatten(value, f"{prefix}{index}."))
    else:
        out[prefix[:-1]] = data
    return out


class RunLog:
    """Fans run events out to trackers, with a local JSONL copy of every metric."""

    def __init__(self, trackers: dict[str, Any], folder: Path, enabled: bool = True):
        self.trackers = trackers if enabled else {}
        self.enabled = enabled  # False on the non-main processes of a multi-process run
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.folder / "metrics.jsonl"
        self._start_id: str | None = None
        if enabled:
            self._end_torn_line()
        self._warned: set[str] = set()

    def _end_torn_line(self) -> None:
        """A row a crash cut short must not swallow the next one: end it with a newline."""
        if self.metrics_path.is_file() and self.metrics_path.stat().st_size:
            with self.metrics_path.open("rb+") as fh:
                fh.seek(-1, 2)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")

    def rewind(self, step: int) -> None:
        """On ``--resume`` from ``step``: rows of later steps (logged before a crash, about to be
        redone) move from ``metrics.jsonl`` to ``metrics.superseded.jsonl``, so that each step
        has one row in ``metrics.jsonl``; nothing is deleted."""
        if not self.enabled or not self.metrics_path.is_file():
            return
        keep, later = [], []
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                row_step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                later.append(line)  # a row a crash tore: kept aside too
                continue
            (later if row_step > step else keep).append(line)
        if not later:
            return
        with (self.folder / "metrics.superseded.jsonl").open("a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in later))
        tmp = self.metrics_path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
        tmp.replace(self.metrics_path)

    def _each(self, method: str, *args: Any) -> list[Any]:
        results = []
        for name, tracker in self.trackers.items():
            try:
                results.append(getattr(tracker, method)(*args))
            except Exception as exc:  # a tracker must never kill training
                if name not in self._warned:
                    log.warning("tracker '%s' failed in %s: %s: %s", name, method, type(exc).__name__, exc)
                    self._warned.add(name)
                results.append(None)
        return results

    def start(self, run_name: str, resume_id: str | None = None) -> str | None:
        ids = [r for r in self._each("start", run_name, resume_id) if r]
        self._start_id = ids[0] if ids else resume_id
        return self.run_id

    @property
    def run_id(self) -> str | None:
        """The trackers' run id, checkpointed to resume into the same run; read each time,
        since a tracker whose server was down at start creates its run later."""
        for tracker in self.trackers.values():
            if getattr(tracker, "run_id", None):
                return tracker.run_id
        return self._start_id

    def log_params(self, params: dict[str, Any]) -> None:
        self._each("log_params", params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        with self.metrics_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, **clean}) + "\n")
        self._each("log_metrics", clean, step)

    def log_artifact(self, path: str | Path) -> None:
        self._each("log_artifact", str(path))

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        self._each("log_table", name, rows, step)

    def finish(self, status: str) -> None:
        self._each("finish", status)
