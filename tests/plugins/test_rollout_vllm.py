"""The ``vllm`` rollout backend, on CPU and without vLLM: registration, options and the
install message at validation, the sampling-parameter mapping, the conversion of vLLM's
outputs into a RolloutBatch, and the weights it pushes (LoRA merged) checked against peft.

What needs a real vLLM (building the engine, generating, the weight push) is tested against
one in ``tests/vllm`` (marker ``vllm``, run in the second environment of the README's test
command); sleep mode and speed on a GPU are measured by ``bench/vllm_check.py``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from grpo_plugins.rollout_vllm import (
    MISSING_VLLM,
    VLLMRollout,
    VLLMRolloutOptions,
    cast_weights,
    drop_unknown,
    engine_kwargs,
    keep_torch_threads,
    outputs_to_batch,
    repeat_greedy,
    request_seed,
    sampling_kwargs,
    write_model_files,
)
from grpo_plugins.weights import (
    lora_layout,
    merge_lora,
    policy_weights,
    vllm_weight_name,
)
from pydantic import ValidationError

from grpo_core.cli import main
from grpo_core.contracts import RolloutBackend, SamplingParams
from grpo_core.kinds import KINDS
from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_model, build_tokenizer

HAS_VLLM = importlib.util.find_spec("vllm") is not None
without_vllm = pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")


pytestmark = pytest.mark.usefixtures("one_thread")


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _options(**values) -> VLLMRolloutOptions:
    """Options validated field by field, without the install check (vLLM is absent here)."""
    defaults = {name: f.get_default(call_default_factory=True) for name, f in VLLMRolloutOptions.model_fields.items()}
    return VLLMRolloutOptions.model_construct(**{**defaults, **values})


# --------------------------------------------------------------------------- registration
def test_registered_as_a_builtin_and_listed():
    plugins = load_plugins(external=False)
    component = plugins.registry.get("rollout_backend", "vllm")
    assert component.plugin == "grpo_plugins.rollout_vllm"
    assert component.impl is VLLMRollout and component.options is VLLMRolloutOptions
    assert plugins.info["grpo_plugins.rollout_vllm"].components == {"rollout_backend": ["vllm"]}
    code, out, _ = cli("plugins")
    assert code == 0
    assert "grpo_plugins.rollout_vllm  (builtin: grpo-core" in out
    assert f"  {KINDS['rollout_backend'].label}: vllm" in out
    assert isinstance(VLLMRollout(), RolloutBackend)


@without_vllm
def test_loading_the_plugins_does_not_import_vllm():
    load_plugins(external=False)
    assert "vllm" not in sys.modules


# --------------------------------------------------------------------------- options
def test_option_defaults():
    defaults = {name: f.get_default(call_default_factory=True) for name, f in VLLMRolloutOptions.model_fields.items()}
    assert defaults == {
        "gpu_memory_utilization": 0.3,
        "tensor_parallel_size": 1,
        "dtype": "auto",
        "max_model_len": None,
        "enforce_eager": False,
        "enable_sleep_mode": False,
        "enable_prefix_caching": True,
        "max_num_seqs": None,
        "max_num_batched_tokens": None,
        "seed": 0,
        "logprobs_mode": "processed_logprobs",
        "model_impl": "auto",
        "engine_kwargs": {},
    }


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
        ({"tensor_parallel": 2}, "tensor_parallel"),
    ],
)
def test_invalid_option_names_its_field(values, field):
    with pytest.raises(ValidationError) as info:
        VLLMRolloutOptions(**values)
    assert [e["loc"] for e in info.value.errors()] == [(field,)]


@without_vllm
def test_valid_options_without_vllm_say_how_to_install_it():
    with pytest.raises(ValidationError) as info:
        VLLMRolloutOptions(gpu_memory_utilization=0.5)
    (error,) = info.value.errors()
    assert error["msg"] == MISSING_VLLM
    assert "pip install 'grpo-core[vllm]'" in MISSING_VLLM and "rollout.name: hf" in MISSING_VLLM


@without_vllm
def test_cli_validate_without_vllm_exits_2_with_the_message(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: some/model}\nrewards: [{name: accuracy}]\nrollout: {name: vllm}\n")
    code, out, err = cli("validate", spec)
    assert code == 2 and out == ""
    assert err == f"grpo-run: error: invalid spec {spec} (1 problem):\n  spec.rollout (line 3): {MISSING_VLLM}\n"


# --------------------------------------------------------------------------- engine settings
def test_engine_kwargs_load_no_weights_and_run_in_process():
    kwargs = engine_kwargs(_options(), "/tmp/m", replica=3)
    assert kwargs == {
        "model": "/tmp/m",
        "tokenizer": "/tmp/m",
        "load_format": "dummy",
        "dtype": "auto",
        "gpu_memory_utilization": 0.3,
        "tensor_parallel_size": 1,
        "max_model_len": None,
        "enforce_eager": False,
        "enable_sleep_mode": False,
        "enable_prefix_caching": True,
        "seed": 3,  # the engine seed plus the data-parallel replica
        "distributed_executor_backend": "external_launcher",
        "logprobs_mode": "processed_logprobs",
        "model_impl": "auto",
        "trust_remote_code": False,
    }


def test_engine_kwargs_never_turn_trust_remote_code_on():
    """The README's promise: remote code is off unless model.trust_remote_code turns it on,
    and a vLLM engine_kwargs cannot turn it on behind the spec's back."""
    with pytest.raises(ValidationError, match="engine_kwargs may not set trust_remote_code"):
        VLLMRolloutOptions(engine_kwargs={"trust_remote_code": True})
    sneaked = _options(engine_kwargs={"trust_remote_code": True, "quantization": "fp8"})  # unvalidated
    kwargs = engine_kwargs(sneaked, "m")
    assert kwargs["trust_remote_code"] is False and kwargs["quantization"] == "fp8"


def test_cli_refuses_trust_remote_code_in_engine_kwargs(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model: {path: m}\nrollout: {name: vllm, engine_kwargs: {trust_remote_code: true}}\n"
        "rewards: [{name: accuracy}]\n", encoding="utf-8",
    )
    code, _, err = cli("validate", spec)
    assert code == 2 and "spec.rollout.engine_kwargs" in err and "may not set trust_remote_code" in err, err


def test_engine_kwargs_pass_set_limits_and_let_engine_kwargs_override():
    options = _options(max_num_seqs=64, max_num_batched_tokens=4096, seed=5,
                       engine_kwargs={"quantization": "fp8", "enforce_eager": True})
    kwargs = engine_kwargs(options, "m")
    assert kwargs["max_num_seqs"] == 64 and kwargs["max_num_batched_tokens"] == 4096
    assert kwargs["seed"] == 5 and kwargs["quantization"] == "fp8" and kwargs["enforce_eager"] is True


def test_drop_unknown_removes_only_optional_arguments_an_old_vllm_lacks():
    kwargs = engine_kwargs(_options(), "m")
    known = set(kwargs) - {"logprobs_mode", "model_impl"}
    kept, dropped = drop_unknown(kwargs, known)
    assert dropped == ["logprobs_mode", "model_impl"] and set(kept) == known
    kept, dropped = drop_unknown(kwargs, known, keep={"model_impl"})  # the user asked for it
    assert dropped == ["logprobs_mode"] and "model_impl" in kept


# --------------------------------------------------------------------------- sampling
def test_sampling_kwargs_map_the_contract_onto_vllm():
    sampling = SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, top_k=0, stop=("\n\n", "END"), seed=1)
    kwargs = sampling_kwargs(sampling, 8, [2, 7], seed=12345)
    assert kwargs["n"] == 8 and kwargs["max_tokens"] == 32 and kwargs["min_tokens"] == 0
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.7, 0.9, -1)  # 0 -> -1 (off)
    assert kwargs["stop"] == ["\n\n", "END"] and kwargs["include_stop_str_in_output"] is True
    assert kwargs["stop_token_ids"] == [2, 7] and kwargs["ignore_eos"] is False
    assert kwargs["seed"] == 12345 and kwargs["logprobs"] == 0
    assert (kwargs["repetition_penalty"], kwargs["presence_penalty"], kwargs["frequency_penalty"], kwargs["min_p"]) == (
        1.0, 0.0, 0.0, 0.0)
    assert sampling_kwargs(SamplingParams(max_new_tokens=4, top_k=50), 2, [2], None)["top_k"] == 50
    assert sampling_kwargs(SamplingParams(max_new_tokens=4), 2, [2], None)["seed"] is None


def test_greedy_is_temperature_zero_without_truncation():
    sampling = SamplingParams(max_new_tokens=4, greedy=True, temperature=0.5, top_p=0.5, top_k=3)
    kwargs = sampling_kwargs(sampling, 1, [2], None)
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.0, 1.0, -1)


def test_greedy_asks_one_completion_and_repeats_it_group_size_times():
    """vLLM refuses n > 1 at temperature 0; every greedy sample is the same anyway."""
    assert sampling_kwargs(SamplingParams(max_new_tokens=4, greedy=True), 4, [2], None)["n"] == 1
    one = [SimpleNamespace(outputs=[_completion(0, [5, EOS], "stop", "a")]),
           SimpleNamespace(outputs=[_completion(0, [6], "length", "b")])]
    batch = outputs_to_batch(repeat_greedy(one, 3), [[1], [2]], 3, pad_id=PAD, eos_ids=[EOS], max_new_tokens=1)
    assert batch.completion_ids.tolist() == [[5]] * 3 + [[6]] * 3
    assert batch.completions == ["a"] * 3 + ["b"] * 3


def test_texts_come_from_decode_when_given_cut_at_the_stop(outputs):
    rows = []

    def decode(ids):
        rows.extend(ids)
        return [f"<{len(r)}>\n\nmore" for r in ids]

    batch = outputs_to_batch(outputs, [[10], [13]], 3, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4, stop=("\n\n",),
                             decode=decode)
    assert rows == [[4, EOS], [5, 6, STOP_TOKEN], [7, 7, 7, 7], [8, 8, 8, EOS], [3], [EOS]]
    assert batch.completions == ["<2>\n\n", "<3>\n\n", "<4>\n\n", "<4>\n\n", "<1>\n\n", "<1>\n\n"]


def test_pushed_weights_take_the_engines_dtype_and_integer_buffers_stay():
    weights = [("w", torch.ones(2, dtype=torch.float32)), ("steps", torch.tensor([3]))]
    cast = dict(cast_weights(weights, torch.bfloat16))
    assert cast["w"].dtype == torch.bfloat16 and cast["steps"].dtype == torch.long


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


def test_request_seeds_are_deterministic_in_range_and_their_sample_streams_disjoint():
    assert request_seed(7) == request_seed(7)
    seeds = [request_seed(1000 + i) for i in range(500)]
    assert all(0 <= s < 2**62 for s in seeds)
    # vLLM seeds sample k of a request with seed + k: neighbouring prompts never share one
    streams = [{s + k for k in range(64)} for s in seeds]
    assert len(set().union(*streams)) == 500 * 64


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (SamplingParams(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (SamplingParams(max_new_tokens=4, temperature=0.0), "use greedy: true"),
        (SamplingParams(max_new_tokens=4, top_p=0.0), "top_p must be in (0, 1]"),
        (SamplingParams(max_new_tokens=4, top_k=-1), "top_k must be >= 0"),
    ],
)
def test_invalid_sampling_is_refused_before_vllm_is_needed(sampling, message):
    backend = VLLMRollout()
    backend.llm = object()  # past the setup check: these errors come first
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        backend.generate([[1, 2]], 2, sampling)


# --------------------------------------------------------------------------- outputs
EOS, STOP_TOKEN, PAD = 2, 9, 0


def _completion(index, ids, reason, text="", logps=None, extra=None):
    """A stand-in for vLLM's CompletionOutput: token ids, per-token {id: Logprob}."""
    logps = logps if logps is not None else [-0.1 * (t + 1) for t in range(len(ids))]
    entries = []
    for token, value in zip(ids, logps):
        entry = {token: SimpleNamespace(logprob=value, rank=1)}
        if extra:  # other tokens vLLM may list next to the sampled one
            entry[extra] = SimpleNamespace(logprob=-9.0, rank=2)
        entries.append(entry)
    return SimpleNamespace(index=index, token_ids=tuple(ids), logprobs=entries, finish_reason=reason, text=text)


@pytest.fixture
def outputs():
    return [
        SimpleNamespace(outputs=[  # given out of order: rows follow .index
            _completion(1, [5, 6, STOP_TOKEN], "stop", "ab\n\n", extra=11),
            _completion(0, [4, EOS], "stop", "x"),
            _completion(2, [7, 7, 7, 7], "length", "yyyy"),
        ]),
        SimpleNamespace(outputs=[
            _completion(0, [8, 8, 8, EOS], "length", "zzz"),  # EOS on the last allowed token
            _completion(1, [3], "stop", "q\n\nleft over"),
            _completion(2, [EOS], "stop", ""),
        ]),
    ]


def test_outputs_become_a_rollout_batch_like_hf(outputs):
    prompts = [[10, 11, 12], [13]]
    batch = outputs_to_batch(outputs, prompts, 3, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4, stop=("\n\n",))
    assert batch.prompt_ids.tolist() == [[10, 11, 12], [PAD, PAD, 13]]
    assert batch.prompt_mask.tolist() == [[True] * 3, [False, False, True]]
    assert batch.completion_ids.tolist() == [
        [4, EOS, PAD, PAD],
        [5, 6, STOP_TOKEN, PAD],
        [7, 7, 7, 7],
        [8, 8, 8, EOS],
        [3, PAD, PAD, PAD],
        [EOS, PAD, PAD, PAD],
    ]
    lengths = [2, 3, 4, 4, 1, 1]
    assert batch.completion_mask.tolist() == [[t < n for t in range(4)] for n in lengths]  # through EOS / stop
    assert batch.truncated.tolist() == [False, False, True, False, False, False]
    assert batch.completions == ["x", "ab\n\n", "yyyy", "zzz", "q\n\n", ""]
    assert batch.group_size == 3
    logp = batch.sampling_logp
    assert logp.dtype == torch.float32 and logp.shape == (6, 4)
    expected = [[-0.1 * (t + 1) if t < n else 0.0 for t in range(4)] for n in lengths]
    assert torch.allclose(logp, torch.tensor(expected))
    assert (logp[~batch.completion_mask] == 0).all()


def test_completions_are_cut_at_max_new_tokens():
    long = [SimpleNamespace(outputs=[_completion(0, [4, 5, 6, 7, 8], "length", "abcde")])]
    batch = outputs_to_batch(long, [[1]], 1, pad_id=PAD, eos_ids=[EOS], max_new_tokens=3)
    assert batch.completion_ids.tolist() == [[4, 5, 6]] and batch.truncated.tolist() == [True]
    assert batch.sampling_logp.shape == (1, 3)


def test_no_logprobs_gives_no_sampling_logp():
    output = SimpleNamespace(index=0, token_ids=[4, EOS], logprobs=None, finish_reason="stop", text="a")
    plain = [SimpleNamespace(outputs=[output])]
    batch = outputs_to_batch(plain, [[1]], 1, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4)
    assert batch.sampling_logp is None and batch.completion_mask.tolist() == [[True, True]]


def test_outputs_that_do_not_fit_are_refused(outputs):
    with pytest.raises(ValueError, match="prompt 0 has 3 completions, expected 2"):
        outputs_to_batch(outputs, [[1], [2]], 2, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4)
    with pytest.raises(ValueError, match="2 outputs for 1 prompts"):
        outputs_to_batch(outputs, [[1]], 3, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4)
    broken = [SimpleNamespace(outputs=[_completion(0, [4, 5], "stop")])]
    broken[0].outputs[0].logprobs[1] = {99: SimpleNamespace(logprob=-1.0)}
    with pytest.raises(ValueError, match="completion 0 of prompt 0 has no log-prob for its token 1"):
        outputs_to_batch(broken, [[1]], 1, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4)


# --------------------------------------------------------------------------- backend state
def test_generate_and_sync_before_setup_say_so():
    backend = VLLMRollout()
    with pytest.raises(RuntimeError, match=r"setup\(model, tokenizer\) must be called before generate"):
        backend.generate([[1, 2]], 2, SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match=r"setup\(model, tokenizer\) must be called before sync_weights"):
        backend.sync_weights(torch.nn.Linear(2, 2))


@without_vllm
def test_setup_without_vllm_says_how_to_install_it(tokenizer, model):
    with pytest.raises(RuntimeError) as info:
        VLLMRollout().setup(model, tokenizer)
    assert str(info.value) == MISSING_VLLM


# --------------------------------------------------------------------------- weights
@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
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


def test_model_files_are_the_base_config_and_tokenizer_without_weights(tmp_path, model, tokenizer):
    peft_model = _peft(model, **LORA_CONFIGS["attention"])
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
    from grpo_plugins.rollout_vllm import _load_on_worker

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

    _load_on_worker(Reloads(), weights)
    _load_on_worker(Old(), weights)
    assert calls == [("reload", weights, True), ("load", weights)]
