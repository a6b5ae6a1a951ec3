"""Tracker ``wandb``: Weights & Biases (``pip install 'grpo-core[wandb]'``; a spec that selects it
without the package fails validation naming the command). Completion tables become
``wandb.Table`` rows; the W&B run id is part of the checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from grpo_plugins.trackers.common import GuardedTracker, require_package
from pydantic import Field, model_validator

from grpo_core import hookimpl
from grpo_core.options import Options
from grpo_core.spec import SpecPath

__all__ = ["WandbOptions", "WandbTracker"]


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
        require_package("wandb", "wandb", "wandb")
        return self


class WandbTracker(GuardedTracker):
    """Logs params (as the run config), metrics, ``wandb.Table`` completion tables and
    artifact files (saved into the run's files) to a W&B run.

    The W&B run id is part of the run's checkpoints, so ``--resume`` continues the same
    W&B run. It is kept apart from the MLflow run id the engine checkpoints: this tracker
    has no ``run_id`` attribute and ``start`` returns None.
    """

    label = "W&B"

    def __init__(self, options: WandbOptions):
        super().__init__(options)
        self.run = None
        self.wandb_id: str | None = None

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


@hookimpl
def register_trackers(register):
    register.add("wandb", WandbTracker, options=WandbOptions)
