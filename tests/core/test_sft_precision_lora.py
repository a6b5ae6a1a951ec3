"""The SFT stage under what the GRPO steps run with: a LoRA adapter (SFT trains it, GRPO
continues on the same one, the base weights never move), bf16 autocast, and fp16 with a loss
scaler (an overflow skips the step and lowers the scale, as in GRPO; the scale is checkpointed
and resumed)."""

from __future__ import annotations

import copy
import shutil
from functools import partial

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner.sft import SftSettings, demo_batch, sft_update

from .test_sft import _demos, _metrics

SFT = {"data": {"name": "arithmetic", "train_size": 16, "eval_size": 4, "solutions": True},
       "completion_column": "solution", "steps": 4, "batch_size": 4, "lr": 1.0e-2, "eval_every": 2}


# --------------------------------------------------------------------------- precision
def _sft_step(model, *, dtype=None, scaler=None):
    """One SGD step of sft_update on a copy of ``model`` under autocast ``dtype`` (None: float32):
    the parameter change and the metrics."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    autocast = partial(torch.autocast, "cpu", dtype=dtype) if dtype is not None else None
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    batch = demo_batch(*_demos(), pad_id=0)
    kwargs = {"autocast": autocast} if autocast is not None else {}
    metrics = sft_update(model, optimizer, scheduler, batch, SftSettings(), scaler=scaler, **kwargs)
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before, metrics


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(build_tokenizer())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_an_sft_step_under_autocast_is_the_float32_step_up_to_rounding(model, dtype):
    exact, want = _sft_step(model)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    delta, got = _sft_step(model, dtype=dtype, scaler=scaler)
    assert got["sft/loss"] == pytest.approx(want["sft/loss"], rel=2e-2)
    assert float((delta - exact).norm() / exact.norm()) < 0.1
    assert got["sft/nonfinite_updates"] == 0
    if scaler is not None:
        assert got["sft/loss_scale"] == 65536.0 and got["sft/scaler_overflows"] == 0


def test_an_sft_overflow_skips_the_step_and_lowers_the_scale_as_in_grpo(model):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)  # float16 gradients overflow to inf
    delta, metrics = _sft_step(model, dtype=torch.float16, scaler=scaler)
    assert metrics["sft/scaler_overflows"] == 1 and metrics["sft/nonfinite_updates"] == 0
    assert bool((delta == 0).all()) and scaler.get_scale() == 2.0**119


def test_fp16_sft_checkpoints_its_scale_and_resumes_to_the_same_weights(tmp_path, write_spec, kit, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path, sft=SFT, train={"steps": 1, "mixed_precision": "fp16"},
                      checkpoint={"every": 2, "keep": 5})
    assert main([str(spec)]) == 0
    rows = {r["step"]: r for r in _metrics(tmp_path / "out" / "sft" / "metrics.jsonl")}
    assert all(rows[s]["sft/loss_scale"] > 0 for s in (1, 2, 3, 4)) and rows[4]["sft/loss"] < rows[1]["sft/loss"]
    middle = tmp_path / "out" / "sft" / "checkpoints" / "step-000002"
    assert ckpt.load_state(middle / ckpt.STATE)["scaler"]["scale"] == rows[2]["sft/loss_scale"]
    shutil.copytree(tmp_path / "out", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints")  # no GRPO checkpoint: the resume is the SFT stage's
    again = tmp_path / "resumed" / "sft" / "checkpoints" / "step-000002"
    assert main([str(spec), "--set", "train.output_dir=resumed", "--resume", str(again)]) == 0
    for folder in ("sft/final", "final"):
        straight, resumed = kit.load_weights(tmp_path / "out" / folder), kit.load_weights(tmp_path / "resumed" / folder)
        assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == [], folder


def test_bf16_sft_then_grpo_trains(tmp_path, write_spec, kit):
    spec = write_spec(tmp_path, sft=SFT, train={"steps": 1, "mixed_precision": "bf16"})
    assert main([str(spec)]) == 0
    rows = _metrics(tmp_path / "out" / "sft" / "metrics.jsonl")
    losses = [r["sft/eval_loss"] for r in rows if "sft/eval_loss" in r]
    assert losses[-1] < losses[0] and all(r.get("sft/nonfinite_updates", 0) == 0 for r in rows)
    assert "sft/loss_scale" not in rows[-1]  # bf16 needs no scaler


# --------------------------------------------------------------------------- LoRA
def test_lora_sft_trains_the_adapter_and_grpo_continues_on_it(tmp_path, write_spec, kit, tiny_model_dir):
    from grpo_core import Trainer

    spec = write_spec(tmp_path, sft={**SFT, "eval_rewards": True}, model={"lora": {"r": 4, "alpha": 8}},
                      data={"eval_size": 4}, eval={"at_start": True, "max_prompts": 4},
                      train={"steps": 2}, algorithm={"kl": {"beta": 0.0}})
    trainer = Trainer(spec)
    assert trainer.train().status == "finished"
    out = trainer.run_dir
    sft_adapter, final_adapter = kit.load_weights(out / "sft" / "final"), kit.load_weights(out / "final")
    assert sft_adapter and all("lora_" in k for k in sft_adapter)  # the SFT result is an adapter, not the model
    assert sft_adapter.keys() == final_adapter.keys()  # GRPO trained the same adapter on
    assert any(float(v.abs().max()) > 0 for k, v in sft_adapter.items() if "lora_B" in k)  # B starts at 0: SFT moved it
    assert any(not torch.equal(sft_adapter[k], final_adapter[k]) for k in sft_adapter)  # and GRPO moved it further
    # GRPO's starting evaluation is the SFT adapter's, and the base weights never moved.
    sft_rows, grpo_rows = _metrics(out / "sft" / "metrics.jsonl"), _metrics(out / "metrics.jsonl")
    assert grpo_rows[0]["step"] == 0 and grpo_rows[0]["eval/reward"] == sft_rows[-1]["sft/eval/reward"]
    assert grpo_rows[0]["eval/completions/mean_length"] == sft_rows[-1]["sft/eval/completions/mean_length"]
    base = kit.load_weights(tiny_model_dir)
    live = {k.replace("base_model.model.", "").replace(".base_layer", ""): v.detach()
            for k, v in trainer._run.model.state_dict().items() if "lora_" not in k}
    assert [k for k in base if not torch.equal(base[k], live[k])] == []
