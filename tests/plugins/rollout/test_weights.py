"""The policy's weights as a backend with its own copy wants them: LoRA merged (checked against
peft's merge_and_unload), base-model names, cast to the engine's dtype; and streamed, in buckets
that never pass their bound (a tensor larger than it alone) and together are the whole push."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_plugins.rollout.weights import (
    bucket_sizes,
    cast_weights,
    lora_layout,
    merge_lora,
    pending_weights,
    plan_buckets,
    policy_weights,
    vllm_weight_name,
    weight_buckets,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.testing import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tokenizer):  # tokenizer: tests/plugins/conftest.py
    return build_model(tokenizer)


def _peft(model, **config):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **config))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # make every adapter tensor (and modules_to_save copy) count
        for name, param in peft_model.named_parameters():
            if ".lora_" in name or ".modules_to_save." in name:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return peft_model


def _snapshot(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_same_state(pushed: dict, expected: dict, atol: float = 1e-6) -> None:
    assert sorted(pushed) == sorted(expected)
    for name, tensor in expected.items():
        assert pushed[name].dtype == tensor.dtype, name
        assert torch.allclose(pushed[name], tensor, atol=atol, rtol=0), name


LORA_CONFIGS = {
    "attention": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "rslora-patterns-embedding-modules_to_save": {
        "r": 4, "lora_alpha": 16, "use_rslora": True, "target_modules": ["q_proj", "down_proj", "embed_tokens"],
        "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"down_proj": 3}, "modules_to_save": ["lm_head"],
    },
}


@pytest.mark.parametrize("config", LORA_CONFIGS.values(), ids=list(LORA_CONFIGS))
def test_pushed_lora_weights_are_peft_merge_and_unload(model, config):
    peft_model = _peft(model, **config)
    before = _snapshot(peft_model)
    pushed = dict(policy_weights(peft_model))
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    _assert_same_state(pushed, expected)
    assert sorted(pushed) == sorted(model.state_dict())  # the base model's names
    after = peft_model.state_dict()  # the training model is untouched
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(getattr(m, "merged", False) for m in peft_model.modules())


def test_layers_already_merged_are_not_merged_twice(model):
    peft_model = _peft(model, **LORA_CONFIGS["attention"])
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    peft_model.merge_adapter()
    assert lora_layout(peft_model)[1] == {}
    _assert_same_state(dict(policy_weights(peft_model)), expected)


def test_lora_layout_reads_each_layers_scaling(model):
    config = LORA_CONFIGS["rslora-patterns-embedding-modules_to_save"]
    adapter, scalings, transposed = lora_layout(_peft(model, **config))
    assert adapter == "default" and transposed == frozenset()
    prefix = "base_model.model.model."
    assert scalings[prefix + "layers.0.self_attn.q_proj"] == pytest.approx(16 / 4**0.5)
    assert scalings[prefix + "layers.1.mlp.down_proj"] == pytest.approx(3 / 2**0.5)
    assert scalings[prefix + "embed_tokens"] == pytest.approx(16 / 4**0.5)


def test_fan_in_fan_out_layers_are_merged_transposed():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=1)
    gpt2 = GPT2LMHeadModel(config)
    peft_model = _peft(gpt2, r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True)
    assert lora_layout(peft_model)[2] == {"base_model.model.transformer.h.0.attn.c_attn"}
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    _assert_same_state(dict(policy_weights(peft_model)), expected)


def test_dora_is_refused(model):
    peft_model = _peft(model, r=2, lora_alpha=4, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(NotImplementedError, match="DoRA"):
        dict(policy_weights(peft_model))


def test_a_plain_policy_pushes_its_state_dict_as_is(model):
    pushed = dict(policy_weights(model))
    state = model.state_dict()
    assert list(pushed) == list(state)
    assert all(pushed[k].data_ptr() == state[k].data_ptr() for k in state)  # no copies


def test_weight_names_lose_peft_and_wrapper_prefixes():
    assert vllm_weight_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight")
    assert vllm_weight_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert vllm_weight_name("base_model.model.lm_head.modules_to_save.other.weight", "other") == "lm_head.weight"
    assert vllm_weight_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert vllm_weight_name("model.embed_tokens.weight") == "model.embed_tokens.weight"
    state = {"a.base_layer.weight": torch.ones(2, 2), "a.lora_A.default.weight": torch.ones(1, 2),
             "a.lora_B.default.weight": torch.ones(2, 1), "b.weight": torch.zeros(1)}
    merged = dict(merge_lora(state, {"a": 0.5}))
    assert sorted(merged) == ["a.weight", "b.weight"] and torch.equal(merged["a.weight"], torch.full((2, 2), 1.5))


def test_pushed_weights_take_the_engines_dtype_and_integer_buffers_stay():
    weights = [("w", torch.ones(2, dtype=torch.float32)), ("steps", torch.tensor([3]))]
    cast = dict(cast_weights(weights, torch.bfloat16))
    assert cast["w"].dtype == torch.bfloat16 and cast["steps"].dtype == torch.long


def test_a_4bit_base_is_pushed_dequantized_with_the_adapter_merged(tmp_path):
    """QLoRA (model.quantization): the push is the full-precision model that export.merged
    writes, the 4-bit weights dequantized, no quantization constants among the names."""
    pytest.importorskip("bitsandbytes")
    from grpo_core.spec.models import ModelSection
    from grpo_core.testing import build_tokenizer, save_tiny_model
    from grpo_core.train.model import dequantize_4bit, load_policy

    save_tiny_model(tmp_path)
    section = ModelSection(path=str(tmp_path), lora={"r": 4, "alpha": 8}, quantization={})
    policy = load_policy(section, tmp_path, build_tokenizer())
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    pushed = dict(policy_weights(policy))
    policy.save_pretrained(tmp_path / "adapter")  # as export.merged folds it: onto the dequantized base
    from peft import PeftModel

    base = dequantize_4bit(load_policy(section.model_copy(update={"lora": None}), tmp_path, build_tokenizer()),
                           torch.float32)
    merged = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    assert pushed.keys() == merged.keys()
    assert all(pushed[k].dtype == torch.float32 for k in pushed)
    for k in pushed:
        torch.testing.assert_close(pushed[k], merged[k], atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- streamed pushes
@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=40), bound=st.integers(1, 3000))
def test_buckets_never_pass_the_bound_and_hold_every_tensor_once_in_order(sizes, bound):
    runs = plan_buckets(sizes, bound)
    assert [i for run in runs for i in run] == list(range(len(sizes)))  # the concatenation is the whole
    for run in runs:
        assert len(run) >= 1
        assert sum(sizes[i] for i in run) <= bound or len(run) == 1  # over the bound: one tensor alone
    for i, size in enumerate(sizes):
        if size > bound:
            assert next(run for run in runs if i in run) == range(i, i + 1)
    for run, after in zip(runs, runs[1:]):  # each bucket as full as the next tensor allows
        assert sum(sizes[i] for i in run) + sizes[after.start] > bound


def test_a_bucket_bound_below_one_byte_is_refused():
    with pytest.raises(ValueError, match="at least 1 byte, got 0"):
        plan_buckets([4], 0)


@pytest.fixture(scope="module")
def lora_model(model):
    return _peft(model, **LORA_CONFIGS["attention"])


@settings(max_examples=20, deadline=None)
@given(bound=st.integers(1, 80_000), lora=st.booleans(), two_dtypes=st.booleans())
def test_streamed_buckets_are_the_whole_push_cast_and_bounded(model, lora_model, bound, lora, two_dtypes):
    """The buckets of a (LoRA-merged) policy cast to one or two dtypes: each within the bound
    unless it is one tensor larger than it (the tiny model's embedding is 40 kB in float32),
    their concatenation bitwise the whole push, cast, in order."""
    policy = lora_model if lora else model
    dtypes = [torch.bfloat16, torch.float32] if two_dtypes else [torch.bfloat16]
    pending = pending_weights(policy)
    whole = list(policy_weights(policy))
    buckets = list(weight_buckets(pending, bound, dtypes))
    assert [sum(t.numel() * t.element_size() for d in dtypes for _, t in b[d]) for b in buckets] == \
        bucket_sizes(pending, bound, dtypes)
    for bucket in buckets:
        held = sum(t.numel() * t.element_size() for d in dtypes for _, t in bucket[d])
        assert held <= bound or len(bucket[dtypes[0]]) == 1
    for dtype in dtypes:
        streamed = [item for bucket in buckets for item in bucket[dtype]]
        expected = cast_weights(whole, dtype)
        assert [n for n, _ in streamed] == [n for n, _ in expected]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(streamed, expected, strict=True))
    if bound >= sum(p.nbytes(d) for p in pending for d in dtypes):
        assert len(buckets) == 1
