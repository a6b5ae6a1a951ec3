"""The SFT stage (spec section ``sft``): supervised steps on demonstrations before the GRPO
steps of the same run, then the hand-over.

:class:`SftStage` trains the run's policy (its model, LoRA adapter, parallel strategy, mixed
precision and packing) with an optimizer of its own (``sft.lr``, ``sft.schedule``) on
:mod:`~grpo_core.train.loop.demonstrations`, the update being
:func:`~grpo_core.train.learner.sft.sft_update`. It logs ``sft/...`` metrics (to the run's
trackers, and ``sft/metrics.jsonl``) and checkpoints under ``<run>/sft/checkpoints``
(weights, its optimizer and schedule, the RNG states, the position in the demonstrations).
After its last step it checkpoints once more, then hands over: the weights of the last (or
best by held-out loss) step, saved to ``<run>/sft/final``; the KL's reference copy reset to
them; the RNGs seeded with ``train.seed``, so the GRPO steps start from the same state
whether the run went through or was resumed from any SFT checkpoint. A GRPO checkpoint
records that the stage is done (the run's ``sft`` component); resuming from it reloads the
reference from ``<run>/sft/final``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_core import checkpoint as ckpt
from grpo_core.errors import RunError
from grpo_core.spec import Spec
from grpo_core.tracking import RunLog
from grpo_core.train.learner.optim import make_optimizer
from grpo_core.train.learner.sft import SftSettings, demo_batch, heldout_loss, sft_update
from grpo_core.train.loop.demonstrations import Demo, Demonstrations
from grpo_core.train.loop.evaluate import EvalSet, evaluate_sets
from grpo_core.train.seeds import seed_everything

#: The run (:class:`grpo_core.train.loop.state.Run`, which holds this stage: not imported here).
Run = Any


@dataclass
class SftStage:
    """The stage's data, state and files; see the module doc."""

    spec: Spec
    train: Demonstrations
    heldout: list[Demo]
    folder: Path  # <run>/sft
    step: int = 0
    done: bool = False  # handed over to GRPO
    best: tuple[float, int] | None = None  # (held-out loss, step) of the best evaluated step
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    trajectory: str = field(default_factory=ckpt.new_trajectory)
    saved_step: int | None = None
    saved_at: float = field(default_factory=time.monotonic)

    @property
    def section(self):
        return self.spec.sft

    @property
    def checkpoint_dir(self) -> Path:
        return self.folder / "checkpoints"

    @property
    def final_dir(self) -> Path:
        return self.folder / "final"

    # ----------------------------------------------------------------- GRPO checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a GRPO checkpoint records of the stage (it is done by then)."""
        return {"done": self.done, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = bool(state.get("done", True))
        self.step = int(state.get("step", self.section.steps))

    # ----------------------------------------------------------------- running
    def settings(self, run: Run) -> SftSettings:
        return SftSettings(self.section.micro_batch_size, self.spec.train.micro_batch_tokens,
                           run.learner.trains_packed, self.spec.train.max_grad_norm)

    def _optimizer(self, run: Run) -> None:
        if self.optimizer is not None:
            return
        s = self.section
        train = self.spec.train.model_copy(update={
            "lr": s.lr, "weight_decay": s.weight_decay, "warmup_steps": s.warmup_steps, "schedule": s.schedule})
        self.optimizer, self.scheduler = make_optimizer(run.model, train, s.steps)
        if self.spec.train.mixed_precision == "fp16":
            self.scaler = torch.amp.GradScaler(run.dist.device.type)

    def _mine(self, demos: list[Demo], run: Run) -> list[Demo]:
        """This process's share of a batch: every world-th demonstration from its rank."""
        return demos[run.dist.rank::run.dist.world]

    def _batch(self, demos: list[Demo], run: Run):
        pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else self.train.eos_id
        return demo_batch([d.prompt for d in demos], [d.completion for d in demos], [d.mask for d in demos], pad,
                          run.dist.device)

    def run(self, run: Run, stop, loaded) -> bool:
        """Train the remaining SFT steps, then hand over to GRPO; False when a signal (``stop``)
        ended it early (checkpointed)."""
        if self.done:
            return True
        self._optimizer(run)
        log = RunLog(run.log.trackers, self.folder, enabled=run.dist.is_main)
        s = self.section
        bar = _progress(run, self.step, s.steps)
        try:
            if self.step == 0 and s.eval_every:  # the starting point: the weights before any SFT step
                log.log_metrics(self.evaluate(run), 0)
            while self.step < s.steps:
                if run.dist.any(stop.signum is not None):
                    folder = self.save(run)
                    if run.dist.is_main:
                        print(f"grpo-run: stopped at SFT step {self.step}; checkpoint {folder}\n"
                              f"  resume with: {loaded.command('--resume')}", file=sys.stderr)
                    return False
                metrics = self._one_step(run)
                last = self.step == s.steps
                if (s.eval_every and self.step % s.eval_every == 0) or last:
                    metrics.update(self.evaluate(run))
                log.log_metrics(metrics, self.step)
                if bar is not None:
                    bar.set_postfix({"loss": f"{metrics['sft/loss']:.3g}"}, refresh=False)
                    bar.update(1)
                c = self.spec.checkpoint
                due = ckpt.due(self.step, c.every, c.every_minutes, self.saved_at)
                if last or (run.dist.any(due) if c.every_minutes else due):  # clocks differ between processes
                    self.save(run)
        finally:
            if bar is not None:
                bar.close()
        self.hand_over(run)
        return True

    def _one_step(self, run: Run) -> dict[str, float]:
        s = self.section
        if s.batch_size % run.dist.world:
            raise RunError(f"sft.batch_size ({s.batch_size}) must be a multiple of the process count "
                           f"({run.dist.world}): each process trains an equal share of every batch")
        demos = self._mine(self.train.next(s.batch_size), run)
        batch = self._batch(demos, run)
        metrics = sft_update(run.model, self.optimizer, self.scheduler, batch, self.settings(run),
                             run.learner.strategy, run.learner.autocast, self.scaler)
        self.step += 1
        metrics["sft/epoch"] = float(self.train.source.epoch)
        metrics["sft/truncated"] = float(self.train.truncated)
        return metrics

    def evaluate(self, run: Run) -> dict[str, float]:
        """The held-out loss (and with ``eval_rewards`` the GRPO evaluation) of the weights now;
        a new lowest loss checkpoints the step as the best."""
        out: dict[str, float] = {}
        if self.heldout:
            rows = self._mine(self.heldout, run)
            batch = self._batch(rows, run) if rows else _empty(self._batch(self.heldout[:1], run))
            nll, tokens = heldout_loss(run.model, batch, self.settings(run), run.learner.strategy,
                                       run.learner.autocast)
            loss = nll / max(tokens, 1.0)
            out["sft/eval_loss"] = loss
            if self.best is None or loss < self.best[0]:
                self.best = (loss, self.step)
                if self.section.start_from == "best":
                    self.save(run)
        if self.section.eval_rewards and run.has_eval:
            run.actor.receive(run.model, 0)
            sets = [EvalSet("eval/", run.eval_prompts, self.spec.data.prompt_column), *run.eval_sets.values()]
            with run.actor.weights():
                out.update({f"sft/{k}": v for k, v in evaluate_sets(self.spec, run.actor, sets).items()})
        return out

    def hand_over(self, run: Run) -> None:
        """The GRPO steps start here: best or last weights, the reference reset, RNGs seeded."""
        if self.section.start_from == "best":
            if self.best is None:
                raise RunError("sft.start_from: best ranks the SFT steps by held-out loss, but the demonstrations "
                               "have no eval split rows: add some (e.g. the dataset's eval_size) or use last")
            folder = ckpt.step_folder(self.checkpoint_dir, self.best[1])
            ckpt.load_model_weights(run.model, folder, run.learner.strategy.load_model_state)
            if run.dist.is_main:
                print(f"grpo-run: GRPO starts from SFT step {self.best[1]} (held-out loss {self.best[0]:.4g})",
                      file=sys.stderr)
        run.save_model(self.final_dir)
        reference = run.learner.kl.reference if run.learner.kl is not None else None
        if reference is not None:
            reference.reset_to(run.model)
        self.optimizer = self.scheduler = self.scaler = None  # its memory is GRPO's now
        self.done = True
        run.actor.receive(run.model, 0)
        seed_everything(self.spec.train.seed)

    def reload_reference(self, run: Run) -> None:
        """On resuming GRPO: the KL's reference copy is the SFT result (``<run>/sft/final``)."""
        reference = run.learner.kl.reference if run.learner.kl is not None else None
        if reference is None or reference.model is None:
            return
        from safetensors.torch import load_file

        files = sorted(self.final_dir.glob("*.safetensors"))
        if not files:
            raise RunError(f"--resume: the KL reference is the SFT stage's result, but {self.final_dir} holds no "
                           "weights; start afresh with --overwrite")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        run.learner.strategy.load_model_state(reference.model, state)

    # ----------------------------------------------------------------- SFT checkpoints
    def save(self, run: Run) -> Path:
        folder = ckpt.step_folder(self.checkpoint_dir, self.step)
        if self.saved_step == self.step and folder.is_dir():
            return folder
        strategy = run.learner.strategy
        weights = strategy.model_state(run.model)
        state = None
        if strategy.sharded or run.dist.is_main:
            optimizer, fmt = strategy.optimizer_state(run.model, self.optimizer)
            state = {
                "sft_step": self.step, "trajectory": self.trajectory, "run_id": run.log.run_id,
                "optimizer": optimizer, "optimizer_format": fmt, "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "rng": ckpt.rng_state(), "data": self.train.state_dict(),
                "best": list(self.best) if self.best is not None else None,
            }
        if run.dist.is_main:
            protect = {self.best[1]} if self.best is not None and self.section.start_from == "best" else set()
            folder = ckpt.write_checkpoint(self.checkpoint_dir, self.step, run.model, state,
                                           self.spec.checkpoint.keep, self.trajectory, weights=weights,
                                           protect=protect)
        run.dist.barrier()
        self.saved_step = self.step
        self.saved_at = time.monotonic()
        return folder

    def resume(self, run: Run, explicit: str | None) -> str | None:
        """Continue from the newest SFT checkpoint (or ``explicit``); its tracker run id, or
        RunError when there is none."""
        found = ckpt.find_resumable(self.checkpoint_dir, explicit, map_location=run.dist.device)
        if found is None:
            raise RunError(f"--resume: no usable checkpoint in {run.checkpoint_dir} nor in {self.checkpoint_dir}; "
                           "run without --resume to start afresh")
        state = found.state
        ckpt.load_model_weights(run.model, found.folder, run.learner.strategy.load_model_state)
        self._optimizer(run)
        run.learner.strategy.load_optimizer_state(run.model, self.optimizer, state["optimizer"],
                                                  state.get("optimizer_format", "native"))
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["sft_step"])
        self.train.load_state_dict(state["data"])
        self.best = tuple(state["best"]) if state.get("best") else None
        ckpt.set_rng_state(state["rng"])
        self.trajectory = ckpt.trajectory_after_resume(self.checkpoint_dir, found)
        self.saved_step = self.step
        RunLog({}, self.folder, enabled=run.dist.is_main).rewind(self.step)
        if run.dist.is_main:
            print(f"grpo-run: resuming the SFT stage from {found.folder} (SFT step {self.step})", file=sys.stderr)
        return state.get("run_id")


def _empty(batch):
    """``batch`` with nothing trained: a process without held-out rows still joins the forwards."""
    batch.mask = torch.zeros_like(batch.mask)
    return batch


def _progress(run: Run, start: int, total: int):
    if not run.spec.train.progress or not run.dist.is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="sft", unit="step", file=sys.stderr, dynamic_ncols=True)


def build_sft(spec: Spec, tokenizer, output_dir: Path, rows: tuple[list[dict], list[dict]] | None,
              eos_id: int) -> SftStage | None:
    """The stage of ``spec.sft`` (None without one) on its ``(train, eval)`` rows."""
    if spec.sft is None or rows is None:
        return None
    train_rows, eval_rows = rows
    s = spec.sft
    train = Demonstrations(train_rows, tokenizer, s, seed=spec.train.seed, eos_id=eos_id)
    heldout: list[Demo] = []
    if eval_rows:
        heldout = Demonstrations(eval_rows, tokenizer, s, seed=0, eos_id=eos_id, split="held-out",
                                 shuffle=False).all()[: s.eval_max_rows]
    return SftStage(spec, train, heldout, output_dir / "sft")
