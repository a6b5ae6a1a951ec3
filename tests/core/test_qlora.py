"""QLoRA (``model.quantization``): a tiny Llama's base loaded in 4 bits by bitsandbytes' CPU
backend, a LoRA adapter on top, trained for real: the run resumes bit for bit, the reference is
the 4-bit base with the adapter off, and ``export.merged`` writes a full-precision model that
computes what the trained policy computed. Plus the spec's refusals and bitsandbytes' CPU
repacking, which would change gradients after a generation were it left on."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main
from grpo_core.contracts import RolloutSetup
from grpo_core.errors import SpecError
from grpo_core.spec import load_spec

pytest.importorskip("bitsandbytes")

QUANT = {"quant_type": "nf4", "double_quant": True}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("model, message", [
    ({"quantization": QUANT}, "model.quantization: a 4-bit base is frozen"),
    ({"quantization": QUANT, "lora": {"r": 2}, "gguf_file": "m.gguf"}, "cannot be re-quantized"),
    ({"quantization": {"bits": 8}, "lora": {"r": 2}}, "model.quantization.bits"),
    ({"quantization": {"quant_type": "int4"}, "lora": {"r": 2}}, "'nf4' or 'fp4'"),
])
def test_the_spec_refuses_what_a_4bit_base_cannot_do(tmp_path, write_spec, model, message):
    with pytest.raises(SpecError, match=message):
        load_spec(write_spec(tmp_path, model=model))


def _policy(tiny_model_dir, tokenizer, adapter: bool = True):
    """The QLoRA policy as a run loads it; ``adapter=False``: the 4-bit base alone."""
    from grpo_core.spec.models import ModelSection
    from grpo_core.train.model import load_policy

    section = ModelSection(path=str(tiny_model_dir), lora={"r": 4, "alpha": 8}, quantization=QUANT)
    return load_policy(section if adapter else section.model_copy(update={"lora": None}), tiny_model_dir, tokenizer)


def test_a_4bit_base_loads_quantized_and_its_gradients_do_not_change_after_a_generation(tiny_model_dir):
    import bitsandbytes as bnb
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 11, 8]])

    def grads(generate_first: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = _policy(tiny_model_dir, tokenizer)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)  # B = 0 at init would hide a wrong input gradient
        if generate_first:  # eval mode, no gradients: where bitsandbytes' CPU kernel repacks weights
            model.eval()
            with torch.no_grad():
                model(ids)
            model.train()
        model(ids).logits.logsumexp(-1).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    model = _policy(tiny_model_dir, tokenizer)
    linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert linears and all(m.weight.dtype == torch.uint8 for m in linears)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".lora_" in n}
    before, after = grads(False), grads(True)
    assert before.keys() == after.keys() and len(before) > 4
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_a_missing_bitsandbytes_is_named_with_the_install_command(tiny_model_dir, monkeypatch):
    import importlib.util

    from grpo_core.errors import RunError
    from grpo_core.spec.models import ModelSection
    from grpo_core.train import model as modeling

    real = importlib.util.find_spec
    hidden = lambda name, *a: None if name == "bitsandbytes" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    section = ModelSection(path=str(tiny_model_dir), lora={"r": 4}, quantization=QUANT)
    with pytest.raises(RunError, match=r"needs bitsandbytes.*pip install 'grpo-core\[qlora\]'"):
        modeling.quantization_config(section)


@pytest.mark.slow
def test_a_qlora_run_trains_resumes_bit_for_bit_and_exports_a_full_precision_model(
    tmp_path, write_spec, kit, tiny_model_dir
):
    spec = write_spec(tmp_path, model={"lora": {"r": 4, "alpha": 8.0}, "quantization": QUANT},
                      algorithm={"kl": {"name": "low_var_kl", "beta": 0.04}},  # the reference: the 4-bit base
                      train={"steps": 4, "seed": 4, "lr": 0.05}, checkpoint={"every": 2, "keep": 5},
                      export={"merged": True, "model_card": False})
    assert main([str(spec)]) == 0
    middle = tmp_path / "out" / "checkpoints" / "step-000002"
    assert main([str(spec), "--set", "train.output_dir=resumed", "--resume", str(middle)]) == 0

    straight, resumed = (kit.load_weights(tmp_path / d / "final") for d in ("out", "resumed"))
    assert straight and all("lora" in k for k in straight)  # the adapter alone is saved, not the 4-bit base
    assert straight.keys() == resumed.keys()
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []
    rows, resumed_rows = (kit.read_metrics(tmp_path / d / "metrics.jsonl") for d in ("out", "resumed"))
    by_step = {r["step"]: r for r in rows}
    assert [r["step"] for r in resumed_rows] == [3, 4]
    for r in resumed_rows:
        assert r["loss"] == by_step[r["step"]]["loss"] and r["kl"] == by_step[r["step"]]["kl"]
    assert any(r["kl"] > 0 for r in rows)  # the adapter moved the policy away from the 4-bit base
    state = ckpt.load_state(middle / ckpt.STATE)
    assert state["optimizer"]["state"]

    # final/merged: full precision, no quantization in its config, computing the trained policy.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = tmp_path / "out" / "final" / "merged"
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    base = _policy(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir), adapter=False)
    trained = PeftModel.from_pretrained(base, tmp_path / "out" / "final").eval()
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        got, expected, before = plain(ids).logits, trained(ids).logits, original(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, before, atol=1e-3)


def test_importing_bitsandbytes_after_grpo_core_prints_no_warning_about_a_kernel_it_never_runs():
    """bitsandbytes warns at import on an AVX512-BF16 CPU that the kernel of its CPU repacking
    could not be fetched from the Hub; grpo-core turns that repacking off, so after ``import
    grpo_core`` the warning is not shown (the control shows it where the CPU has the flag)."""
    import subprocess
    import sys
    from pathlib import Path

    def stderr(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr

    assert "gemm_4bit_forward" not in stderr("import grpo_core, peft, bitsandbytes")
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "avx512_bf16" in cpuinfo.read_text():
        assert "gemm_4bit_forward" in stderr("import peft, bitsandbytes")


def test_the_hf_backend_generates_with_a_4bit_policy_itself(tiny_model_dir, monkeypatch):
    """rollout dtype auto (a bfloat16 copy where the hardware has bf16, for models above a size)
    would cast the 4-bit packed weights: a quantized policy generates itself, and an explicit
    rollout.dtype is refused naming why."""
    from grpo_plugins.rollout import decode
    from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions
    from transformers import AutoTokenizer

    from grpo_core.spec.models import ModelSection
    from grpo_core.train.model import load_policy

    monkeypatch.setattr(decode, "AUTO_MIN_PARAMETERS", 0)  # the tiny model counts as large enough
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    qlora = _policy(tiny_model_dir, tokenizer)
    plain = load_policy(ModelSection(path=str(tiny_model_dir), lora={"r": 4}), tiny_model_dir, tokenizer)
    bf16 = torch.bfloat16 if decode.native_bf16(torch.device("cpu")) else None
    assert decode.auto_dtype(plain, "lean") == bf16 and decode.auto_dtype(qlora, "lean") is None
    backend = HFRollout(HFRolloutOptions())
    backend.setup(RolloutSetup(qlora, tokenizer))
    assert backend.model is qlora
    with pytest.raises(RuntimeError, match=r"quantized \(model.quantization.*drop rollout.dtype \(it"):
        HFRollout(HFRolloutOptions(dtype="bfloat16")).setup(RolloutSetup(qlora, tokenizer))
