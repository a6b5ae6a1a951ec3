"""Tracker ``tensorboard``: TensorBoard event files (``pip install 'grpo-core[tensorboard]'``; a spec
that selects it without the package fails validation naming the command). Completion tables and
text artifacts become markdown text summaries; each run writes a TensorBoard run of its own."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from grpo_plugins.trackers.common import GuardedTracker, markdown_table, require_package
from pydantic import Field, model_validator

from grpo_core import hookimpl
from grpo_core.options import Options, WholeSeconds
from grpo_core.spec import SpecPath

__all__ = ["TensorBoardOptions", "TensorBoardTracker"]

_TEXT_SUFFIXES = (".yaml", ".yml", ".json", ".txt", ".md")


class TensorBoardOptions(Options):
    """Options of the ``tensorboard`` tracker."""

    log_dir: SpecPath = Field(
        Path("tensorboard"),
        description="Folder of the event files: a path given in the spec is relative to the spec "
        "file; the default is tensorboard/ in the working directory (as MLflow's and W&B's stores). "
        "Each run writes <log_dir>/<run name> (<run name>-<time> when an earlier run's events are there; a "
        "resumed run continues its own). View with: tensorboard --logdir <log_dir>.",
    )
    flush_secs: WholeSeconds = Field(30, ge=1, description="Seconds between flushes of the event file to disk.")

    @model_validator(mode="after")
    def _installed(self) -> TensorBoardOptions:
        require_package("tensorboard", "tensorboard", "tensorboard")
        return self


def _unused(folder: Path, resumed: bool) -> Path:
    """``folder``, or when it already holds event files of an earlier run (a fresh run after
    ``--overwrite``, or another run folder's run of the same name) ``folder-<time>``: a new
    TensorBoard run, never steps 1, 2, ... written over another run's. A resume from a
    checkpoint written before folders were checkpointed keeps ``folder``."""
    if resumed or not folder.is_dir() or not any(folder.iterdir()):
        return folder
    fresh = folder.with_name(f"{folder.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    while fresh.exists():
        fresh = fresh.with_name(fresh.name + "+")
    return fresh


class TensorBoardTracker(GuardedTracker):
    """Writes scalars (every metric), text summaries (the resolved spec and artifact text
    files, completion tables as markdown, params) to TensorBoard event files.

    Each fresh run writes a TensorBoard run of its own: ``<log_dir>/<run name>``, or
    ``<log_dir>/<run name>-<time>`` when that folder holds an earlier run's events; the
    folder is part of the checkpoints, so ``--resume`` continues the same TensorBoard run."""

    label = "TensorBoard"

    def __init__(self, options: TensorBoardOptions):
        super().__init__(options)
        self.writer = None
        self.log_dir: Path | None = None
        self._resumed = False

    def _start(self, run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self.log_dir is None:  # a fresh run; a resumed one continues its checkpoint's folder
            self.log_dir = _unused(Path(self.options.log_dir) / run_name, self._resumed)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=self.options.flush_secs)

    def state_dict(self) -> dict[str, Any]:
        return {"log_dir": str(self.log_dir) if self.log_dir is not None else ""}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = True
        if state.get("log_dir"):
            self.log_dir = Path(state["log_dir"])

    def log_params(self, params: dict[str, Any]) -> None:
        if self.writer is not None:
            rows = [{"param": k, "value": v} for k, v in params.items()]
            self._guard("log_params", self.writer.add_text, "params", markdown_table(rows), 0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is not None:
            self._guard("log_metrics", self._scalars, metrics, step)

    def _scalars(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), step)

    def log_artifact(self, path: str) -> None:
        if self.writer is None or not str(path).endswith(_TEXT_SUFFIXES):
            return
        self._guard("log_artifact", self._text_file, Path(path))

    def _text_file(self, path: Path) -> None:
        body = path.read_text(encoding="utf-8", errors="replace")
        # Indented by four spaces: TensorBoard's markdown shows it as a code block.
        self.writer.add_text(f"files/{path.name}", "\n".join("    " + line for line in body.splitlines()), 0)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        if self.writer is not None and rows:
            self._guard("log_table", self.writer.add_text, name, markdown_table(rows), step)

    def finish(self, status: str) -> None:
        if self.writer is not None:
            self._guard("finish", self._close, status)
            self.writer = None

    def _close(self, status: str) -> None:
        self.writer.add_text("status", status, 0)
        self.writer.close()


@hookimpl
def register_trackers(register):
    register.add("tensorboard", TensorBoardTracker, options=TensorBoardOptions)
