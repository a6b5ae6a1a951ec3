"""``grpo-run runs [FOLDER ...]``: the run folders under ``runs/`` (or the folders given)
with their last step, status and held-out score, read from the files a run writes
(``metrics.jsonl``, ``spec.resolved.yaml``, ``checkpoints/``, ``final/``)."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from grpo_core.checkpoint import PREFIX
from grpo_core.textout import print_table

MARKERS = ("metrics.jsonl", "spec.resolved.yaml", "checkpoints", "final")


@dataclass
class RunInfo:
    path: Path
    status: str  # finished; stopped (a checkpoint: --resume continues it); incomplete; unreadable
    last_step: int | None
    total_steps: int | None
    heldout: float | None  # the last eval/reward logged
    updated: float | None  # mtime of metrics.jsonl


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in MARKERS)


def _metrics(path: Path) -> tuple[int | None, float | None]:
    """The last step and the last held-out reward in ``metrics.jsonl`` (torn lines, rows
    that are not objects and values that are not finite numbers skipped)."""
    last_step, heldout = None, None
    if not path.is_file():
        return None, None
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict):  # a null or a list: not a row the trainer writes
                continue
            step = row.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                last_step = step if last_step is None else max(last_step, step)
            value = row.get("eval/reward")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                heldout = float(value)
    return last_step, heldout


def _total_steps(folder: Path) -> int | None:
    try:
        spec = yaml.safe_load((folder / "spec.resolved.yaml").read_text(encoding="utf-8"))
        return int(spec["train"]["steps"])
    except Exception:
        return None


def _status(folder: Path) -> str:
    final = folder / "final"
    if (final / "config.json").is_file() or (final / "adapter_config.json").is_file():
        return "finished"
    if any((folder / "checkpoints").glob(f"{PREFIX}*")):
        return "stopped"
    return "incomplete"


def describe(folder: Path) -> RunInfo:
    """What the files of ``folder`` say; status ``unreadable`` (and a warning naming the
    folder and the error) when they cannot be read, so that one bad folder never hides the
    others from the listing."""
    metrics = folder / "metrics.jsonl"
    try:
        last_step, heldout = _metrics(metrics)
        updated = metrics.stat().st_mtime if metrics.is_file() else None
        return RunInfo(folder, _status(folder), last_step, _total_steps(folder), heldout, updated)
    except Exception as exc:  # a permission error, a folder changing under us, a bug: this folder only
        print(f"grpo-run runs: cannot read {folder}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return RunInfo(folder, "unreadable", None, None, None, None)


def find_runs(roots: list[Path]) -> list[RunInfo]:
    """Run folders among ``roots`` (each a run folder itself, or a folder of them), most
    recently updated first."""
    found: list[Path] = []
    for root in roots:
        if is_run_folder(root) and (root / "spec.resolved.yaml").exists():
            found.append(root)
        elif root.is_dir():
            found.extend(sorted(p for p in root.iterdir() if is_run_folder(p)))
    infos = [describe(p) for p in found]
    return sorted(infos, key=lambda i: i.updated or 0.0, reverse=True)


def print_runs(infos: list[RunInfo], stream: TextIO | None = None) -> None:
    rows = []
    for info in infos:
        step = "-" if info.last_step is None else str(info.last_step)
        if info.total_steps is not None:
            step += f"/{info.total_steps}"
        heldout = "-" if info.heldout is None else f"{info.heldout:.4f}"
        updated = "-" if info.updated is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(info.updated))
        rows.append([info.path.name, info.status, step, heldout, updated, str(info.path)])
    print_table(["run", "status", "step", "held-out", "updated", "folder"], rows, stream=stream)
