"""Checkpoints: written atomically, verified on load, the last K kept.

A checkpoint is a folder ``<run>/checkpoints/step-000010/`` holding the model (or the
adapter under LoRA) in ``save_pretrained`` form, ``state.pt`` (optimizer, scheduler, RNG
states, data position, step, tracker run id, counters, and any extra state a component
provides) and, written last, ``manifest.json`` with the size and SHA-256 of every file.
It is assembled in a temporary folder and renamed into place, so a crash leaves either
the complete checkpoint or none; a folder whose manifest is missing or does not match its
files is reported and skipped on resume. What a killed writer left (its temporary folder)
is removed by the next write or resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core.errors import RunError

log = logging.getLogger("grpo.checkpoint")

MANIFEST = "manifest.json"
STATE = "state.pt"
PREFIX = "step-"
_LEFTOVER = re.compile(rf"\.({PREFIX}\d+)\.(tmp|old)-(\d+)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as fh:
                os.fsync(fh.fileno())


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def params_finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (ours or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(root: Path) -> None:
    """Remove what a writer killed mid-write left under ``root`` (a process that is gone, or
    this one): its temporary folders, each a full copy of the model. A checkpoint it had moved
    aside to replace (``.old``) is put back when the replacement never arrived."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        match = _LEFTOVER.fullmatch(path.name)
        if match is None or (int(match[3]) != os.getpid() and pid_alive(int(match[3]))):
            continue
        final = root / match[1]
        if match[2] == "old" and not final.exists():
            path.rename(final)
        else:
            print(f"grpo-run: removing {path}, left by an interrupted checkpoint write", file=sys.stderr)
            shutil.rmtree(path, ignore_errors=True)


def write_checkpoint(root: Path, step: int, model, state: dict[str, Any], keep: int) -> Path:
    """Write ``<root>/step-NNNNNN`` atomically and prune to the last ``keep``."""
    if not params_finite(model):
        raise RunError(f"refusing to checkpoint step {step}: the model has non-finite weights")
    root.mkdir(parents=True, exist_ok=True)
    clean_leftovers(root)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "model")
    torch.save(state, tmp / STATE)
    files = {
        str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(tmp.rglob("*")) if p.is_file()
    }
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "time": time.time(), "files": files}, indent=1))
    _fsync_tree(tmp)
    if final.exists():  # the same step written again (e.g. after a resume): replace it
        old = root / f".{final.name}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    for stale in list_checkpoints(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under ``root``, oldest first (temporary folders excluded)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def verify(folder: Path) -> str | None:
    """None when ``folder`` is a complete checkpoint, else what is wrong with it."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "no manifest (incomplete write)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"unreadable manifest ({exc})"
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            return f"missing file {name}"
        if path.stat().st_size != meta["size"]:
            return f"file {name} has {path.stat().st_size} bytes, expected {meta['size']}"
        if _sha256(path) != meta["sha256"]:
            return f"file {name} does not match its checksum"
    return None


@dataclass
class Loaded:
    folder: Path
    state: dict[str, Any]


def find_resumable(root: Path, explicit: str | None = None) -> Loaded | None:
    """The checkpoint to resume from: ``explicit`` (a folder) or the newest valid one in
    ``root``, skipping (with a message) any that is incomplete or corrupt."""
    if explicit not in (None, "latest"):
        folder = Path(explicit)
        problem = verify(folder) if folder.is_dir() else "no such folder"
        if problem:
            raise RunError(f"--resume {explicit}: not a usable checkpoint: {problem}")
        candidates = [folder]
    else:
        clean_leftovers(root)
        candidates = list(reversed(list_checkpoints(root)))
    for folder in candidates:
        problem = verify(folder)
        if problem:
            print(f"grpo-run: skipping checkpoint {folder}: {problem}", file=sys.stderr)
            continue
        return Loaded(folder, torch.load(folder / STATE, weights_only=False))
    return None


def load_model_weights(model, folder: Path) -> None:
    """Load the checkpoint's weights (or adapter) into ``model`` in place."""
    from safetensors.torch import load_file

    files = sorted((folder / "model").glob("*.safetensors"))
    if not files:
        raise RunError(f"checkpoint {folder} has no safetensors weights")
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        for f in files:
            set_peft_model_state_dict(model, load_file(str(f)))
        return
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied weights (an output layer sharing the embedding) are saved once.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}
    missing = [m for m in missing if m in params and params[m].data_ptr() not in loaded]
    if missing or unexpected:
        raise RunError(
            f"checkpoint {folder} does not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
