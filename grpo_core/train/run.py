"""Assembling a run from a validated spec, and the step loop."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.contracts import Stateful, special_ids
from grpo_core.errors import RunError
from grpo_core.export import finish_exports, print_exports
from grpo_core.spec import LoadedSpec, Spec, dump_spec
from grpo_core.spec.parallel import parallel_conflicts
from grpo_core.tracking import RunLog, flatten
from grpo_core.train import model as modeling
from grpo_core.train import sharding
from grpo_core.train.actor import Actor, RolloutSettings
from grpo_core.train.data import PromptSource, check_columns
from grpo_core.train.distributed import Dist, check_layout, close_process_group, parallel_from_launcher
from grpo_core.train.episodes import EpisodeRunner
from grpo_core.train.evaluate import EvalSet, evaluate_sets, load_eval_sets
from grpo_core.train.iterative import build_iterative
from grpo_core.train.kl import KLTerm
from grpo_core.train.learner import Learner, UpdateSettings
from grpo_core.train.optim import make_optimizer
from grpo_core.train.parallel import strategy_for
from grpo_core.train.pipeline import Pipeline, frozen_copy
from grpo_core.train.reasoning_steps import split_steps
from grpo_core.train.rollout import Scorer
from grpo_core.train.scoring import RewardFn
from grpo_core.train.signals import StopSignal
from grpo_core.train.step import grpo_step, pipelined_step
from grpo_core.train.update import Objective

log = logging.getLogger("grpo.run")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Run:
    """A run: the actor and learner a step uses, the held-out data, and the loop's own state."""

    spec: Spec
    loaded: LoadedSpec
    output_dir: Path
    actor: Actor
    learner: Learner
    eval_prompts: list
    log: RunLog
    iterative: Any = None  # the iteration stage of iterative GRPO, or None
    step: int = 0
    nonfinite_streak: int = 0
    last_eval: dict[str, float] = field(default_factory=dict)
    saved_step: int | None = None  # the step of the last checkpoint this process wrote
    eval_sets: dict[str, Any] = field(default_factory=dict)  # the named sets of eval.sets
    saved_at: float = field(default_factory=time.monotonic)  # when it was written (or the run began)
    trajectory: str = field(default_factory=ckpt.new_trajectory)  # this line of steps' id
    pipeline: Pipeline | None = None  # the actor's thread under rollout.max_staleness > 0, else None

    @contextlib.contextmanager
    def actor_at_rest(self):
        """The actor idle with the learner's current weights inside: an asynchronous run's
        pipeline restarts around it (:meth:`Pipeline.pause`); a synchronous run's actor is
        always so."""
        if self.pipeline is None or not self.pipeline.running:
            yield
            return
        self.pipeline.pause(self.model, self.learner.version)
        try:
            yield
        finally:
            self.pipeline.resume()

    def stop_pipeline(self) -> None:
        """Stop the actor's thread (the batches it generated ahead are dropped), if any."""
        if self.pipeline is not None and self.pipeline.running:
            self.pipeline.pause(self.model, self.learner.version)

    @property
    def has_eval(self) -> bool:
        """Some held-out set has prompts: the default one or a named one."""
        return bool(self.eval_prompts) or any(s.prompts for s in self.eval_sets.values())

    @property
    def model(self):
        return self.learner.model

    @property
    def tokenizer(self):
        return self.learner.tokenizer

    @property
    def prompts(self) -> PromptSource:
        """The training prompts (the actor draws them)."""
        return self.actor.source

    @property
    def dist(self) -> Dist:
        return self.learner.dist

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def stateful(self) -> dict[str, Any]:
        """Components that carry state across steps (:class:`~grpo_core.contracts.Stateful`)."""
        named = {"rollout": self.actor.backend, "advantage": self.learner.estimator}
        named.update({f"rewards.{fn.name}": fn.fn for fn in self.actor.scorer.rewards})
        named.update({f"tracking.{name}": tracker for name, tracker in self.log.trackers.items()})
        named["kl"] = self.learner.kl
        named["iterative"] = self.iterative
        return {k: v for k, v in named.items() if isinstance(v, Stateful)}

    def state_dict(self) -> dict[str, Any]:
        learner = self.learner
        optimizer, optimizer_format = learner.strategy.optimizer_state(learner.model, learner.optimizer)
        return {
            "step": self.step,
            "trajectory": self.trajectory,
            "run_id": self.log.run_id,
            "optimizer": optimizer,
            "optimizer_format": optimizer_format,
            "scheduler": learner.scheduler.state_dict(),
            "rng": ckpt.rng_state(),
            "data": self.prompts.state_dict(),
            "nonfinite_streak": self.nonfinite_streak,
            "last_eval": dict(self.last_eval),
            "components": {k: v.state_dict() for k, v in self.stateful().items()},
            "scaler": learner.scaler.state_dict() if learner.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        learner = self.learner
        self.step = learner.version = int(state["step"])
        sharding.restore_optimizer(self.model, learner.optimizer, state, learner.strategy.sharded)
        learner.scheduler.load_state_dict(state["scheduler"])
        self.prompts.load_state_dict(state["data"])
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        self.last_eval = dict(state.get("last_eval", {}))
        for key, component in self.stateful().items():
            if key in state.get("components", {}):
                component.load_state_dict(state["components"][key])
        if learner.scaler is not None and state.get("scaler"):
            learner.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])

    def save_checkpoint(self) -> Path:
        """Checkpoint the current step; a step this process already saved is not written twice.
        With several processes the main one writes and the others wait for it."""
        folder = self.checkpoint_dir / f"{ckpt.PREFIX}{self.step:06d}"
        if self.saved_step != self.step or not folder.is_dir():
            with self.actor_at_rest():  # the prompt position of the next batch to train, not the actor's
                return self._write_checkpoint(folder)
        return folder

    def _write_checkpoint(self, folder: Path) -> Path:
        # A sharded model's weights and optimizer state are gathered by every process.
        sharded = self.learner.strategy.sharded
        weights = self.learner.strategy.model_state(self.model)
        state = self.state_dict() if sharded or self.dist.is_main else None
        if self.dist.is_main:
            folder = ckpt.write_checkpoint(
                self.checkpoint_dir, self.step, self.model, state, self.spec.checkpoint.keep,
                self.trajectory, weights=weights,
            )
        self.dist.barrier()
        self.saved_step = self.step
        self.saved_at = time.monotonic()
        return folder


def build_rewards(spec: Spec, splitter: Any) -> list[RewardFn]:
    """The spec's reward functions, labelled ``name`` (``name#i`` when a name is listed twice)."""
    names = [slot.name for slot in spec.rewards]
    cut = partial(split_steps, splitter, spec.algorithm.step_splitter.name)
    out = []
    for slot in spec.rewards:
        label = slot.name if names.count(slot.name) == 1 else f"{slot.name}#{len(out)}"
        out.append(RewardFn.of(label, slot.weight, slot.build(), splitter=cut,
                               concurrency=slot.concurrency, timeout=slot.call_timeout))
    return out


def _load_rows(spec: Spec):
    dataset = spec.data.build()
    try:
        train_rows = dataset.load("train")
        eval_rows = dataset.load("eval")
    except RunError:
        raise
    except Exception as exc:
        raise RunError(f"data: dataset '{spec.data.name}' failed to load: {type(exc).__name__}: {exc}") from exc
    return train_rows, eval_rows


def _check_data(spec: Spec, rewards: list[RewardFn], train_rows, eval_rows) -> None:
    needed = {spec.data.prompt_column: "data.prompt_column"}
    for fn in rewards:
        for column in fn.required_columns:
            needed.setdefault(column, f"reward function '{fn.name}'")
    check_columns(train_rows, needed, "training")
    check_columns(eval_rows, needed, "held-out")


def build_episodes(spec: Spec, model, tokenizer, scorer: Scorer) -> EpisodeRunner | None:
    """The multi-turn runner of ``rollout.environment``, or None."""
    slot = spec.rollout.environment
    if slot is None:
        return None
    if scorer.with_steps or any(fn.takes_steps for fn in scorer.rewards):
        raise RunError("rollout.environment: process supervision (step scores) is not supported on "
                       "multi-turn episodes; use outcome rewards")
    eos_ids, pad_id = special_ids(model, tokenizer, "environment")
    return EpisodeRunner(slot.build(), tokenizer, max_turns=slot.max_turns,
                         max_total_tokens=slot.max_total_tokens, eos_ids=eos_ids, pad_id=pad_id)


def _actor_and_learner(spec: Spec, model, tokenizer, rewards: list[RewardFn], splitter, strategy
                       ) -> tuple[Actor, Learner, Pipeline | None]:
    """The learner of ``model``, the actor (with no prompt source yet) of the spec, and the
    pipeline between them when rollouts are asynchronous (``rollout.max_staleness``)."""
    algo, dist = spec.algorithm, strategy.dist
    env = spec.rollout.environment
    backend = spec.rollout.build()
    # Asynchronous rollouts: whole copies of the policy, made before the strategy shards it: the
    # snapshot the learner's weights cross in, and for a backend that generates with the policy
    # module, the weights the actor samples from while the learner's move.
    snapshot = frozen_copy(model) if spec.rollout.max_staleness else None
    sampler = frozen_copy(model) if snapshot is not None and backend.generates_with_policy else None
    kl = KLTerm.from_spec(algo.kl, model)
    # before the optimizer, which must hold the parameters the strategy trains (shards under fsdp2)
    strategy.setup(model, getattr(kl and kl.reference, "model", None))
    objective = Objective(
        policy_loss=algo.policy_loss.build(), aggregator=algo.aggregation.build(),
        kl=kl if kl is not None and kl.in_loss else None,
        entropy_coef=algo.entropy_coef, early_stop_imp_ratio=algo.early_stop_imp_ratio,
        temperature=spec.rollout.temperature,
        max_length=spec.rollout.max_new_tokens if env is None else env.max_total_tokens,
        correction=algo.rollout_correction,
    )
    optimizer, scheduler = make_optimizer(model, spec.train, spec.train.steps * algo.mu * spec.train.mini_batches)
    backend.setup(model if sampler is None else sampler, tokenizer)
    estimator = algo.advantage.build()
    scorer = Scorer(
        rewards, spec.data.prompt_column, spec.train.reward_errors,
        split=partial(split_steps, splitter, algo.step_splitter.name),
        with_steps=estimator.needs_step_scores,
    )
    autocast = partial(modeling.autocast, spec.train.mixed_precision, dist.device)
    learner = Learner(
        model=model, optimizer=optimizer, scheduler=scheduler, objective=objective,
        settings=UpdateSettings.from_spec(spec), estimator=estimator, kl=kl, tokenizer=tokenizer,
        strategy=strategy, autocast=autocast,
        scaler=torch.amp.GradScaler(dist.device.type) if spec.train.mixed_precision == "fp16" else None,
    )
    actor = Actor(
        backend=backend, scorer=scorer, settings=RolloutSettings.from_spec(spec), dist=dist, autocast=autocast,
        episodes=build_episodes(spec, model, tokenizer, scorer),
        weights=partial(strategy.rollout_weights, backend) if sampler is None else contextlib.nullcontext,
        greedy_baseline=estimator.needs_greedy_baseline,
    )
    pipeline = None
    if snapshot is not None:
        pipeline = Pipeline(actor, spec.rollout.max_staleness, snapshot, sampler=sampler,
                            micro_batch_size=spec.train.micro_batch_size,
                            micro_batch_tokens=spec.train.micro_batch_tokens, temperature=spec.rollout.temperature)
    return actor, learner, pipeline


def build_run(loaded: LoadedSpec, dist: Dist | None = None) -> Run:
    spec = loaded.spec
    dist = dist or Dist.from_env(spec.train.device)
    check_layout(spec, dist.world)
    parallel = parallel_from_launcher(spec.train.parallel)
    if parallel_conflicts(spec, parallel):
        raise RunError("accelerate's FSDP config selects fsdp2, but " + "; ".join(parallel_conflicts(spec, parallel)))
    seed_everything(spec.train.seed)
    if spec.train.threads:
        torch.set_num_threads(spec.train.threads)
    output_dir = ckpt.run_folder(loaded)
    output_dir.mkdir(parents=True, exist_ok=True)

    splitter = spec.algorithm.step_splitter.build()
    rewards = build_rewards(spec, splitter)
    train_rows, eval_rows = _load_rows(spec)
    _check_data(spec, rewards, train_rows, eval_rows)

    tokenizer = modeling.load_tokenizer(spec.model, loaded.base_dir)
    model = modeling.load_policy(spec.model, loaded.base_dir, tokenizer).to(dist.device)
    actor, learner, pipeline = _actor_and_learner(spec, model, tokenizer, rewards, splitter,
                                                  strategy_for(dist, parallel))
    env = spec.rollout.environment
    context = getattr(model.config, "max_position_embeddings", None) or 10**9
    longest = spec.rollout.max_new_tokens if env is None else env.max_total_tokens
    max_prompt = spec.data.max_prompt_tokens or max(1, context - longest)
    tools = actor.episodes.tools if actor.episodes is not None else None
    actor.source = PromptSource(train_rows, tokenizer, spec.data, seed=spec.train.seed, max_tokens=max_prompt,
                                tools=tools)
    eval_source = PromptSource(eval_rows or [{}], tokenizer, spec.data, seed=0, max_tokens=max_prompt, shuffle=False,
                               tools=tools)
    eval_prompts = [p for p in map(eval_source.render, eval_rows) if p is not None][: spec.eval.max_prompts]
    required = {c: f"reward function '{fn.name}'" for fn in rewards for c in fn.required_columns}
    eval_sets = load_eval_sets(spec, tokenizer, max_prompt, required, tools)

    reference = learner.kl.reference if learner.kl is not None else None
    trackers = {slot.name: slot.build() for slot in spec.tracking}
    return Run(
        spec=spec, loaded=loaded, output_dir=output_dir, actor=actor, learner=learner,
        eval_prompts=eval_prompts, log=RunLog(trackers, output_dir, enabled=dist.is_main),
        iterative=build_iterative(spec, rewards, reference),
        eval_sets=eval_sets, pipeline=pipeline,
    )


def evaluate_run(run: Run) -> dict[str, float]:
    """The held-out sets' metrics: the default set, then every named one (see
    :func:`evaluate_sets`)."""
    sets = [EvalSet("eval/", run.eval_prompts, run.spec.data.prompt_column), *run.eval_sets.values()]
    with run.actor_at_rest(), run.actor.weights():
        return evaluate_sets(run.spec, run.actor, sets)


def _save_final(run: Run) -> Path:
    final = run.output_dir / "final"
    weights = run.learner.strategy.model_state(run.model)
    if run.dist.is_main:
        run.model.save_pretrained(final, state_dict=weights)
        run.tokenizer.save_pretrained(final)
    run.dist.barrier()
    return final


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


def _resume(run: Run, resume: str | None) -> str | None:
    """Restore the run from a checkpoint; return the tracker run id to continue."""
    if resume is None:
        return None
    found = ckpt.find_resumable(run.checkpoint_dir, resume, map_location=run.dist.device)
    if found is None:
        raise RunError(
            f"--resume: no usable checkpoint in {run.checkpoint_dir}; run without --resume to start afresh"
        )
    ckpt.load_model_weights(run.model, found.folder)
    run.load_state_dict(found.state)
    run.trajectory = ckpt.trajectory_after_resume(run.checkpoint_dir, found)
    run.log.rewind(run.step)
    run.actor.receive(run.model, run.learner.version)
    if run.dist.is_main:
        print(f"grpo-run: resuming from {found.folder} (step {run.step})", file=sys.stderr)
        print("".join(f"grpo-run: --resume: {note}\n" for note in ckpt.overridden_on_resume(found.state, run.spec)),
              end="", file=sys.stderr)
    return found.state.get("run_id")


def _step_and_record(run: Run) -> dict[str, float]:
    """One training step plus the loop's bookkeeping: the iteration start of iterative
    GRPO, held-out evaluation, logging, checkpoints, the non-finite stop."""
    spec = run.spec
    due = run.iterative is not None and run.iterative.due(run.step)
    if due:
        with run.actor_at_rest():
            begun = run.iterative.begin(run.actor, run.model)
    else:
        begun = {}
    if run.pipeline is not None:
        result = pipelined_step(run.pipeline, run.learner, run.step)
    else:
        result = grpo_step(run.actor, run.learner, run.step)
    metrics = run.dist.combine_metrics(result.metrics)
    if run.learner.kl is not None:  # adaptive beta and reference sync see the global step
        rows = spec.train.prompts_per_step * spec.rollout.group_size
        metrics.update(run.learner.kl.after_step(run.step + 1, run.model, metrics.get("kl"), rows))
    metrics.update(begun)
    run.step += 1
    run.nonfinite_streak = run.nonfinite_streak + 1 if metrics["train/nonfinite_updates"] else 0
    metrics["train/nonfinite_streak"] = run.nonfinite_streak
    metrics["data/skipped_prompts"] = float(sum(run.prompts.skipped.values()))
    if spec.eval.every and run.step % spec.eval.every == 0 and run.step < spec.train.steps:
        run.last_eval = evaluate_run(run)
        metrics.update(run.last_eval)
    run.log.log_metrics(metrics, run.step)
    every = spec.train.log_completions_every
    if every and run.step % every == 0:
        run.log.log_table("completions", result.samples, run.step)
    c = spec.checkpoint
    due = ckpt.due(run.step, c.every, c.every_minutes, run.saved_at)
    if run.dist.any(due) if c.every_minutes else due:  # clocks differ between processes
        run.save_checkpoint()
    if run.nonfinite_streak >= spec.train.max_nonfinite_updates:
        folder = run.save_checkpoint()
        raise RunError(
            f"{run.nonfinite_streak} steps in a row had a non-finite loss or gradient "
            f"(train.max_nonfinite_updates = {spec.train.max_nonfinite_updates}); stopped with the "
            f"last good weights in {folder}. Lower train.lr or check the rewards."
        )
    return metrics


@dataclass
class _StepStart:
    """What a step changes before its update: the data position and the RNG states."""

    step: int
    updates: int
    data: dict[str, Any] | None
    rng: dict[str, Any]

    @classmethod
    def of(cls, run: Run) -> _StepStart:
        # an asynchronous run's actor moves the prompt position on its own (a pause rewinds it)
        data = None if run.pipeline is not None else run.prompts.state_dict()
        return cls(run.step, run.learner.scheduler.last_epoch, data, ckpt.rng_state())


def _save_failed_step(run: Run, start: _StepStart, loaded: LoadedSpec, exc: BaseException) -> None:
    """A step that failed before its update (a reward function raised, no usable prompt, out
    of memory, a full disk, a bug) left the model and optimizer as the previous step did:
    rewind its data position and RNG states and checkpoint that state, so that no completed
    step is lost. With several processes only a failure every process shares (a RunError
    they agree on) is checkpointed: the others may be waiting in a collective."""
    if run.step != start.step or run.learner.scheduler.last_epoch != start.updates or run.step == 0:
        return
    if run.dist.active and not isinstance(exc, RunError):
        return
    if run.pipeline is not None:
        run.stop_pipeline()  # rewinds the prompts to this step's batch
    else:
        run.prompts.load_state_dict(start.data)
    ckpt.set_rng_state(start.rng)
    try:
        folder = run.save_checkpoint()
    except Exception as exc:  # keep the original error; the previous checkpoint stays
        log.warning("could not checkpoint step %d after the failure: %s", run.step, exc)
        return
    if not run.dist.is_main:
        return
    print(
        f"grpo-run: step {run.step + 1} failed before its update; checkpoint of step {run.step}: {folder}\n"
        f"  resume with: {loaded.command('--resume')}", file=sys.stderr,
    )


def train(loaded: LoadedSpec, resume: str | None = None) -> int:
    """Train as the spec says; return the process exit code."""
    run = build_run(loaded)
    spec = run.spec
    _start_logging(run, loaded, _resume(run, resume))
    status = "FAILED"
    bar = _progress(run, run.step)
    try:
        with StopSignal() as stop:
            if spec.eval.at_start and run.has_eval and run.step == 0:
                run.last_eval = evaluate_run(run)
                run.log.log_metrics(run.last_eval, run.step)
            if run.pipeline is not None:
                run.pipeline.start(run.model, run.learner.version)
            # With several processes, a signal seen by any stops all of them at the same step.
            while run.step < spec.train.steps and not run.dist.any(stop.signum is not None):
                start = _StepStart.of(run)
                try:
                    metrics = _step_and_record(run)
                except (Exception, SystemExit) as exc:  # SystemExit: sys.exit() in plugin code
                    _save_failed_step(run, start, loaded, exc)
                    raise
                if bar is not None:
                    bar.set_postfix(_postfix(metrics, run.last_eval), refresh=False)
                    bar.update(1)
            run.stop_pipeline()
            if run.dist.any(stop.signum is not None):
                status = "KILLED"
                folder = run.save_checkpoint()
                if run.dist.is_main:
                    print(
                        f"grpo-run: stopped at step {run.step}; checkpoint {folder}\n"
                        f"  resume with: {loaded.command('--resume')}", file=sys.stderr,
                    )
                code = stop.exit_code
            else:
                status, code = _finish(run, stop)
        close_process_group()  # every process got here: the run ended, not failed
        return code
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if run.pipeline is not None:
            # after a failure or a second signal, no waiting for the actor's batch (nor for another
            # process's actor that will never join its collective)
            run.pipeline.close(wait=status == "FINISHED")
        if bar is not None:
            bar.close()
        run.log.finish(status)


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
    """The final evaluation, checkpoint, save and exports; the tracker status and exit code.
    Called under the signal handler: a signal here lets them finish (a second one stops at
    once), then the run exits with the signal's code."""
    spec = run.spec
    if spec.eval.at_end and run.has_eval:
        run.last_eval = evaluate_run(run)
        run.log.log_metrics(run.last_eval, run.step)
    if spec.checkpoint.every or spec.checkpoint.every_minutes:
        run.save_checkpoint()
    final = _save_final(run)
    exported = finish_exports(run, final)
    if run.dist.is_main:
        _summary(run, final, run.last_eval)
        print_exports(exported, run.log.metrics_path)
    return ("FINISHED", 0) if stop.signum is None else ("KILLED", stop.exit_code)


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
