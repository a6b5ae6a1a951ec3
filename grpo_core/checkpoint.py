"""Checkpoints: written atomically, verified on load, the last K kept.

A checkpoint is a folder ``<run>/checkpoints/step-000010/`` holding, in the gathered form,
the model (or the adapter under LoRA) in ``save_pretrained`` form and ``state.pt``
(optimizer, scheduler, RNG states, data position, step, tracker run id, counters, and any
extra state a component provides); in the sharded form (``checkpoint.format``), ``shards/``
(``torch.distributed.checkpoint``: each process's shards of the weights and optimizer state,
and their metadata) and ``state.pt`` without the optimizer. Either way, written last,
``manifest.json`` with the size and SHA-256 of every file (for shards, recorded by the
process that wrote them).
It is assembled in a temporary folder and renamed into place, so a crash leaves either
the complete checkpoint or none; a folder whose manifest is missing or does not match its
files is reported and skipped on resume. What a killed writer left (its temporary folder)
is removed by the next write or resume.

Each run's line of steps (its *trajectory*) has an id, written in every manifest: pruning
keeps the newest of the current trajectory's checkpoints and ``--resume`` picks among those
of the trajectory written last, so checkpoints another run left in the folder are never
deleted, nor resumed by mistake; writing a step whose folder holds another trajectory's
complete checkpoint moves that one to ``checkpoints/superseded/`` rather than replacing it
(a corrupt or incomplete one is replaced).
``state.pt`` is read with ``torch.load(weights_only=True)``:
tensors, plain containers, numbers and strings (and numpy's RNG state) load, anything else
(a pickled object that could run code) is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core.errors import RunError, UsageError

log = logging.getLogger("grpo.checkpoint")

MANIFEST = "manifest.json"
STATE = "state.pt"
#: The folder of a sharded checkpoint's weights and optimizer state (DCP's layout).
SHARDS = "shards"
PREFIX = "step-"
#: What a previous run leaves in its folder, moved aside by ``--overwrite``.
RUN_FILES = ("checkpoints", "metrics.jsonl", "metrics.superseded.jsonl", "final", "spec.resolved.yaml",
             "environment.json")
#: Where a checkpoint of another trajectory goes when this one writes the same step.
SUPERSEDED = "superseded"
_LEFTOVER = re.compile(rf"\.({PREFIX}\d+)\.(tmp|old|del)-(\d+)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    # RNG states are CPU byte tensors, whatever map_location a checkpoint was loaded with.
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])


def params_finite(model, weights: dict[str, torch.Tensor] | None = None) -> bool:
    """Whether every weight is finite (of ``weights``, a gathered state dict, when given)."""
    tensors = model.parameters() if weights is None else (t for t in weights.values() if t.is_floating_point())
    return all(bool(torch.isfinite(p).all()) for p in tensors)


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
    this one): its temporary folders, each a full copy of the model, and the remains of a
    checkpoint it was deleting (``.del``). A checkpoint it had moved aside to replace (``.old``)
    is put back when the replacement never arrived."""
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


def new_trajectory() -> str:
    """A fresh trajectory id (a run started without ``--resume``, or a branch off an old step)."""
    return uuid.uuid4().hex[:16]


def step_folder(root: Path, step: int) -> Path:
    """``<root>/step-NNNNNN``: where :func:`write_checkpoint` writes ``step``."""
    return root / f"{PREFIX}{step:06d}"


def write_checkpoint(
    root: Path, step: int, model, state: dict[str, Any], keep: int, trajectory: str | None = None,
    weights: dict[str, torch.Tensor] | None = None, protect: set[int] | frozenset[int] = frozenset(),
) -> Path:
    """Write ``<root>/step-NNNNNN`` atomically in the gathered form (the model by
    ``save_pretrained``, ``state.pt``) and prune the trajectory's to the last ``keep`` (the
    steps in ``protect``, the best by a metric, aside).
    ``weights``: the model's whole state dict when it is sharded (gathered by the caller)."""
    if not params_finite(model, weights):
        raise RunError(f"refusing to checkpoint step {step}: the model has non-finite weights")
    tmp = begin_write(root, step)
    model.save_pretrained(tmp / "model", state_dict=weights)
    torch.save(state, tmp / STATE)
    return commit_write(root, step, tmp, keep, trajectory, protect)


def begin_write(root: Path, step: int, pid: int | None = None) -> Path:
    """The empty temporary folder ``<root>/.step-NNNNNN.tmp-<pid>`` a checkpoint of ``step`` is
    assembled in (``pid``: of the process that will commit it; default this one), after
    removing what killed writers left."""
    root.mkdir(parents=True, exist_ok=True)
    clean_leftovers(root)
    tmp = temp_folder(root, step, pid or os.getpid())
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def temp_folder(root: Path, step: int, pid: int) -> Path:
    """Where the process ``pid`` assembles the checkpoint of ``step`` (:func:`begin_write`)."""
    return root / f".{step_folder(root, step).name}.tmp-{pid}"


def file_records(folder: Path, paths: list[Path] | None = None) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of ``paths`` (default: every file under ``folder``), keyed by their path
    relative to ``folder``: the manifest's ``files``. Each is fsynced first."""
    out = {}
    for p in sorted(folder.rglob("*")) if paths is None else paths:
        if p.is_file():
            with p.open("rb") as fh:
                os.fsync(fh.fileno())
            out[str(p.relative_to(folder))] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    return out


def commit_write(
    root: Path, step: int, tmp: Path, keep: int, trajectory: str | None,
    protect: set[int] | frozenset[int] = frozenset(), files: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Make the complete folder ``tmp`` (:func:`begin_write`) the checkpoint of ``step``: its
    manifest written last (``files``: records other processes made of the files they wrote,
    :func:`file_records`; the rest are recorded here), then renamed into place; then prune."""
    records = dict(files or {})
    rest = [p for p in sorted(tmp.rglob("*")) if p.is_file() and str(p.relative_to(tmp)) not in records]
    records.update(file_records(tmp, rest))
    manifest = {"step": step, "time": time.time(), "trajectory": trajectory, "files": dict(sorted(records.items()))}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    file_records(tmp, [tmp / MANIFEST])  # fsynced (the other files were, as they were recorded)
    final = step_folder(root, step)
    if final.exists() and _manifest(final).get("trajectory") not in (None, trajectory) and verify(final) is None:
        _set_aside(root, final)  # a usable step of another line; a broken one is replaced below
    if final.exists():  # the same step of this trajectory written again (e.g. after a resume): replace it
        old = root / f".{final.name}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    prune(root, keep, trajectory, protect)
    return final


def prune(root: Path, keep: int, trajectory: str | None, protect: set[int] | frozenset[int] = frozenset()) -> None:
    """Delete the trajectory's checkpoints but the last ``keep`` and the steps in ``protect``."""
    ours = [p for p in list_checkpoints(root) if _manifest(p).get("trajectory") == trajectory]
    for stale in ours[:-keep]:
        if int(stale.name[len(PREFIX):]) not in protect:
            remove_checkpoint(stale)


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint folder so that a kill at any moment leaves it whole or gone: it is
    renamed out of the listing first (``.step-N.del-<pid>``, which :func:`clean_leftovers`
    removes later), then deleted. Deleted in place, a kill mid-way left a listed folder
    without its manifest, which no later prune recognized as its own."""
    doomed = folder.with_name(f".{folder.name}.del-{os.getpid()}")
    folder.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _set_aside(root: Path, folder: Path) -> None:
    """Move ``folder``, a complete checkpoint of another trajectory (a line abandoned by a
    resume from an older step), to ``<root>/superseded/`` instead of replacing it: a write
    never destroys a usable step of another line."""
    trajectory = _manifest(folder).get("trajectory")
    aside = root / SUPERSEDED / f"{folder.name}-{trajectory}"
    aside.parent.mkdir(exist_ok=True)
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    folder.rename(aside)
    print(f"grpo-run: {folder} belongs to another line of steps (trajectory {trajectory}); moved to {aside}",
          file=sys.stderr)


def _manifest(folder: Path) -> dict[str, Any]:
    """The folder's manifest, or ``{}`` when it has none or it cannot be read."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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


def _numpy_globals() -> list[Any]:
    """What numpy's RNG state (a ``uint32`` array) needs to unpickle."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]


def load_state(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """``state.pt`` read with ``weights_only=True``: a file that needs anything beyond tensors,
    plain containers, numbers, strings and numpy's RNG state is refused, never executed."""
    if torch.device(map_location).type == "cpu":  # torch cannot restore onto "cpu:0" (accelerate's CPU device)
        map_location = "cpu"
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = next((line for line in lines if "Unsupported" in line), lines[0] if lines else "")
        first = first.split(". Please use")[0][:300]  # torch's advice to allow-list it: not for a user
        raise RunError(
            f"refusing to load {path}: it holds more than tensors and plain data, which could run code "
            f"when unpickled ({first}). Resume only from checkpoints you wrote yourself; a component's "
            "state_dict must be tensors, lists, dicts, numbers and strings."
        ) from None


def find_resumable(root: Path, explicit: str | None = None, map_location: Any = "cpu") -> Loaded | None:
    """The checkpoint to resume from: ``explicit`` (a folder) or the newest valid one in
    ``root`` of the trajectory written last, skipping (with a message) any that is
    incomplete or corrupt."""
    if explicit not in (None, "latest"):
        folder = Path(explicit)
        problem = verify(folder) if folder.is_dir() else "no such folder"
        if problem:
            raise RunError(f"--resume {explicit}: not a usable checkpoint: {problem}")
        candidates = [folder]
    else:
        clean_leftovers(root)
        candidates = _current_trajectory(list(reversed(list_checkpoints(root))))
    for folder in candidates:
        problem = verify(folder)
        if problem:
            print(f"grpo-run: skipping checkpoint {folder}: {problem}", file=sys.stderr)
            continue
        return Loaded(folder, load_state(folder / STATE, map_location))
    return None


def _current_trajectory(folders: list[Path]) -> list[Path]:
    """Of ``folders``, those of the trajectory whose checkpoint was written last (a folder
    without a readable manifest stays a candidate, to be reported as broken)."""
    written = [(m.get("time", 0), m.get("trajectory")) for m in map(_manifest, folders) if m]
    if not written:
        return folders
    current = max(written, key=lambda w: w[0])[1]
    kept = [f for f in folders if not _manifest(f) or _manifest(f).get("trajectory") == current]
    if len(kept) < len(folders):
        skipped = len(folders) - len(kept)
        print(f"grpo-run: ignoring {skipped} checkpoint(s) of another run in the folder", file=sys.stderr)
    return kept


def trajectory_after_resume(root: Path, loaded: Loaded) -> str:
    """The trajectory a resumed run continues: the checkpoint's own, unless the folder holds a
    later step of it (a resume from an older checkpoint branches: a new id, so that pruning
    never deletes the branch's steps in favour of the abandoned ones)."""
    own = loaded.state.get("trajectory")
    step = int(loaded.state.get("step", 0))
    later = [
        f for f in list_checkpoints(root)
        if int(f.name[len(PREFIX):]) > step and _manifest(f).get("trajectory") == own
    ]
    if own and not later:
        return str(own)
    return new_trajectory()


def overridden_on_resume(state: dict[str, Any], spec) -> list[str]:
    """What a resume from ``state`` uses instead of ``spec``'s value, one note per setting: the
    learning rate, which the optimizer's and scheduler's state carry (a changed ``train.lr``
    would otherwise be recorded in ``spec.resolved.yaml`` and silently not used)."""
    base = (state.get("scheduler") or {}).get("base_lrs") or []
    if base and any(abs(float(b) - spec.train.lr) > 1e-12 * max(1.0, abs(spec.train.lr)) for b in base):
        return [f"train.lr = {spec.train.lr:g} is not used: the optimizer and its schedule continue from the "
                f"checkpoint's learning rate {float(base[0]):g} (start a new run to change it)"]
    return []


def run_folder(loaded) -> Path:
    """The run folder of a loaded spec: ``train.output_dir``, or ``runs/<spec name>``."""
    return Path(loaded.spec.train.output_dir or Path("runs") / loaded.name)


def previous_run(folder: Path) -> list[str]:
    """What another run left in ``folder`` (checkpoints, metrics, final model), by name."""
    held = []
    if list_checkpoints(folder / "checkpoints"):
        held.append("checkpoints/")
    metrics = folder / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        held.append("metrics.jsonl")
    if (folder / "final").exists():
        held.append("final/")
    return held


def claim_run_folder(folder: Path, overwrite: bool, move: bool = True) -> None:
    """Before a fresh run (no ``--resume``): refuse a folder that holds another run, or with
    ``overwrite`` move that run's files into ``<folder>/overwritten/<time>/`` (``move`` is
    False on the processes other than the one that moves them)."""
    held = previous_run(folder)
    if not held:
        return
    if not overwrite:
        raise UsageError(
            f"the run folder {folder} holds another run ({', '.join(held)}). Continue it with --resume, "
            f"start over with --overwrite (its files are moved to {folder / 'overwritten'}/), or set "
            "train.output_dir to a new folder"
        )
    if not move:
        return
    aside = folder / "overwritten" / time.strftime("%Y%m%d-%H%M%S")
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    aside.mkdir(parents=True)
    for name in RUN_FILES:
        if (folder / name).exists():
            (folder / name).rename(aside / name)
    print(f"grpo-run: --overwrite: the previous run's files were moved to {aside}", file=sys.stderr)


def due(step: int, every: int, every_minutes: float, saved_at: float) -> bool:
    """Whether a periodic checkpoint is due after ``step``: every ``every`` steps, or when
    ``every_minutes`` have passed since the last one (``saved_at``, ``time.monotonic()``)."""
    by_steps = bool(every) and step % every == 0
    by_time = bool(every_minutes) and time.monotonic() - saved_at >= every_minutes * 60
    return by_steps or by_time


def is_sharded(folder: Path) -> bool:
    """Whether the checkpoint ``folder`` is in the sharded form (its weights under ``shards/``)."""
    return (folder / SHARDS).is_dir()


def load_model_weights(model, folder: Path, load_state=None) -> None:
    """Load the checkpoint's weights (or adapter) into ``model`` in place; whole weights go
    through ``load_state(model, state)`` (the parallel strategy's
    :meth:`~grpo_core.train.learner.parallel.OneProcess.load_model_state`, which checks that they fit)."""
    from safetensors.torch import load_file

    files = sorted((folder / "model").glob("*.safetensors"))
    if not files:
        raise RunError(f"checkpoint {folder} has no safetensors weights"
                       + (" (it is sharded: shards/ is read through the parallel strategy)" if is_sharded(folder)
                          else ""))
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        for f in files:
            set_peft_model_state_dict(model, load_file(str(f)))
        return
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    try:
        (load_state or load_whole_state)(model, state)
    except ValueError as exc:
        raise RunError(f"checkpoint {folder} does not fit the model ({exc})") from exc


def load_whole_state(model, state: dict[str, torch.Tensor]) -> None:
    """Load whole weights into an unsharded ``model``; ValueError naming what does not fit.
    Tied weights (an output layer sharing the embedding) are saved once."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}
    missing = [m for m in missing if m in params and params[m].data_ptr() not in loaded]
    if missing or unexpected:
        raise ValueError(f"missing {missing[:5]}, unexpected {unexpected[:5]}")
