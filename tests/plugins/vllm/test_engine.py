"""A vLLM engine in this process, without vLLM: the model files it is built from, the thread count it
must not take over, and the weight load each worker runs."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from grpo_plugins.vllm.engine import keep_torch_threads, load_on_worker, write_model_files

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_thread_count_and_setter_survive_an_engine_that_replaces_them():
    threads = torch.get_num_threads()
    original = torch.set_num_threads
    try:
        with keep_torch_threads():  # what vLLM's CPU worker does: bind threads, then disable the setter
            torch.set_num_threads(threads + 1)
            torch.set_num_threads = lambda n: None
        assert torch.set_num_threads is original and torch.get_num_threads() == threads
    finally:
        torch.set_num_threads = original
        torch.set_num_threads(threads)


def test_model_files_are_the_base_config_and_tokenizer_without_weights(tmp_path, model, tokenizer):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(copy.deepcopy(model), config)
    peft_model.get_base_model().config.quantization_config = {"quant_method": "gguf"}
    write_model_files(peft_model, tokenizer, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["vocab_size"] == len(tokenizer) and config["hidden_size"] == model.config.hidden_size
    assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "tokenizer_config.json").exists()
    assert not list(Path(tmp_path).glob("*.safetensors")) and not list(Path(tmp_path).glob("*.bin"))
    assert hasattr(peft_model.get_base_model().config, "quantization_config")  # the policy's own config kept


def test_the_worker_push_takes_the_in_place_reload_where_it_takes_weights():
    """vLLM 0.32's worker reloads in place from an iterator; an older one reloads from disk
    only (no weights_iterator) and gets the plain load_weights of its model instead."""


    weights = [("a", torch.ones(1))]
    calls = []

    class Runner:  # vLLM 0.32: the runner takes the iterator, the worker passes it on
        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            calls.append(("reload", list(weights_iterator), is_checkpoint_format))

    class Reloads:
        model_runner = Runner()

        def reload_weights(self, *args, **kwargs):
            self.model_runner.reload_weights(*args, **kwargs)

    class Model:
        def load_weights(self, given):
            calls.append(("load", list(given)))

    class Old:  # vLLM 0.10: reloads from disk only
        model_runner = SimpleNamespace(get_model=Model, reload_weights=lambda: None)

        def reload_weights(self):
            raise AssertionError("must not be called")

    load_on_worker(Reloads(), weights)
    load_on_worker(Old(), weights)
    assert calls == [("reload", weights, True), ("load", weights)]
