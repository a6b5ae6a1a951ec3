"""A stage of one's own, driven by the same loop as SFT and GRPO: a warm-up stage with a fixed
learning rate, written here in one class (its steps, evaluation and state; nothing of the
engine changed), trains before the GRPO steps, is evaluated, ranked, logged and checkpointed
by the loop, and a run stopped in it resumes to the same weights, bit for bit, as the run
that went straight through."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_core.errors import RunError
from grpo_core.spec import load_spec
from grpo_core.train.learner.learner import Learner
from grpo_core.train.learner.optim import Optimization
from grpo_core.train.learner.sft import SftSettings, demo_batch, heldout_loss, sft_update
from grpo_core.train.loop.assemble import build_run
from grpo_core.train.loop.best import BestCheckpoints
from grpo_core.train.loop.run import run_loop
from grpo_core.train.loop.state import BaseStage, Cadence, StepRecord

torch.set_num_threads(1)
SPECS = Path(__file__).resolve().parents[2] / "specs"


class WarmUp(BaseStage):
    """``steps`` steps of next-token cross-entropy on seeded random token strings, plain SGD at
    a fixed learning rate; its held-out loss ranks its best step. ``stop_after``: the step
    after which it stops the run (to test the resume)."""

    name, label = "warmup", "warm-up"

    def __init__(self, folder: Path, steps: int, stop_after: int | None = None):
        self.folder, self._steps, self.stop_after, self.step = folder, steps, stop_after, 0
        self.cadence = Cadence(eval_every=2, eval_with_last=True, checkpoint_every=1)
        self.best = BestCheckpoints("warmup/eval_loss", "min", 1)
        self.opt: Optimization | None = None
        self.drawn = 0  # its data position: batches drawn so far

    @property
    def steps(self) -> int:
        return self._steps

    def optimization(self, run) -> Optimization:
        if self.opt is None:
            params = [p for p in run.model.parameters() if p.requires_grad]
            optimizer = torch.optim.SGD(params, lr=0.05)
            self.opt = Optimization(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
        return self.opt

    def _batch(self, run, seed: int):
        g = torch.Generator().manual_seed(seed)
        vocab = run.model.config.vocab_size
        prompts = [torch.randint(3, vocab, (3,), generator=g).tolist() for _ in range(4)]
        completions = [torch.randint(3, vocab, (5,), generator=g).tolist() for _ in range(4)]
        return demo_batch(prompts, completions, [[True] * 5] * 4, 0, run.dist.device)

    def train_step(self, run) -> StepRecord:
        learner: Learner = run.learner
        opt = self.optimization(run)
        self.drawn += 1
        metrics = sft_update(run.model, opt.optimizer, opt.scheduler, self._batch(run, self.drawn), SftSettings(),
                             learner.strategy, learner.autocast)
        self.step += 1
        return StepRecord({f"warmup/{k.split('/')[1]}": v for k, v in metrics.items()})

    def evaluate(self, run) -> dict[str, float]:
        nll, tokens = heldout_loss(run.model, self._batch(run, 10**6), SftSettings(), run.learner.strategy)
        return {"warmup/eval_loss": nll / tokens}

    def halt(self, metrics: dict[str, float]) -> str | None:
        return "stopped on purpose; checkpoint {folder}" if self.step == self.stop_after else None

    def state_dict(self, run) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def load_state_dict(self, run, state: dict[str, Any]) -> None:
        self.step, self.drawn = int(state["step"]), int(state["drawn"])


def _build(folder: Path, tiny_model: Path, stop_after: int | None = None):
    loaded = load_spec(SPECS / "tiny.yaml", [f"model.path={tiny_model}", "tracking=[]", f"train.output_dir={folder}",
                                             "train.progress=false", "train.threads=1", "train.steps=2",
                                             "checkpoint.every=1", "checkpoint.keep=2"])
    run = build_run(loaded)
    run = dataclasses.replace(run, stages=[WarmUp(run.output_dir / "warmup", 3, stop_after), *run.stages])
    return run, loaded


def test_a_stage_of_ones_own_trains_and_resumes_through_the_same_loop(tmp_path, tiny_model_dir, kit, capfd):
    straight, loaded = _build(tmp_path / "straight", tiny_model_dir)
    outcome = run_loop(straight, loaded)
    assert outcome.status == "FINISHED" and straight.step == 2
    out = straight.output_dir
    rows = kit.read_metrics(out / "warmup" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and "warmup/eval_loss" in rows[1] and "warmup/loss" in rows[0]
    assert sorted(p.name for p in (out / "warmup" / "checkpoints").glob("step-*")) == ["step-000002", "step-000003"]
    best = min((r["warmup/eval_loss"], r["step"]) for r in rows if "warmup/eval_loss" in r)
    assert straight.stages[0].best.best_step == best[1]  # ranked by the loop, its checkpoint kept
    assert [r["step"] for r in kit.read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2]

    stopped, loaded = _build(tmp_path / "broken", tiny_model_dir, stop_after=2)
    with pytest.raises(RunError, match="stopped on purpose"):
        run_loop(stopped, loaded)
    broken = stopped.output_dir
    assert not (broken / "final").exists() and kit.last_step(broken / "metrics.jsonl") < 1
    capfd.readouterr()
    resumed, loaded = _build(tmp_path / "broken", tiny_model_dir)
    outcome = run_loop(resumed, loaded, "latest")
    assert "resuming the warm-up stage from" in capfd.readouterr().err
    assert outcome.status == "FINISHED" and resumed.stages[0].drawn == 3

    want, got = kit.load_weights(out / "final"), kit.load_weights(broken / "final")
    assert [k for k in want if not torch.equal(want[k], got[k])] == []

    def timeless(path):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and "per_second" not in k}
                for r in kit.read_metrics(path)]

    assert timeless(broken / "warmup" / "metrics.jsonl") == timeless(out / "warmup" / "metrics.jsonl")
    assert timeless(broken / "metrics.jsonl") == timeless(out / "metrics.jsonl")


SFT_THEN_GRPO = {
    "sft": {"data": {"name": "arithmetic", "train_size": 32, "eval_size": 0, "solutions": True},
            "completion_column": "solution", "steps": 4, "batch_size": 4, "lr": 1.0e-2, "eval_every": 0},
    "train": {"steps": 1}, "checkpoint": {"every": 0},
}


def test_an_sft_step_that_fails_before_its_update_is_checkpointed_and_resumes_exactly(
        tmp_path, write_spec, kit, monkeypatch, capfd):
    """The loop's failed-step checkpoint, for the SFT stage: its demonstrations drawn for the
    failed step are given back, so the resumed run ends bit for bit as the straight one."""
    from grpo_core.cli import main
    from grpo_core.train.loop import sft as sft_stage

    straight = write_spec(tmp_path / "straight", **SFT_THEN_GRPO)
    assert main([str(straight)]) == 0
    spec = write_spec(tmp_path / "broken", **SFT_THEN_GRPO)
    real, calls = sft_stage.sft_update, []

    def fails_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the third SFT update failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(sft_stage, "sft_update", fails_third)
    capfd.readouterr()
    assert main([str(spec)]) != 0
    err = capfd.readouterr().err
    assert "SFT step 3 failed before its update; checkpoint of SFT step 2" in err, err
    out = tmp_path / "broken" / "out"
    assert [p.name for p in (out / "sft" / "checkpoints").glob("step-*")] == ["step-000002"]
    monkeypatch.setattr(sft_stage, "sft_update", real)
    assert main([str(spec), "--resume"]) == 0
    assert "resuming the SFT stage from" in capfd.readouterr().err
    for folder in ("sft/final", "final"):
        want, got = kit.load_weights(tmp_path / "straight" / "out" / folder), kit.load_weights(out / folder)
        assert [k for k in want if not torch.equal(want[k], got[k])] == [], folder
