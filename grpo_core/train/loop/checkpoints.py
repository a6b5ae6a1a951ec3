"""A stage's checkpoints, written and read the same way for every stage: what the loop keeps of
each stage (:class:`~grpo_core.train.loop.state.Books`), writing a checkpoint (:func:`save`), ranking an evaluated step
among the best (:func:`rank`) and resuming a run (:func:`resume`).

A checkpoint of a stage is ``<stage folder>/checkpoints/step-NNNNNN``: the weights and optimizer
state, gathered by the main process or as each process's shards (``checkpoint.format``,
:func:`sharded_format`), and one state: the stage's name and step, its
line of steps (trajectory), the tracker run id, the optimizer, schedule and fp16 scaler of the
stage's :class:`~grpo_core.train.learner.optim.Optimization`, the RNG states, its best ranking
and last evaluation, and what the stage adds (:meth:`~grpo_core.train.loop.state.Stage.state_dict`).
Resuming finds the newest usable checkpoint of the latest stage that has one; the stages
before it are over (:meth:`~grpo_core.train.loop.state.Stage.resumed_past`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from grpo_core import checkpoint as ckpt
from grpo_core.errors import RunError
from grpo_core.train.learner import sharding
from grpo_core.train.loop.best import MissingMetric
from grpo_core.train.loop.state import Run, Stage


def steps_of(stage: Stage, n: int) -> str:
    """How messages name step ``n`` of ``stage`` ("SFT step 3", "step 3")."""
    return f"{stage.label} step {n}".lstrip()


def due(run: Run, stage: Stage) -> bool:
    """Whether the cadence asks for a checkpoint of the step just trained (every process
    agrees: with minutes, clocks differ between processes)."""
    c, books = stage.cadence, run.books[stage.name]
    now = ckpt.due(stage.step, c.checkpoint_every, c.checkpoint_minutes, books.saved_at)
    return run.dist.any(now) if c.checkpoint_minutes else now


def sharded_format(run: Run) -> bool:
    """Whether the run writes its checkpoints sharded (``checkpoint.format``; ``auto``: when the
    weights are sharded)."""
    chosen = run.spec.checkpoint.format
    return chosen == "sharded" or (chosen == "auto" and run.learner.strategy.sharded)


def save(run: Run, stage: Stage, alone: bool = False, again: bool = False) -> Path:
    """Checkpoint ``stage``'s current step (call it with the stage at rest); a step this
    process already saved is not written twice. Sharded (:func:`sharded_format`), every
    process writes its shards; gathered, the main process writes and the others wait for it (a
    sharded model's weights and optimizer state are gathered by every process). ``alone``: the
    main process writes without the others (they failed, or cannot be reached), which only
    whole copies (not shards) allow, in the gathered form. ``again``: rewrite a step already
    saved (its state changed: an evaluation ranked it)."""
    books, step = run.books[stage.name], stage.step
    folder = ckpt.step_folder(books.checkpoint_dir, step)
    if not again and books.saved_step == step and folder.is_dir():
        return folder
    strategy = run.learner.strategy
    if alone and strategy.sharded:
        raise ValueError("save(alone=True): a sharded model's checkpoint needs every process")
    if not alone and sharded_format(run):
        folder = _save_sharded(run, stage)
    else:
        weights = strategy.model_state(run.model)
        state = _state(run, stage) if strategy.sharded or run.dist.is_main else None
        if run.dist.is_main:
            folder = ckpt.write_checkpoint(
                books.checkpoint_dir, step, run.model, state, run.spec.checkpoint.keep, books.trajectory,
                weights=weights, protect=stage.best.steps if stage.best is not None else set(),
            )
        if not alone:
            run.dist.barrier()
    books.saved_step, books.saved_at = step, time.monotonic()
    if stage.watched:
        run.hooks.on_save(step, folder)
    return folder


def _save_sharded(run: Run, stage: Stage) -> Path:
    """Every process writes its shards of the weights and optimizer state into the main
    process's temporary folder and records them (size, SHA-256); the main one writes the rest
    of the state and commits the folder (manifest last, then the rename), so a save cut off
    anywhere leaves no checkpoint of the step."""
    books, step, dist = run.books[stage.name], stage.step, run.dist
    if dist.any(not sharding.shards_finite(run.model)):
        raise RunError(f"refusing to checkpoint step {step}: the model has non-finite weights")
    tmp = ckpt.temp_folder(books.checkpoint_dir, step, dist.gather(os.getpid())[0])
    if dist.is_main:
        ckpt.begin_write(books.checkpoint_dir, step)
    dist.barrier()
    sharding.save_shards(run.model, stage.optimization(run).optimizer, tmp / ckpt.SHARDS, dist.group)
    own = sorted((tmp / ckpt.SHARDS).glob(f"__{dist.rank}_*"))
    records = dist.gather(ckpt.file_records(tmp, own) if not dist.is_main else {})
    folder = ckpt.step_folder(books.checkpoint_dir, step)
    if dist.is_main:
        torch.save(_state(run, stage, with_optimizer=False), tmp / ckpt.STATE)
        files = {name: record for each in records for name, record in each.items()}
        folder = ckpt.commit_write(books.checkpoint_dir, step, tmp, run.spec.checkpoint.keep, books.trajectory,
                                   stage.best.steps if stage.best is not None else set(), files=files)
    dist.barrier()
    return folder


def _state(run: Run, stage: Stage, with_optimizer: bool = True) -> dict[str, Any]:
    books, opt, strategy = run.books[stage.name], stage.optimization(run), run.learner.strategy
    optimizer, optimizer_format = (strategy.optimizer_state(run.model, opt.optimizer) if with_optimizer
                                   else (None, "sharded"))
    return {
        "stage": stage.name, "step": stage.step, "trajectory": books.trajectory, "run_id": run.log.run_id,
        "optimizer": optimizer, "optimizer_format": optimizer_format, "scheduler": opt.scheduler.state_dict(),
        "scaler": opt.scaler.state_dict() if opt.scaler is not None else None, "rng": ckpt.rng_state(),
        "best": stage.best.state_dict() if stage.best is not None else None, "last_eval": dict(books.last_eval),
        **stage.state_dict(run),
    }


def load_weights(run: Run, folder: Path) -> None:
    """Load the weights of the checkpoint ``folder`` (either form) into the policy, whichever
    strategy and process count wrote it (every process calls it)."""
    if ckpt.is_sharded(folder):
        sharding.load_shards(run.model, None, folder / ckpt.SHARDS, run.dist.group)
    else:
        ckpt.load_model_weights(run.model, folder, run.learner.strategy.load_model_state)


def rank(run: Run, stage: Stage) -> None:
    """Rank the step just evaluated among the stage's best (:attr:`Stage.best`) and checkpoint
    it when it is among them (call it with the stage at rest, right after the evaluation). An
    evaluation without the metric checkpoints the step, then raises :class:`MissingMetric`."""
    books, best = run.books[stage.name], stage.best
    if best is None or not books.last_eval:
        return
    try:
        ranked = best.offer(stage.step, books.last_eval)
    except MissingMetric as exc:  # the trained steps are kept before the run stops
        raise exc.keeping(f"the checkpoint {save(run, stage)}") from None
    if ranked:
        # recorded before writing: the checkpoint's own state lists its folder, so a run
        # resumed from it can still export it as the best
        best.saved(stage.step, ckpt.step_folder(books.checkpoint_dir, stage.step))
        save(run, stage, again=True)  # the last step was saved before its final evaluation
        if run.dist.is_main:  # a step saved before its evaluation was not pruned with this ranking
            ckpt.prune(books.checkpoint_dir, run.spec.checkpoint.keep, books.trajectory, best.steps)
            best.write(books.checkpoint_dir)


def resume(run: Run, explicit: str | None) -> tuple[int, str | None]:
    """Restore the run from a checkpoint (``explicit``: ``latest`` or a folder; None: start
    afresh); ``(index of the stage to drive first, tracker run id to continue)``."""
    if explicit is None:
        return 0, None
    stages, device = run.stages, run.dist.device
    if explicit != "latest":
        parent = Path(explicit).resolve().parent
        index = next((i for i, s in enumerate(stages) if run.books[s.name].checkpoint_dir.resolve() == parent),
                     len(stages) - 1)
        found = ckpt.find_resumable(run.books[stages[index].name].checkpoint_dir, explicit, map_location=device)
    else:
        for index in reversed(range(len(stages))):
            found = ckpt.find_resumable(run.books[stages[index].name].checkpoint_dir, None, map_location=device)
            if found is not None:
                break
    if found is None:
        where = " nor in ".join(str(run.books[s.name].checkpoint_dir) for s in reversed(stages))
        raise RunError(f"--resume: no usable checkpoint in {where}; run without --resume to start afresh")
    for before in stages[:index]:
        before.resumed_past(run)
    stage = stages[index]
    _restore(run, stage, found)
    if run.dist.is_main:
        named = f"the {stage.label} stage " if stage.label else ""
        print(f"grpo-run: resuming {named}from {found.folder} ({steps_of(stage, stage.step)})", file=sys.stderr)
        print("".join(f"grpo-run: --resume: {note}\n" for note in stage.overridden(found.state)), end="",
              file=sys.stderr)
    return index, found.state.get("run_id")


def _restore(run: Run, stage: Stage, found: ckpt.Loaded) -> None:
    """Continue ``stage`` from the checkpoint ``found``: its weights and optimizer state (each
    process reading its part of the shards, or through the strategy, which loads what it
    gathered), its state, and the line of steps that follows it."""
    books, state, strategy = run.books[stage.name], found.state, run.learner.strategy
    opt = stage.optimization(run)
    if ckpt.is_sharded(found.folder):
        sharding.load_shards(run.model, opt.optimizer, found.folder / ckpt.SHARDS, run.dist.group)
    else:
        ckpt.load_model_weights(run.model, found.folder, strategy.load_model_state)
        strategy.load_optimizer_state(run.model, opt.optimizer, state["optimizer"],
                                      state.get("optimizer_format", "native"))
    opt.scheduler.load_state_dict(state["scheduler"])
    if opt.scaler is not None and state.get("scaler"):
        opt.scaler.load_state_dict(state["scaler"])
    stage.load_state_dict(run, state)
    books.last_eval = dict(state.get("last_eval", {}))
    if stage.best is not None and state.get("best"):
        stage.best.load_state_dict(state["best"])
    ckpt.set_rng_state(state["rng"])
    books.trajectory = ckpt.trajectory_after_resume(books.checkpoint_dir, found)
    books.saved_step = stage.step
    books.log.rewind(stage.step)
