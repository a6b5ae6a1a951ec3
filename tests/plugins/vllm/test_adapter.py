"""Adapter-only LoRA pushes (``lora_push``), without vLLM: which policies go as an adapter and
which stay merged (and the message that says why), the folder of each version and how many
are kept, and the base weights the engine gets once.

The engine side (vLLM loading each version as a LoRA request, its log-probs equal to the
merged push's) is tested against a real vLLM in ``tests/vllm/test_adapter.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
from grpo_plugins.rollout.weights import policy_weights
from grpo_plugins.vllm.adapter import AdapterVersions, adapter_obstacle, base_weights, choose_push, engine_rank
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file

from grpo_core.testing import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def lora(tokenizer, **config):
    values = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    return get_peft_model(build_model(tokenizer), LoraConfig(**{**values, **config}))


def test_a_plain_lora_adapter_goes_as_an_adapter(tokenizer):
    model = lora(tokenizer)
    assert adapter_obstacle(model) is None
    assert choose_push("auto", model) == ("adapter", "lora_push: auto")
    assert choose_push("merged", model)[0] == "merged"
    assert engine_rank(model) == 8  # vLLM's smallest max_lora_rank above 4


@pytest.mark.parametrize(
    ("config", "obstacle"),
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']"),
        ({"use_dora": True}, "DoRA"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target module model.embed_tokens is a Embedding"),
        ({"r": 600}, "rank 600 is above vLLM's largest, 512"),
    ],
)
def test_what_vllm_cannot_load_stays_merged_and_says_why(tokenizer, config, obstacle):
    model = lora(tokenizer, **config)
    assert obstacle in adapter_obstacle(model)
    push, reason = choose_push("auto", model)
    assert push == "merged" and reason.startswith("lora_push: auto, and ") and obstacle in reason
    with pytest.raises(ValueError, match=r"lora_push: adapter, but .*set rollout.lora_push: merged"):
        choose_push("adapter", model)


def test_a_plain_model_has_no_adapter(tokenizer):
    assert adapter_obstacle(build_model(tokenizer)) == "the policy has no LoRA adapter"


def test_each_push_is_a_folder_of_the_adapter_alone_and_the_last_k_plus_1_are_kept(tokenizer, tmp_path):
    model = lora(tokenizer)
    versions = AdapterVersions(str(tmp_path), keep=2)  # max_staleness 1
    merged = sum(t.numel() * t.element_size() for _, t in policy_weights(model))
    adapter = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" in n)
    seen = []
    for step in range(1, 4):
        version, path, size, dropped = versions.save(model)
        seen.append(dropped)
        assert version == step and path == os.path.join(str(tmp_path), f"v{step}")
        assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]
        again = get_peft_model(build_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        set_peft_model_state_dict(again, load_file(os.path.join(path, "adapter_model.safetensors")))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))  # what peft reads back
        assert adapter <= size < adapter + 4096  # the adapter's tensors plus the safetensors header
        assert size < merged / 10
    assert seen == [[], [], [1]]
    assert sorted(os.listdir(tmp_path)) == ["v2", "v3"]


def test_the_base_weights_are_the_base_models_without_the_adapter(tokenizer):
    model = lora(tokenizer)
    plain = build_model(tokenizer)  # same seed: the base before the adapter went on
    got = dict(base_weights(model))
    assert set(got) == set(plain.state_dict())
    assert all(torch.equal(got[name], tensor) for name, tensor in plain.state_dict().items())


def test_a_qlora_base_stays_merged(tokenizer, tmp_path):
    """model.quantization: the engine holds the dequantized base, so the merged push (which
    sends what the 4-bit policy computes) stays."""
    from grpo_core.spec.models import ModelSection
    from grpo_core.train.model import load_policy

    build_model(tokenizer, hidden_size=64).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = load_policy(ModelSection(path=str(tmp_path), lora={"r": 4, "alpha": 8}, quantization={}), tmp_path,
                        tokenizer)
    assert adapter_obstacle(model) == "the base is quantized in 4 bits (QLoRA)"
    assert choose_push("auto", model) == ("merged", "lora_push: auto, and the base is quantized in 4 bits (QLoRA)")
