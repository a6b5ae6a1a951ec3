"""Tracker ``console``: one line of metrics per step on stderr, a plain-text log of the run."""

from __future__ import annotations

import json
import sys
from typing import Any

from pydantic import Field

from grpo_core import hookimpl
from grpo_core.options import Options

__all__ = ["ConsoleOptions", "ConsoleTracker"]


class ConsoleOptions(Options):
    every: int = Field(1, ge=1, description="Print metrics every N steps.")
    keys: list[str] | None = Field(
        None, description="Metric names to print; default: reward, kl, loss, eval metrics and step time."
    )


_DEFAULT_KEYS = ("reward", "reward_std", "kl", "loss", "completions/mean_length", "time/step")


class ConsoleTracker:
    """Prints one line of metrics per step to stderr (a plain-text log of the run)."""

    def __init__(self, options: ConsoleOptions):
        self.options = options

    def start(self, run_name: str, resume_id: str | None = None) -> str | None:
        return None

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        keys = self.options.keys
        if keys is None:
            keys = [k for k in metrics if k in _DEFAULT_KEYS or k.startswith("eval/")]
        if step % self.options.every and not any(k.startswith("eval/") for k in metrics):
            return
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
        if shown:
            print(f"[step {step}] {shown}", file=sys.stderr, flush=True)

    def log_artifact(self, path: str) -> None:
        pass

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        if rows:
            print(f"[step {step}] {name}: {json.dumps(rows[0], ensure_ascii=False)[:300]}", file=sys.stderr)

    def finish(self, status: str) -> None:
        pass


@hookimpl
def register_trackers(register):
    register.add("console", ConsoleTracker, options=ConsoleOptions)
