"""fp16 mixed precision with a loss scaler (``torch.amp.GradScaler``), on the CPU: gradients
too small for float16 survive scaling, an overflow skips the step and lowers the scale
without counting as a non-finite update, and the scale is checkpointed and resumed."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from functools import partial

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main
from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner.batch import TrainBatch
from grpo_core.train.learner.learner import Learner
from grpo_core.train.learner.update import Objective, update

P, G, T = 2, 4, 6


@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    registry = load_plugins(external=False).registry
    objective = Objective(
        policy_loss=registry.get("policy_loss", "clip").build(),
        aggregator=registry.get("loss_aggregator", "token-mean").build(),
        kl=None, entropy_coef=0.0, early_stop_imp_ratio=None, max_length=T,
    )
    return build_model(build_tokenizer()), objective


def _batch(advantage_scale: float) -> TrainBatch:
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(10, 300, (P, 5), generator=gen)
    completion_ids = torch.randint(10, 300, (P * G, T), generator=gen)
    mask = torch.ones(P * G, T, dtype=torch.bool)
    adv = torch.randn(P * G, 1, generator=gen).expand(-1, T).clone() * advantage_scale
    return TrainBatch(prompt_ids, torch.ones(P, 5, dtype=torch.bool), completion_ids, mask, adv)


def _step(model, objective, batch, *, fp16: bool, scaler=None):
    """One SGD step (the change is lr * gradient, so it shows the gradient as computed)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    autocast = partial(torch.autocast, "cpu", dtype=torch.float16) if fp16 else nullcontext
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    metrics = update(Learner(model, opt, sched, objective, autocast=autocast, scaler=scaler), batch)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    return after - before, metrics


def test_the_scaler_keeps_gradients_that_float16_would_flush_to_zero(parts):
    model, objective = parts
    batch = _batch(1e-7)  # tiny advantages: gradients below float16's smallest subnormal
    exact, _ = _step(model, objective, batch, fp16=False)
    plain, _ = _step(model, objective, batch, fp16=True)
    scaled, metrics = _step(model, objective, batch, fp16=True, scaler=torch.amp.GradScaler("cpu"))

    def error(delta):
        return float((delta - exact).norm() / exact.norm())

    assert exact.norm() > 0
    assert error(plain) > 0.5  # most of the gradient underflowed without the scaler
    # what stays is float16 rounding of the smallest intermediates at the default scale 2**16:
    # 0.046-0.050 depending on the CPU's float16 kernels (0.0504 on an AVX512-FP16 Xeon)
    assert error(scaled) < 0.1, error(scaled)
    assert metrics["train/loss_scale"] == 65536.0 and metrics["train/scaler_overflows"] == 0


def test_an_overflow_skips_the_step_and_lowers_the_scale(parts):
    model, objective = parts
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)  # float16 gradients overflow to inf
    delta, metrics = _step(model, objective, _batch(1.0), fp16=True, scaler=scaler)
    assert metrics["train/scaler_overflows"] == 1 and metrics["train/nonfinite_updates"] == 0
    assert metrics["train/updates"] == 0 and bool((delta == 0).all())
    assert scaler.get_scale() == 2.0**119


def test_fp16_trains_and_resumes_its_scale(tmp_path, write_spec, kit, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path, train={"steps": 4, "mixed_precision": "fp16"}, checkpoint={"every": 2, "keep": 5})
    assert main([str(spec)]) == 0
    rows = kit.read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert all(r["train/loss_scale"] > 0 for r in rows) and sum(r["train/updates"] for r in rows) > 0
    middle = tmp_path / "out" / "checkpoints" / "step-000002"
    state = ckpt.load_state(middle / ckpt.STATE)
    assert state["scaler"]["scale"] == rows[1]["train/loss_scale"]
    assert main([str(spec), "--set", "train.output_dir=resumed", "--resume", str(middle)]) == 0
    straight, resumed = (kit.load_weights(tmp_path / d / "final") for d in ("out", "resumed"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
