"""The ``vllm`` rollout backend, on CPU and without vLLM: registration, options and the install
message at validation, the engine's arguments, and what it refuses before vLLM is needed.

What needs a real vLLM (building the engine, generating, the weight push) is tested against
one in ``tests/vllm`` (marker ``vllm``, run in the second environment of the README's test
command); sleep mode and speed on a GPU are measured by ``bench/vllm_check.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys

import pytest
import torch
from grpo_plugins.vllm.colocated import MISSING_VLLM, VLLMRollout, VLLMRolloutOptions, drop_unknown, engine_kwargs
from pydantic import ValidationError

from grpo_core.cli import main
from grpo_core.contracts import RolloutBackend, RolloutSetup, SamplingParams
from grpo_core.kinds import KINDS
from grpo_core.plugin_manager import load_plugins

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


def test_registered_as_a_builtin_and_listed():
    plugins = load_plugins(external=False)
    component = plugins.registry.get("rollout_backend", "vllm")
    assert component.plugin == "grpo_plugins.vllm.colocated"
    assert component.impl is VLLMRollout and component.options is VLLMRolloutOptions
    assert plugins.info["grpo_plugins.vllm.colocated"].components == {"rollout_backend": ["vllm"]}
    code, out, _ = cli("plugins")
    assert code == 0
    assert "grpo_plugins.vllm.colocated  (builtin: grpo-core" in out
    assert f"  {KINDS['rollout_backend'].label}: vllm" in out
    assert isinstance(VLLMRollout(), RolloutBackend)


@without_vllm
def test_loading_the_plugins_does_not_import_vllm():
    load_plugins(external=False)
    assert "vllm" not in sys.modules


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
        "lora_push": "auto",
        "push_bucket_mb": 512.0,
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


def test_generate_and_sync_before_setup_say_so():
    backend = VLLMRollout()
    with pytest.raises(RuntimeError, match=r"setup must be called before generate"):
        backend.generate([[1, 2]], 2, SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match=r"setup must be called before sync_weights"):
        backend.sync_weights(torch.nn.Linear(2, 2))


@without_vllm
def test_setup_without_vllm_says_how_to_install_it(tokenizer, model):
    with pytest.raises(RuntimeError) as info:
        VLLMRollout().setup(RolloutSetup(model, tokenizer))
    assert str(info.value) == MISSING_VLLM
