"""Adapter-only LoRA pushes (``lora_push``), without vLLM: which policies go as an adapter and
which stay merged (and the message that says why), the folder of each version and how many
are kept, and the base weights the engine gets once.

The engine side (vLLM loading each version as a LoRA request, its log-probs equal to the
merged push's) is tested against a real vLLM in ``tests/vllm/test_adapter.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from grpo_plugins.rollout.adapter import (
    AdapterVersions,
    adapter_config,
    adapter_obstacle,
    adapter_root,
    adapter_state,
    base_weights,
    choose_push,
    engine_rank,
    server_obstacle,
    write_adapter,
)
from grpo_plugins.rollout.weights import policy_weights
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


def test_an_adapter_on_the_output_layer_goes_without_the_output_layer(tokenizer, tmp_path):
    """peft's own save adds the whole frozen lm_head (save_embedding_layers) when it is a
    target; the engine has it from the base push, so the adapter goes alone."""
    model = lora(tokenizer, target_modules=["q_proj", "lm_head"])
    state = adapter_state(model)
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state), sorted(state)
    adapter = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" in n)
    _, path, size, _ = AdapterVersions(str(tmp_path), keep=1).save(model)
    assert adapter <= size < adapter + 4096
    again = get_peft_model(build_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    set_peft_model_state_dict(again, load_file(os.path.join(path, "adapter_model.safetensors")))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


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


LORA_SERVER = {"max_lora_rank": 8, "max_loras": 2, "runtime_updates": True}


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (None, "the server http://s:1 was not started with LoRA (grpo-run serve MODEL -- --enable-lora)"),
        ({**LORA_SERVER, "runtime_updates": False}, "does not load adapters at run time"),
        ({**LORA_SERVER, "max_lora_rank": 1}, "has --max-lora-rank 1, below the adapter's rank 4"),
        ({**LORA_SERVER, "max_loras": 1}, "has --max-loras 1, fewer than the 2 adapter versions"),
    ],
)
def test_a_server_that_cannot_load_the_adapter_keeps_the_merged_push_and_says_why(tokenizer, settings, says):
    """vllm-server: auto pushes the adapter only where every server can load it (LoRA on, run-time
    loading, rank and slots for max_staleness + 1 versions), else merges, saying which server
    and why; adapter refuses, naming it."""
    model = lora(tokenizer)
    assert server_obstacle("http://s:1", LORA_SERVER, 4, 2) is None
    obstacle = server_obstacle("http://s:1", settings, 4, 2)
    assert says in obstacle
    assert choose_push("auto", model, [None, None]) == ("adapter", "lora_push: auto")
    push, reason = choose_push("auto", model, [None, obstacle], backend="vllm-server")
    assert push == "merged" and reason == f"lora_push: auto, and {obstacle}"
    with pytest.raises(ValueError, match=r"^vllm-server rollout: lora_push: adapter, but the server http://s:1"):
        choose_push("adapter", model, [obstacle], backend="vllm-server")


def test_a_servers_adapter_folder_is_what_peft_reads_back(tokenizer, tmp_path):
    """What a server's worker writes from the tensors it receives (the adapter's state and its
    config, as the learner sends them) is an adapter peft loads to the same weights; writing
    the same version again (another worker of the machine) replaces the files whole."""
    from peft import PeftModel

    model = lora(tokenizer)
    state, config = adapter_state(model), adapter_config(model)
    json.dumps(config)  # travels as JSON through /collective_rpc
    folder = write_adapter(str(tmp_path / "v1"), state, config)
    write_adapter(folder, state, config)
    assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors"]
    again = PeftModel.from_pretrained(build_model(tokenizer), folder)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(), strict=True))
    root = adapter_root("a-token")
    assert root == adapter_root("a-token") != adapter_root("another") and "a-token" not in root
