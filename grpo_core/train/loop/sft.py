"""The SFT stage (spec section ``sft``): supervised steps on demonstrations before the GRPO
steps of the same run, then the hand-over. A :class:`~grpo_core.train.loop.state.Stage`: the
loop of :mod:`grpo_core.train.loop.run` drives it, checkpoints it and resumes it as it does
the GRPO stage.

:class:`SftStage` trains the run's policy (its model, LoRA adapter, parallel strategy, mixed
precision and packing) with an optimizer of its own (``sft.lr``, ``sft.schedule``) on
:mod:`~grpo_core.train.loop.demonstrations`, the update being
:func:`~grpo_core.train.learner.sft.sft_update`. It logs ``sft/...`` metrics (to the run's
trackers, and ``sft/metrics.jsonl``) and checkpoints under ``<run>/sft/checkpoints``
(weights, its optimizer and schedule, the RNG states, the position in the demonstrations).
After its last step it checkpoints once more, then hands over: the weights of the last (or
best by held-out loss, ranked by the loop) step, saved to ``<run>/sft/final``; the KL's
reference copy reset to them; the RNGs seeded with ``train.seed``, so the GRPO steps start
from the same state whether the run went through or was resumed from any SFT checkpoint.
Resuming from a GRPO checkpoint reloads the reference from ``<run>/sft/final``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_core import checkpoint as ckpt
from grpo_core.errors import RunError
from grpo_core.spec import Spec
from grpo_core.train.learner.optim import Optimization, make_optimizer
from grpo_core.train.learner.sft import SftSettings, demo_batch, heldout_loss, sft_update
from grpo_core.train.loop.best import BestCheckpoints
from grpo_core.train.loop.checkpoints import load_weights
from grpo_core.train.loop.demonstrations import Demo, Demonstrations
from grpo_core.train.loop.evaluate import EvalSet, evaluate_sets
from grpo_core.train.loop.state import BaseStage, Cadence, Run, StepRecord
from grpo_core.train.seeds import seed_everything


@dataclass
class SftStage(BaseStage):
    """The stage's data, state and files; see the module doc."""

    spec: Spec
    train: Demonstrations
    heldout: list[Demo]
    folder: Path  # <run>/sft
    step: int = 0
    opt: Optimization | None = None  # made on first use, dropped at the hand-over
    best: BestCheckpoints | None = None  # the best step by held-out loss, under start_from: best
    cadence: Cadence = field(init=False)
    _begun: dict[str, Any] | None = field(default=None, repr=False)  # the data position before the step under way

    name = "sft"
    label = "SFT"

    def __post_init__(self) -> None:
        s = self.section
        self.cadence = Cadence.of_checkpoint(self.spec.checkpoint, eval_every=s.eval_every,
                                             eval_at_start=bool(s.eval_every), eval_with_last=True)
        if s.start_from == "best" and self.heldout:
            self.best = BestCheckpoints("sft/eval_loss", "min", 1)

    @property
    def section(self):
        return self.spec.sft

    @property
    def steps(self) -> int:
        return self.section.steps

    @property
    def final_dir(self) -> Path:
        return self.folder / "final"

    def settings(self, run: Run) -> SftSettings:
        return SftSettings(self.section.micro_batch_size, self.spec.train.micro_batch_tokens,
                           run.learner.trains_packed, self.spec.train.max_grad_norm)

    def optimization(self, run: Run) -> Optimization:
        if self.opt is None:
            s = self.section
            train = self.spec.train.model_copy(update={
                "lr": s.lr, "weight_decay": s.weight_decay, "warmup_steps": s.warmup_steps, "schedule": s.schedule})
            optimizer, scheduler = make_optimizer(run.model, train, s.steps)
            scaler = torch.amp.GradScaler(run.dist.device.type) if self.spec.train.mixed_precision == "fp16" else None
            self.opt = Optimization(optimizer, scheduler, scaler)
        return self.opt

    def prepare(self, run: Run) -> None:
        self.optimization(run)

    def _mine(self, demos: list[Demo], run: Run) -> list[Demo]:
        """This process's share of a batch: every world-th demonstration from its rank."""
        return demos[run.dist.rank::run.dist.world]

    def _batch(self, demos: list[Demo], run: Run):
        pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else self.train.eos_id
        return demo_batch([d.prompt for d in demos], [d.completion for d in demos], [d.mask for d in demos], pad,
                          run.dist.device)

    def train_step(self, run: Run) -> StepRecord:
        s = self.section
        if s.batch_size % run.dist.world:
            raise RunError(f"sft.batch_size ({s.batch_size}) must be a multiple of the process count "
                           f"({run.dist.world}): each process trains an equal share of every batch")
        self._begun = self.train.state_dict()
        demos = self._mine(self.train.next(s.batch_size), run)
        batch = self._batch(demos, run)
        opt = self.optimization(run)
        metrics = sft_update(run.model, opt.optimizer, opt.scheduler, batch, self.settings(run),
                             run.learner.strategy, run.learner.autocast, opt.scaler)
        self.step += 1
        self._begun = None
        metrics["sft/epoch"] = float(self.train.source.epoch)
        metrics["sft/truncated"] = float(self.train.truncated)
        return StepRecord(metrics)

    def rest(self, run: Run) -> None:
        """A step that failed before its update gives its demonstrations back."""
        if self._begun is not None:
            self.train.load_state_dict(self._begun)
            self._begun = None

    def evaluate(self, run: Run) -> dict[str, float]:
        """The held-out loss (and with ``eval_rewards`` the GRPO evaluation) of the weights now."""
        out: dict[str, float] = {}
        if self.heldout:
            rows = self._mine(self.heldout, run)
            batch = self._batch(rows, run) if rows else _empty(self._batch(self.heldout[:1], run))
            nll, tokens = heldout_loss(run.model, batch, self.settings(run), run.learner.strategy,
                                       run.learner.autocast)
            out["sft/eval_loss"] = nll / max(tokens, 1.0)
        if self.section.eval_rewards and run.has_eval:
            run.actor.receive(run.model, 0)
            sets = [EvalSet("eval/", run.eval_prompts, self.spec.data.prompt_column), *run.eval_sets.values()]
            with run.actor.weights():
                out.update({f"sft/{k}": v for k, v in evaluate_sets(self.spec, run.actor, sets).items()})
        return out

    def hand_over(self, run: Run) -> None:
        """The GRPO steps start here: best or last weights, the reference reset, RNGs seeded."""
        if self.section.start_from == "best":
            if self.best is None or self.best.best_step is None:
                raise RunError("sft.start_from: best ranks the SFT steps by held-out loss, but the demonstrations "
                               "have no eval split rows: add some (e.g. the dataset's eval_size) or use last")
            step, loss = self.best.best_step, self.best.entries[0][0]
            folder = ckpt.step_folder(self.folder / "checkpoints", step)
            load_weights(run, folder)
            if run.dist.is_main:
                print(f"grpo-run: GRPO starts from SFT step {step} (held-out loss {loss:.4g})", file=sys.stderr)
        run.save_model(self.final_dir)
        reference = run.learner.kl.reference if run.learner.kl is not None else None
        if reference is not None:
            reference.reset_to(run.model)
        self.opt = None  # its memory is GRPO's now
        run.actor.receive(run.model, 0)
        seed_everything(self.spec.train.seed)

    def resumed_past(self, run: Run) -> None:
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

    def state_dict(self, run: Run) -> dict[str, Any]:
        return {"data": self.train.state_dict()}

    def load_state_dict(self, run: Run, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.train.load_state_dict(state["data"])

    def postfix(self, metrics: dict[str, float], last_eval: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{metrics['sft/loss']:.3g}"}


def _empty(batch):
    """``batch`` with nothing trained: a process without held-out rows still joins the forwards."""
    batch.mask = torch.zeros_like(batch.mask)
    return batch


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
