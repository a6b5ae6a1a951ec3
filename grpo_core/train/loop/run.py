"""The training loop: one loop over a run's stages (:class:`~grpo_core.train.loop.state.Stage`:
an SFT stage, then the GRPO steps, or stages of your own), with held-out evaluation, logging,
checkpoints, the best checkpoints, the progress bar, the stops around them and resume, all
written once here and in :mod:`~grpo_core.train.loop.checkpoints` for every stage. The run it
drives is built by :mod:`grpo_core.train.loop.assemble`; a GRPO step is
:func:`grpo_core.train.loop.step.train_step`, by way of :mod:`grpo_core.train.loop.grpo`.

One loop for both modes: the run's feed (:mod:`grpo_core.train.feed`) hands over each step's
experience and takes the new weights, synchronously or from an actor thread running ahead.
Where the actor must be idle with the current weights (an evaluation, a checkpoint, the start
of an iterative-GRPO iteration), the stage's ``at_rest`` says so. A stage tells the feed where
those rests and its last step are (GRPO's ``next_rest``), so an asynchronous feed generates
nothing past them that it would drop there.
"""

from __future__ import annotations

import errno
import logging
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core import checkpoint as ckpt
from grpo_core.errors import RunError
from grpo_core.export import finish_exports, print_exports
from grpo_core.spec import LoadedSpec, dump_spec
from grpo_core.tracking import flatten
from grpo_core.train.distributed import close_process_group, lost_contact, lost_contact_message
from grpo_core.train.loop import checkpoints
from grpo_core.train.loop.assemble import build_run
from grpo_core.train.loop.best import MissingMetric
from grpo_core.train.loop.checkpoints import steps_of
from grpo_core.train.loop.grpo import evaluate_run
from grpo_core.train.loop.state import Hooks, Run, Stage
from grpo_core.train.signals import StopSignal

__all__ = ["Outcome", "evaluate_run", "run_loop", "train"]

log = logging.getLogger("grpo.run")


@dataclass
class Outcome:
    """How a run ended: the tracker status (``FINISHED``, ``KILLED``), the process exit code,
    and what ended it early: ``signal`` (SIGINT/SIGTERM, checkpointed), ``callback`` (a hook
    asked to stop), ``interrupt`` (a KeyboardInterrupt, checkpointed) or None."""

    status: str
    code: int
    stopped_by: str | None = None


def train(loaded: LoadedSpec, resume: str | None = None) -> int:
    """Train as the spec says; return the process exit code (``grpo-run``)."""
    return run_loop(build_run(loaded), loaded, resume).code


def run_loop(run: Run, loaded: LoadedSpec, resume: str | None = None, hooks: Hooks | None = None, *,
             checkpoint_on_interrupt: bool = False) -> Outcome:
    """Resume ``run`` if asked, drive each of its stages to its last step, finish it. A
    KeyboardInterrupt (a second Ctrl-C) propagates at once, unless ``checkpoint_on_interrupt``
    (a notebook's Ctrl-C): then the last completed step is checkpointed and the run ends
    ``KILLED``."""
    hooks = run.hooks = hooks or Hooks()
    first, run_id = checkpoints.resume(run, resume)
    _start_logging(run, loaded, run_id)
    with _ending(run, loaded) as end, StopSignal() as stop:
        run.stopping = lambda: stop.signum is not None or run.stop_asked
        outcome = None
        for stage in run.stages[first:]:
            outcome = _drive(run, stage, loaded, end, stop, checkpoint_on_interrupt)
            if outcome is not None or run.stop_asked:
                break
        if outcome is None:
            end.status, code = _finish(run, stop, end)
            short = stage is not run.stages[-1] or stage.step < stage.steps
            outcome = Outcome(end.status, code, "callback" if run.stop_asked and short else None)
    if outcome.stopped_by != "interrupt":
        close_process_group()  # every process got here: the run ended, not failed
    return outcome


@dataclass
class _End:
    status: str = "FAILED"  # what the trackers are told, unless the run sets it
    unranked: MissingMetric | None = None  # the final evaluation lacked the best metric: raised after the final save


def _drive(run: Run, stage: Stage, loaded: LoadedSpec, end: _End, stop: StopSignal,
           checkpoint_on_interrupt: bool) -> Outcome | None:
    """The one loop, over ``stage``'s remaining steps: its starting evaluation, its steps with
    their bookkeeping, then its end (a stop's checkpoint, or its final evaluation, checkpoint
    and hand-over). An :class:`Outcome` when the run stops here, None when it goes on."""
    stage.prepare(run)
    if stage.step == 0 and stage.cadence.eval_at_start and stage.can_evaluate(run):
        metrics = _evaluate(run, stage, {})  # before the stage starts: at rest
        if stage.watched:
            run.hooks.on_eval(stage.step, metrics)
        checkpoints.rank(run, stage)
    stage.start(run)
    bar = _progress(run, stage)
    try:
        # With several processes, a signal or a hook seen by any stops all of them at the same step.
        while stage.step < stage.steps and not run.dist.any(stop.signum is not None or run.stop_asked):
            start = _StepStart.of(run, stage)
            try:
                metrics = _step_and_record(run, stage, start)
                if stage.watched:
                    run.stop_asked = bool(run.hooks.on_step(stage.step, metrics)) or run.stop_asked
            except (Exception, SystemExit) as exc:  # SystemExit: sys.exit() in plugin code
                _save_failed_step(run, stage, start, loaded, exc)
                raise
            except KeyboardInterrupt as exc:
                if not checkpoint_on_interrupt:
                    raise
                _save_interrupted(run, stage, start, loaded, exc)
                end.status = "KILLED"
                return Outcome(end.status, 130, "interrupt")
            if bar is not None:
                bar.set_postfix(stage.postfix(metrics, run.books[stage.name].last_eval), refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    stage.rest(run)
    if run.dist.any(stop.signum is not None):
        end.status = "KILLED"
        folder = checkpoints.save(run, stage)
        if run.dist.is_main:
            print(f"grpo-run: stopped at {steps_of(stage, stage.step)}; checkpoint {folder}\n"
                  f"  resume with: {loaded.command('--resume')}", file=sys.stderr)
        return Outcome(end.status, stop.exit_code, "signal")
    end.unranked = _close(run, stage)
    stage.hand_over(run)
    return None


def _close(run: Run, stage: Stage) -> MissingMetric | None:
    """After the stage's last step: its final evaluation (a row of its own) and checkpoint.
    Called under the signal handler: a signal here lets them finish. An evaluation that lacks
    the best metric is returned (checkpointed), for the caller to raise once the final model
    is written."""
    unranked = None
    if stage.cadence.eval_at_end and stage.can_evaluate(run):
        metrics = _evaluate(run, stage, {})
        if stage.watched:
            run.hooks.on_eval(stage.step, metrics)
        try:
            checkpoints.rank(run, stage)
        except MissingMetric as exc:
            unranked = exc
    if stage.cadence.checkpoint_at_end:
        checkpoints.save(run, stage)
    return unranked


def _evaluate(run: Run, stage: Stage, metrics: dict[str, float]) -> dict[str, float]:
    """Evaluate the stage now, log its metrics with the step's ``metrics``; the evaluation."""
    books = run.books[stage.name]
    books.last_eval = stage.evaluate(run)
    metrics.update(books.last_eval)
    books.log.log_metrics(metrics, stage.step)
    return books.last_eval


def _step_and_record(run: Run, stage: Stage, start: _StepStart) -> dict[str, float]:
    """One step of ``stage`` plus the loop's bookkeeping: held-out evaluation, logging, tables,
    checkpoints, and the stage's own stop (GRPO's non-finite streak)."""
    record = stage.train_step(run)
    metrics, step, cadence, books = record.metrics, stage.step, stage.cadence, run.books[stage.name]
    start.recorded = True  # the step is whole from here: a checkpoint of it resumes exactly
    if cadence.evaluates_after(step, stage.steps) and stage.can_evaluate(run):
        with stage.at_rest(run):
            # logged before a ranked step is checkpointed, so its saved tracker state holds them
            evaluation = _evaluate(run, stage, metrics)
            checkpoints.rank(run, stage)
        if stage.watched:
            run.stop_asked = bool(run.hooks.on_eval(step, evaluation)) or run.stop_asked
    else:
        books.log.log_metrics(metrics, step)
    if cadence.tables_every and step % cadence.tables_every == 0:
        for name, rows in record.tables.items():
            books.log.log_table(name, rows, step)
    if checkpoints.due(run, stage):
        with stage.at_rest(run):
            checkpoints.save(run, stage)
    reason = stage.halt(metrics)
    if reason is not None:
        stage.rest(run)
        folder = checkpoints.save(run, stage)
        raise RunError(reason.replace("{folder}", str(folder)))
    return metrics


@contextmanager
def _ending(run: Run, loaded: LoadedSpec):
    """How every run ends, whatever ends it: a full disk and a lost process become errors that
    say what to do, a KeyboardInterrupt ends the run ``KILLED``, and then the feed is closed
    (without waiting for an actor thread's batch unless the run finished: nor for another
    process's actor that will never join its collective) and the trackers are told the status
    the body set (``FAILED`` unless it set another)."""
    end = _End()
    try:
        yield end
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise RunError(_disk_full(run, loaded, exc)) from exc
    except KeyboardInterrupt:
        end.status = "KILLED"
        raise
    except Exception as exc:
        if run.dist.active and lost_contact(exc):
            raise RunError(lost_contact_message(exc, run.spec.train.parallel.timeout_s)) from exc
        raise
    finally:
        run.feed.close(wait=end.status == "FINISHED")
        run.log.finish(end.status)


@dataclass
class _StepStart:
    """What a step changes before its update: the step, the update count and the RNG states
    (the stage's ``rest`` rewinds the data position)."""

    step: int
    updates: int
    rng: dict[str, Any]
    recorded: bool = False  # set once the step's update and the bookkeeping that must follow it are done

    @classmethod
    def of(cls, run: Run, stage: Stage) -> _StepStart:
        return cls(stage.step, stage.optimization(run).scheduler.last_epoch, ckpt.rng_state())


def _save_failed_step(run: Run, stage: Stage, start: _StepStart, loaded: LoadedSpec, exc: BaseException) -> None:
    """A step that failed before its update (a reward function raised, no usable prompt, out
    of memory, a full disk, a bug, another process lost) left the model and optimizer as the
    previous step did: bring the stage to rest (which rewinds the data to this step's batch),
    restore the RNG states and checkpoint that state, so that no completed step is lost. With
    several processes, a failure every process shares (a RunError they agree on) is
    checkpointed by all of them together; any other failure only by the main process alone,
    and only when it holds the whole state (ddp): the others may be waiting in a collective,
    gone or unreachable, and a sharded state (fsdp2) cannot be gathered without them."""
    updates = stage.optimization(run).scheduler.last_epoch
    if stage.step != start.step or updates != start.updates or stage.step == 0:
        return
    alone = run.dist.active and not isinstance(exc, RunError)
    if alone and (run.learner.strategy.sharded or not run.dist.is_main):
        return
    stage.rest(run)
    ckpt.set_rng_state(start.rng)
    try:
        folder = checkpoints.save(run, stage, alone=alone)
    except Exception as exc:  # keep the original error; the previous checkpoint stays
        log.warning("could not checkpoint %s after the failure: %s", steps_of(stage, stage.step), exc)
        return
    if not run.dist.is_main:
        return
    print(
        f"grpo-run: {steps_of(stage, stage.step + 1)} failed before its update; checkpoint of "
        f"{steps_of(stage, stage.step)}: {folder}\n  resume with: {loaded.command('--resume')}", file=sys.stderr,
    )


def _save_interrupted(run: Run, stage: Stage, start: _StepStart, loaded: LoadedSpec, exc: BaseException) -> None:
    """A KeyboardInterrupt the caller asked to checkpoint (``checkpoint_on_interrupt``): before
    the step's update, as a failed step; once the step is whole (its update and what follows
    it done: while evaluating or logging), the completed step itself. Mid-update (between two
    optimizer steps of one batch, or before what follows the update) nothing is written and
    the previous checkpoint stays."""
    if stage.step == start.step:
        _save_failed_step(run, stage, start, loaded, exc)
        return
    if not start.recorded:
        return
    stage.rest(run)
    folder = checkpoints.save(run, stage)
    if run.dist.is_main:
        print(f"grpo-run: interrupted after {steps_of(stage, stage.step)}; checkpoint {folder}\n"
              f"  resume with: {loaded.command('--resume')}", file=sys.stderr)


def _disk_full(run: Run, loaded: LoadedSpec, exc: OSError) -> str:
    """What to do after a write failed for want of space: where the run is, what it kept, the
    command that carries on."""
    where = f" writing {exc.filename}" if exc.filename else ""
    saved = ckpt.list_checkpoints(run.checkpoint_dir) if run.checkpoint_dir.is_dir() else []
    if saved:
        then = f"the last checkpoint is {saved[-1]}. Free some space, then resume with: {loaded.command('--resume')}"
    else:
        then = f"no checkpoint was written yet. Free some space, then start again with: {loaded.command('--overwrite')}"
    return f"no space left on the device{where} ({exc}); the run folder is {run.output_dir}, and {then}"


def _start_logging(run: Run, loaded: LoadedSpec, resume_id: str | None) -> None:
    """Open the tracker run (the checkpoint's when resuming); a new run logs the resolved
    spec as params and artifacts."""
    run.log.start(loaded.name, resume_id)
    if resume_id is None and run.dist.is_main:
        run.log.log_params(flatten(run.spec.model_dump(mode="json")))
        resolved = run.output_dir / "spec.resolved.yaml"
        resolved.write_text(dump_spec(run.spec), encoding="utf-8")
        run.log.log_artifact(resolved)
        if loaded.path is not None:
            run.log.log_artifact(loaded.path)


def _finish(run: Run, stop: StopSignal, end: _End) -> tuple[str, int]:
    """The run's end, after its last stage: the final model and the exports; the tracker
    status and exit code. Called under the signal handler: a signal here lets them finish (a
    second one stops at once), then the run exits with the signal's code."""
    final = _save_final(run)
    if end.unranked is not None:
        raise end.unranked.keeping(f"the final model {final}")
    exported = finish_exports(run, final)
    if run.dist.is_main:
        _summary(run, final, run.last_eval)
        print_exports(exported, run.log.metrics_path)
    return ("FINISHED", 0) if stop.signum is None else ("KILLED", stop.exit_code)


def _save_final(run: Run) -> Path:
    final = run.output_dir / "final"
    best = run.best_folder()
    if best is not None:  # checkpoint.final: best; training is over, so the live weights may go
        checkpoints.load_weights(run, best)
        if run.dist.is_main:
            value = run.stages[-1].best.entries[0][0]
            print(f"grpo-run: the final model is {best.name} ({run.spec.checkpoint.best_metric} = {value:.4g})",
                  file=sys.stderr)
    return run.save_model(final)


def _progress(run: Run, stage: Stage):
    if not run.spec.train.progress or not run.dist.is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=stage.steps, initial=stage.step, desc=stage.name, unit="step", file=sys.stderr,
                dynamic_ncols=True)


def _summary(run: Run, final: Path, last_eval: dict[str, float]) -> None:
    lines = [f"grpo-run: finished {run.step} steps.", f"  model saved to {final}"]
    for key, value in sorted(last_eval.items()):
        if key.startswith("eval/") and not key.endswith(("/prompts", "mean_length")):
            lines.append(f"  {key} = {value:.4f}")
    lines.append(f"  metrics: {run.log.metrics_path}")
    for name, tracker in run.log.trackers.items():
        uri = getattr(tracker, "tracking_uri", None)
        if getattr(tracker, "run_id", None):
            lines.append(f"  {name} run id: {tracker.run_id}")
            if uri:
                lines.append(f"  open the UI: mlflow ui --backend-store-uri {uri}")
    print("\n".join(lines), file=sys.stderr)
