"""The training loop: steps, with held-out evaluation, logging, checkpoints and the stops
around them. The run it drives is built by :mod:`grpo_core.train.loop.assemble`; one step is
:func:`grpo_core.train.loop.step.train_step`.

One loop for both modes: the run's feed (:mod:`grpo_core.train.feed`) hands over each step's
experience and takes the new weights, synchronously or from an actor thread running ahead.
Where the actor must be idle with the current weights (an evaluation, a checkpoint, the start
of an iterative-GRPO iteration), the loop says so with ``run.at_rest()``; the feed knows where
those rests and the last step are (``run.next_rest``), so an asynchronous one generates nothing
past them that it would drop there.
"""

from __future__ import annotations

import errno
import logging
import math
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
from grpo_core.train.loop.assemble import build_run
from grpo_core.train.loop.best import MissingMetric
from grpo_core.train.loop.evaluate import EvalSet, evaluate_sets
from grpo_core.train.loop.state import Hooks, Run
from grpo_core.train.loop.step import train_step
from grpo_core.train.signals import StopSignal

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
    """Resume ``run`` if asked, train it to ``train.steps``, finish it. A KeyboardInterrupt
    (a second Ctrl-C) propagates at once, unless ``checkpoint_on_interrupt`` (a notebook's
    Ctrl-C): then the last completed step is checkpointed and the run ends ``KILLED``."""
    if run.best is not None and not run.has_eval:
        raise RunError("checkpoint.best_metric ranks steps by an evaluation, but this run has no held-out "
                       "prompts (data.eval_size, eval.sets): add some or drop best_metric")
    hooks = run.hooks = hooks or Hooks()
    _start_logging(run, loaded, _resume(run, resume))
    bar = _progress(run, run.step)
    with _ending(run, loaded, bar) as end, StopSignal() as stop:
        if run.sft is not None and not run.sft.run(run, stop, loaded):  # a signal stopped the SFT stage
            end.status = "KILLED"
            outcome = Outcome(end.status, stop.exit_code, "signal")
        else:
            outcome = _grpo(run, loaded, hooks, bar, end, stop, checkpoint_on_interrupt)
    if outcome.stopped_by != "interrupt":
        close_process_group()  # every process got here: the run ended, not failed
    return outcome


def _grpo(run: Run, loaded: LoadedSpec, hooks: Hooks, bar, end: _End, stop: StopSignal,
          checkpoint_on_interrupt: bool) -> Outcome:
    """The GRPO steps of :func:`run_loop`, inside its ending and signal handler."""
    spec = run.spec
    if spec.eval.at_start and run.has_eval and run.step == 0:
        run.last_eval = evaluate_run(run)  # before the feed starts: the actor is at rest
        run.log.log_metrics(run.last_eval, run.step)
        hooks.on_eval(run.step, run.last_eval)
        run.after_eval()
    # the feed generates no batch that a rest (a checkpoint, an evaluation) would drop, or that no step trains
    run.feed.start(run.model, run.step, run.next_rest, lambda: stop.signum is not None or run.stop_asked)
    # With several processes, a signal or a hook seen by any stops all of them at the same step.
    while run.step < spec.train.steps and not run.dist.any(stop.signum is not None or run.stop_asked):
        start = _StepStart.of(run)
        try:
            metrics = _step_and_record(run, start)
            run.stop_asked = bool(hooks.on_step(run.step, metrics)) or run.stop_asked
        except (Exception, SystemExit) as exc:  # SystemExit: sys.exit() in plugin code
            _save_failed_step(run, start, loaded, exc)
            raise
        except KeyboardInterrupt as exc:
            if not checkpoint_on_interrupt:
                raise
            _save_interrupted(run, start, loaded, exc)
            end.status = "KILLED"
            return Outcome(end.status, 130, "interrupt")
        if bar is not None:
            bar.set_postfix(_postfix(metrics, run.last_eval), refresh=False)
            bar.update(1)
    run.feed.stop(run.model, run.step)
    if run.dist.any(stop.signum is not None):
        end.status = "KILLED"
        folder = run.save_checkpoint()
        if run.dist.is_main:
            print(
                f"grpo-run: stopped at step {run.step}; checkpoint {folder}\n"
                f"  resume with: {loaded.command('--resume')}", file=sys.stderr,
            )
        outcome = Outcome(end.status, stop.exit_code, "signal")
    else:
        end.status, code = _finish(run, stop)
        outcome = Outcome(end.status, code, "callback" if run.step < spec.train.steps else None)
    return outcome


@dataclass
class _End:
    status: str = "FAILED"  # what the trackers are told, unless the run sets it


@contextmanager
def _ending(run: Run, loaded: LoadedSpec, bar):
    """How every run ends, whatever ends it: a full disk and a lost process become errors that
    say what to do, a KeyboardInterrupt ends the run ``KILLED``, and then the feed is closed
    (without waiting for an actor thread's batch unless the run finished: nor for another
    process's actor that will never join its collective), the progress bar too, and the
    trackers are told the status the body set (``FAILED`` unless it set another)."""
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
        if bar is not None:
            bar.close()
        run.log.finish(end.status)


def _step_and_record(run: Run, start: _StepStart) -> dict[str, float]:
    """One training step plus the loop's bookkeeping: the iteration start of iterative
    GRPO, held-out evaluation, logging, checkpoints, the non-finite stop."""
    spec = run.spec
    begun: dict[str, float] = {}
    if run.iterative is not None and run.iterative.due(run.step):
        with run.at_rest():
            begun = run.iterative.begin(run.actor, run.model)
    result = train_step(run.feed, run.learner, run.step)
    metrics = run.dist.combine_metrics(result.metrics)
    if run.learner.kl is not None:  # adaptive beta and reference sync see the global step
        rows = spec.train.prompts_per_step * spec.rollout.group_size
        metrics.update(run.learner.kl.after_step(run.step, run.model, metrics.get("kl"), rows))
    metrics.update(begun)
    start.recorded = True  # the step is whole from here: a checkpoint of it resumes exactly
    run.nonfinite_streak = run.nonfinite_streak + 1 if metrics["train/nonfinite_updates"] else 0
    metrics["train/nonfinite_streak"] = run.nonfinite_streak
    metrics["data/skipped_prompts"] = float(sum(run.prompts.skipped.values()))
    if spec.eval.every and run.step % spec.eval.every == 0 and run.step < spec.train.steps:
        with run.at_rest():
            run.last_eval = evaluate_run(run)
            metrics.update(run.last_eval)
            # logged before a ranked step is checkpointed, so its saved tracker state holds them
            run.log.log_metrics(metrics, run.step)
            run.after_eval()
        run.stop_asked = bool(run.hooks.on_eval(run.step, run.last_eval)) or run.stop_asked
    else:
        run.log.log_metrics(metrics, run.step)
    every = spec.train.log_completions_every
    if every and run.step % every == 0:
        run.log.log_table("completions", result.samples, run.step)
    c = spec.checkpoint
    due = ckpt.due(run.step, c.every, c.every_minutes, run.saved_at)
    if run.dist.any(due) if c.every_minutes else due:  # clocks differ between processes
        with run.at_rest():
            run.save_checkpoint()
    if run.nonfinite_streak >= spec.train.max_nonfinite_updates:
        run.feed.stop(run.model, run.learner.version)
        folder = run.save_checkpoint()
        raise RunError(
            f"{run.nonfinite_streak} steps in a row had a non-finite loss or gradient "
            f"(train.max_nonfinite_updates = {spec.train.max_nonfinite_updates}); stopped with the "
            f"last good weights in {folder}. Lower train.lr or check the rewards."
        )
    return metrics


def evaluate_run(run: Run) -> dict[str, float]:
    """The held-out sets' metrics: the default set, then every named one (see
    :func:`evaluate_sets`). The caller holds the actor at rest."""
    sets = [EvalSet("eval/", run.eval_prompts, run.spec.data.prompt_column), *run.eval_sets.values()]
    with run.actor.weights():
        return evaluate_sets(run.spec, run.actor, sets)


@dataclass
class _StepStart:
    """What a step changes before its update: the update count and the RNG states (the feed
    rewinds the prompt position)."""

    step: int
    updates: int
    rng: dict[str, Any]
    recorded: bool = False  # set once the step's update and the bookkeeping that must follow it are done

    @classmethod
    def of(cls, run: Run) -> _StepStart:
        return cls(run.step, run.learner.scheduler.last_epoch, ckpt.rng_state())


def _save_failed_step(run: Run, start: _StepStart, loaded: LoadedSpec, exc: BaseException) -> None:
    """A step that failed before its update (a reward function raised, no usable prompt, out
    of memory, a full disk, a bug, another process lost) left the model and optimizer as the
    previous step did: stop the feed (which rewinds the prompts to this step's batch), restore
    the RNG states and checkpoint that state, so that no completed step is lost. With several
    processes, a failure every process shares (a RunError they agree on) is checkpointed by all
    of them together; any other failure only by the main process alone, and only when it holds
    the whole state (ddp): the others may be waiting in a collective, gone or unreachable, and
    a sharded state (fsdp2) cannot be gathered without them."""
    if run.step != start.step or run.learner.scheduler.last_epoch != start.updates or run.step == 0:
        return
    alone = run.dist.active and not isinstance(exc, RunError)
    if alone and (run.learner.strategy.sharded or not run.dist.is_main):
        return
    run.feed.stop(run.model, run.step)
    ckpt.set_rng_state(start.rng)
    try:
        folder = run.save_checkpoint(alone=alone)
    except Exception as exc:  # keep the original error; the previous checkpoint stays
        log.warning("could not checkpoint step %d after the failure: %s", run.step, exc)
        return
    if not run.dist.is_main:
        return
    print(
        f"grpo-run: step {run.step + 1} failed before its update; checkpoint of step {run.step}: {folder}\n"
        f"  resume with: {loaded.command('--resume')}", file=sys.stderr,
    )


def _save_interrupted(run: Run, start: _StepStart, loaded: LoadedSpec, exc: BaseException) -> None:
    """A KeyboardInterrupt the caller asked to checkpoint (``checkpoint_on_interrupt``): before
    the step's update, as a failed step; once the step is whole (its update and what follows
    it, the KL controller's, done: while evaluating or logging), the completed step itself.
    Mid-update (between two optimizer steps of one batch, or before what follows the update)
    nothing is written and the previous checkpoint stays."""
    if run.step == start.step:
        _save_failed_step(run, start, loaded, exc)
        return
    if not start.recorded:
        return
    run.feed.stop(run.model, run.step)
    folder = run.save_checkpoint()
    if run.dist.is_main:
        print(f"grpo-run: interrupted after step {run.step}; checkpoint {folder}\n"
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


def _resume(run: Run, resume: str | None) -> str | None:
    """Restore the run from a checkpoint; return the tracker run id to continue. The actor gets
    the restored weights when the feed starts."""
    if resume is None:
        return None
    sft = run.sft
    if sft is not None and resume not in (None, "latest") and Path(resume).resolve().parent == \
            sft.checkpoint_dir.resolve():
        return sft.resume(run, resume)
    found = ckpt.find_resumable(run.checkpoint_dir, resume, map_location=run.dist.device)
    if found is None and sft is not None:
        return sft.resume(run, None)
    if found is None:
        raise RunError(
            f"--resume: no usable checkpoint in {run.checkpoint_dir}; run without --resume to start afresh"
        )
    run.restore(found)
    if sft is not None:  # a GRPO step was checkpointed: the SFT stage is over
        sft.done = True
        sft.reload_reference(run)
    if run.dist.is_main:
        print(f"grpo-run: resuming from {found.folder} (step {run.step})", file=sys.stderr)
        print("".join(f"grpo-run: --resume: {note}\n" for note in ckpt.overridden_on_resume(found.state, run.spec)),
              end="", file=sys.stderr)
    return found.state.get("run_id")


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


def _finish(run: Run, stop: StopSignal) -> tuple[str, int]:
    """The final evaluation, checkpoint, save and exports (the feed stopped); the tracker
    status and exit code. Called under the signal handler: a signal here lets them finish (a
    second one stops at once), then the run exits with the signal's code."""
    spec = run.spec
    unranked = None
    if spec.eval.at_end and run.has_eval:
        run.last_eval = evaluate_run(run)
        run.log.log_metrics(run.last_eval, run.step)
        run.hooks.on_eval(run.step, run.last_eval)
        try:
            run.after_eval()
        except MissingMetric as exc:  # checkpointed; the final model is written before the run fails
            unranked = exc
    if spec.checkpoint.every or spec.checkpoint.every_minutes:
        run.save_checkpoint()
    final = _save_final(run)
    if unranked is not None:
        raise unranked.keeping(f"the final model {final}")
    exported = finish_exports(run, final)
    if run.dist.is_main:
        _summary(run, final, run.last_eval)
        print_exports(exported, run.log.metrics_path)
    return ("FINISHED", 0) if stop.signum is None else ("KILLED", stop.exit_code)


def _save_final(run: Run) -> Path:
    final = run.output_dir / "final"
    best = run.best_folder()
    if best is not None:  # checkpoint.final: best; training is over, so the live weights may go
        ckpt.load_model_weights(run.model, best, run.learner.strategy.load_model_state)
        if run.dist.is_main:
            value = run.best.entries[0][0]
            print(f"grpo-run: the final model is {best.name} ({run.spec.checkpoint.best_metric} = {value:.4g})",
                  file=sys.stderr)
    return run.save_model(final)


def _progress(run: Run, start: int):
    if not run.spec.train.progress or not run.dist.is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(
        total=run.spec.train.steps, initial=start, desc="grpo", unit="step", file=sys.stderr, dynamic_ncols=True
    )


def _postfix(metrics: dict[str, float], last_eval: dict[str, float]) -> dict[str, str]:
    shown = {"reward": metrics.get("reward"), "kl": metrics.get("kl"), "len": metrics.get("completions/mean_length")}
    evals = {k: v for k, v in last_eval.items() if k.startswith("eval/rewards/")}
    shown.update({k.replace("eval/rewards/", "eval_"): v for k, v in evals.items()})
    return {k: f"{v:.3g}" for k, v in shown.items() if v is not None and math.isfinite(v)}


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
