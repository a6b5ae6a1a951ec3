"""Trackers for Weights & Biases (``wandb``) and TensorBoard (``tensorboard``).

Both packages are optional extras (``pip install 'grpo-core[wandb]'`` /
``'grpo-core[tensorboard]'``) and are imported only when a run starts such a tracker, so
the core install stays lean. A spec that selects one without its package fails at
validation (exit 2) naming the install command.

They receive the same events as the ``mlflow`` tracker: the resolved spec's params, every
metric row, the completion tables (a ``wandb.Table``; a markdown table as TensorBoard
text) and the files logged as artifacts (the resolved spec, the environment). Like every
tracker they never raise for a failure of their own backend: they warn once and carry on,
and the run folder's ``metrics.jsonl`` keeps every metric anyway.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from grpo_core import hookimpl
from grpo_core.options import Options
from grpo_core.spec import SpecPath

log = logging.getLogger("grpo.tracking")

_TEXT_SUFFIXES = (".yaml", ".yml", ".json", ".txt", ".md")


def _needs(package: str, extra: str, tracker: str) -> None:
    """Raise a validation error naming the install command when ``package`` is missing."""
    if importlib.util.find_spec(package) is None:
        raise PydanticCustomError(
            f"{package}_missing",
            f"tracker '{tracker}' needs the {package} package, which is not installed: "
            f"pip install 'grpo-core[{extra}]'",
        )


class _Guarded:
    """Runs backend calls so that a failure warns (once per method) and never raises."""

    label = "tracker"

    def __init__(self) -> None:
        self._warned: set[str] = set()
        self.failures = 0

    def _guard(self, what: str, fn, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.failures += 1
            if what not in self._warned:
                self._warned.add(what)
                log.warning("%s %s failed (%s: %s); carrying on", self.label, what, type(exc).__name__, exc)
            return None


def markdown_table(rows: list[dict[str, Any]], limit: int = 500) -> str:
    """Rows as a markdown table (TensorBoard renders text summaries as markdown); cells
    are cut to ``limit`` characters and their newlines and pipes escaped."""
    if not rows:
        return ""
    columns = list(rows[0])

    def cell(value: Any) -> str:
        text = "" if value is None else str(value)
        text = text[:limit].replace("|", "\\|").replace("\r", "").replace("\n", "<br>")
        return text

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- W&B
class WandbOptions(Options):
    """Options of the ``wandb`` tracker (Weights & Biases)."""

    project: str = Field("grpo-core", min_length=1, description="W&B project (created when missing).")
    entity: str | None = Field(None, description="W&B entity (user or team); default: your default entity.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="online, offline (write the run folder only; upload later with `wandb sync`) "
        "or disabled; default: WANDB_MODE, else online.",
    )
    dir: SpecPath | None = Field(
        None, description="Folder W&B writes its wandb/ run folders in (relative to the spec file); "
        "default: WANDB_DIR, else the working directory."
    )
    group: str | None = Field(None, description="W&B run group.")
    tags: list[str] = Field(default_factory=list, description="Tags set on the W&B run.")
    notes: str | None = Field(None, description="Notes (a description) set on the W&B run.")

    @model_validator(mode="after")
    def _installed(self) -> WandbOptions:
        _needs("wandb", "wandb", "wandb")
        return self


class WandbTracker(_Guarded):
    """Logs params (as the run config), metrics, ``wandb.Table`` completion tables and
    artifact files (saved into the run's files) to a W&B run.

    The W&B run id is part of the run's checkpoints, so ``--resume`` continues the same
    W&B run. It is kept apart from the MLflow run id the engine checkpoints: this tracker
    has no ``run_id`` attribute and ``start`` returns None.
    """

    label = "W&B"

    def __init__(self, options: WandbOptions):
        super().__init__()
        self.options = options
        self.run = None
        self.wandb_id: str | None = None

    def start(self, run_name: str, resume_id: str | None = None) -> str | None:
        self._guard("start", self._start, run_name)
        return None

    def _start(self, run_name: str) -> None:
        import wandb

        o = self.options
        kwargs: dict[str, Any] = {
            "project": o.project, "entity": o.entity, "name": run_name, "group": o.group,
            "tags": list(o.tags) or None, "notes": o.notes, "mode": o.mode,
        }
        if o.dir is not None:
            Path(o.dir).mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(o.dir)
        if self.wandb_id:  # resumed from a checkpoint: continue the same W&B run
            kwargs.update(id=self.wandb_id, resume="allow")
        self.run = wandb.init(**{k: v for k, v in kwargs.items() if v is not None})
        self.wandb_id = self.run.id

    def log_params(self, params: dict[str, Any]) -> None:
        if self.run is not None:
            self._guard("log_params", self.run.config.update, dict(params), allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self._guard("log_metrics", self.run.log, dict(metrics), step=step)

    def log_artifact(self, path: str) -> None:
        if self.run is not None:
            folder = os.path.dirname(os.path.abspath(path))
            self._guard("log_artifact", self.run.save, os.path.abspath(path), base_path=folder, policy="now")

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        if self.run is None or not rows:
            return
        self._guard("log_table", self._table, name, rows, step)

    def _table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        import wandb

        columns = list(rows[0])
        data = [[_plain(r.get(c)) for c in columns] for r in rows]
        self.run.log({name: wandb.Table(columns=columns, data=data)}, step=step)

    def finish(self, status: str) -> None:
        if self.run is not None:
            self._guard("finish", self.run.finish, exit_code=0 if status == "FINISHED" else 1)
            self.run = None

    def state_dict(self) -> dict[str, Any]:
        return {"id": self.wandb_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wandb_id = state.get("id") or self.wandb_id


def _plain(value: Any) -> Any:
    """A table cell W&B accepts: numbers and strings as they are, anything else as text."""
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    return str(value)


# --------------------------------------------------------------------------- TensorBoard
class TensorBoardOptions(Options):
    """Options of the ``tensorboard`` tracker."""

    log_dir: SpecPath = Field(
        Path("tensorboard"),
        description="Folder of the event files: a path given in the spec is relative to the spec "
        "file; the default is tensorboard/ in the working directory (as MLflow's and W&B's stores). "
        "Each run writes <log_dir>/<run name> (<run name>-<time> when an earlier run's events are there; a "
        "resumed run continues its own). View with: tensorboard --logdir <log_dir>.",
    )
    flush_secs: int = Field(30, ge=1, description="Seconds between flushes of the event file to disk.")

    @model_validator(mode="after")
    def _installed(self) -> TensorBoardOptions:
        _needs("tensorboard", "tensorboard", "tensorboard")
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


class TensorBoardTracker(_Guarded):
    """Writes scalars (every metric), text summaries (the resolved spec and artifact text
    files, completion tables as markdown, params) to TensorBoard event files.

    Each fresh run writes a TensorBoard run of its own: ``<log_dir>/<run name>``, or
    ``<log_dir>/<run name>-<time>`` when that folder holds an earlier run's events; the
    folder is part of the checkpoints, so ``--resume`` continues the same TensorBoard run."""

    label = "TensorBoard"

    def __init__(self, options: TensorBoardOptions):
        super().__init__()
        self.options = options
        self.writer = None
        self.log_dir: Path | None = None
        self._resumed = False

    def start(self, run_name: str, resume_id: str | None = None) -> str | None:
        self._guard("start", self._start, run_name)
        return None

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
    register.add("wandb", WandbTracker, options=WandbOptions)
    register.add("tensorboard", TensorBoardTracker, options=TensorBoardOptions)
