"""The ``vllm`` backend against a real vLLM engine, in this process: one engine for the
module (float32, eager, a small KV cache), the ``hf`` backend and the trainer's own
log-probs as the references.

What each test pins: greedy tokens equal ``hf``'s; the sampler's log-probs equal the
trainer's (float32, <= 1e-5); after each weight push the engine's log-probs of a fixed
sequence equal the new policy's and differ from the old one's (plain and LoRA-merged); the
pushes stream in buckets smaller than the model (``push_bucket_mb``: a quarter MiB of a
1.4 MiB model), what the engine loads is bitwise the policy's weights, and its log-probs are
bitwise those after a push in one bucket;
the thread count stays the user's; sleep mode is refused on CPU with the option named.
"""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_plugins.rollout.hf import HFRollout
from grpo_plugins.vllm.colocated import VLLMRollout, VLLMRolloutOptions

from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.testing import build_model
from grpo_core.train.learner.logprobs import completion_logprobs

from .conftest import HIDDEN

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

FIXED = "What is 12 + 30? 12 + 30 = 42"  # the sequence whose log-probs every push is checked on
TOL = 1e-5  # float32 engine against the float32 trainer


def engine_options(**changes) -> VLLMRolloutOptions:
    values = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 16}
    return VLLMRolloutOptions(**{**values, **changes})


@pytest.fixture(scope="module")
def policy(tokenizer):
    return build_model(tokenizer, hidden_size=HIDDEN, seed=0).eval()


BUCKET_MB = 0.25  # a quarter MiB: the tiny model's pushes go in several buckets


@pytest.fixture(scope="module")
def engine(policy, tokenizer):
    backend = VLLMRollout(engine_options(push_bucket_mb=BUCKET_MB))
    backend.setup(RolloutSetup(policy, tokenizer))
    return backend


@pytest.fixture
def loaded(monkeypatch):
    """What each push hands the engine's worker, as ``(name, tensor)`` copies, recorded as the
    worker pulls it from the stream (the real loader then loads it)."""
    from grpo_plugins.vllm import colocated
    from grpo_plugins.vllm.engine import load_on_worker

    pushes: list[list[tuple[str, torch.Tensor]]] = []

    def recorded(worker, weights):
        seen: list[tuple[str, torch.Tensor]] = []
        pushes.append(seen)

        def tee():
            for name, tensor in weights:
                seen.append((name, tensor.detach().clone()))
                yield name, tensor

        load_on_worker(worker, tee())

    monkeypatch.setattr(colocated, "load_on_worker", recorded)
    return pushes


def assert_bitwise_the_policys(received: list[tuple[str, torch.Tensor]], model) -> None:
    from grpo_plugins.rollout.weights import policy_weights

    expected = [(n, t.float()) for n, t in policy_weights(model)]  # the engine computes in float32
    assert [n for n, _ in received] == [n for n, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(received, expected, strict=True))


def engine_logps(backend: VLLMRollout, ids: list[int]) -> torch.Tensor:
    """The engine's log-probs of ``ids[1:]`` given the tokens before each (prompt log-probs,
    temperature 1), ``float32 (len(ids) - 1,)``."""
    from vllm import SamplingParams as VLLMSampling
    from vllm.inputs import TokensPrompt

    (out,) = backend.llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        VLLMSampling(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0),
        use_tqdm=False,
    )
    return torch.tensor([entry[t].logprob for t, entry in zip(ids[1:], out.prompt_logprobs[1:])])


def policy_logps(model, ids: list[int]) -> torch.Tensor:
    """The trainer's log-probs of ``ids[1:]`` (plain forward, float32)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def trainer_logps(model, batch, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logp, _ = completion_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
            temperature=temperature,
        )
    return logp


def test_greedy_tokens_equal_the_hf_backends(engine, policy, tokenizer, prompts):
    sampling = SamplingParams(max_new_tokens=12, greedy=True)
    hf = HFRollout()
    hf.setup(RolloutSetup(policy, tokenizer))
    want = hf.generate(prompts, 2, sampling)
    got = engine.generate(prompts, 2, sampling)
    assert got.completion_ids.shape == want.completion_ids.shape
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.completion_mask, want.completion_mask)
    assert torch.equal(got.truncated, want.truncated)
    assert got.completions == want.completions
    assert torch.equal(got.prompt_ids, want.prompt_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logps_equal_the_trainers(engine, policy, prompts, temperature):
    sampling = SamplingParams(max_new_tokens=16, temperature=temperature, seed=11)
    batch = engine.generate(prompts, 4, sampling)
    assert batch.sampling_logp is not None and batch.completion_mask.sum() > 20
    mine = trainer_logps(policy, batch, temperature)
    gap = (mine - batch.sampling_logp).abs()[batch.completion_mask]
    assert float(gap.max()) <= TOL, float(gap.max())
    # Seeded: the same call draws the same tokens; another seed draws others.
    again = engine.generate(prompts, 4, sampling)
    assert torch.equal(again.completion_ids, batch.completion_ids)
    other = engine.generate(prompts, 4, SamplingParams(max_new_tokens=16, temperature=temperature, seed=12))
    assert not torch.equal(other.completion_ids, batch.completion_ids)


def _nudge(model, seed: int, scale: float = 0.05) -> None:
    """An update of every weight (as an optimizer step moves them all)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))


def test_each_push_reaches_the_engine_by_log_probs(engine, policy, tokenizer, loaded):
    ids = tokenizer(FIXED)["input_ids"]
    model = copy.deepcopy(policy)
    before = engine_logps(engine, ids)
    assert float((before - policy_logps(model, ids)).abs().max()) <= TOL  # setup pushed the policy
    bound = BUCKET_MB * 2**20
    for update in range(2):
        old = policy_logps(model, ids)
        _nudge(model, seed=update)
        new = policy_logps(model, ids)
        assert float((new - old).abs().max()) > 1e-2  # the update moved the log-probs
        push = engine.sync_weights(model)
        assert_bitwise_the_policys(loaded[-1], model)  # streamed, what the engine loaded is the policy
        # several buckets, none past the bound (the embedding, 160 kB, is the largest tensor)
        assert push.bytes > 4 * bound and 0 < push.figures["buffer_bytes"] <= bound, push
        got = engine_logps(engine, ids)
        assert float((got - new).abs().max()) <= TOL, (update, float((got - new).abs().max()))
        assert float((got - old).abs().max()) > 1e-2
    # the same weights in one bucket: the engine computes bit for bit what it did after the streamed push
    engine.options = engine.options.model_copy(update={"push_bucket_mb": 64.0})
    try:
        whole = engine.sync_weights(model)
    finally:
        engine.options = engine.options.model_copy(update={"push_bucket_mb": BUCKET_MB})
    assert whole.figures["buffer_bytes"] == whole.bytes == push.bytes
    assert torch.equal(engine_logps(engine, ids), got)
    engine.sync_weights(policy)  # back to the module's policy for the other tests
    assert float((engine_logps(engine, ids) - policy_logps(policy, ids)).abs().max()) <= TOL


def test_a_lora_policy_pushes_its_merged_weights(engine, policy, tokenizer, loaded):
    from peft import LoraConfig, get_peft_model

    ids = tokenizer(FIXED)["input_ids"]
    lora = get_peft_model(
        copy.deepcopy(policy),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    ).eval()
    with torch.no_grad():  # an adapter with an effect large enough to see
        for name, param in lora.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    with_adapter, base = policy_logps(lora, ids), policy_logps(policy, ids)
    assert float((with_adapter - base).abs().max()) > 1e-2
    engine.sync_weights(lora)
    assert_bitwise_the_policys(loaded[-1], lora)  # merged layer by layer into the buckets
    got = engine_logps(engine, ids)
    assert float((got - with_adapter).abs().max()) <= TOL
    assert not any(getattr(m, "merged", False) for m in lora.modules())  # the training model is untouched
    engine.sync_weights(policy)
    assert float((engine_logps(engine, ids) - base).abs().max()) <= TOL


def test_a_qlora_policy_pushes_its_dequantized_merged_weights(engine, policy, tokenizer, tmp_path):
    """model.quantization (a 4-bit base, bitsandbytes' CPU backend) with an adapter: the engine,
    built from the full-precision config, receives the base dequantized with the adapter merged,
    and its log-probs equal the 4-bit policy's own."""
    pytest.importorskip("bitsandbytes")
    from grpo_core.spec.models import ModelSection
    from grpo_core.train.model import load_policy

    policy.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    section = ModelSection(path=str(tmp_path), lora={"r": 4, "alpha": 8}, quantization={})
    qlora = load_policy(section, tmp_path, tokenizer).eval()
    with torch.no_grad():
        for name, param in qlora.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    ids = tokenizer(FIXED)["input_ids"]
    own, base = policy_logps(qlora, ids), policy_logps(policy, ids)
    assert float((own - base).abs().max()) > 1e-2
    engine.sync_weights(qlora)
    got = engine_logps(engine, ids)
    assert float((got - own).abs().max()) <= TOL, float((got - own).abs().max())
    engine.sync_weights(policy)
    assert float((engine_logps(engine, ids) - base).abs().max()) <= TOL


def test_the_thread_setting_stays_the_users(engine):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.get_num_threads() == 2  # vLLM's CPU worker had made this a no-op
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads


def test_sleep_mode_is_refused_on_cpu_naming_the_option(policy, tokenizer):
    backend = VLLMRollout(engine_options(enable_sleep_mode=True))
    with pytest.raises(RuntimeError, match="enable_sleep_mode is not supported on vLLM's CPU platform"):
        backend.setup(RolloutSetup(policy, tokenizer))
    assert backend.llm is None


def test_cli_validate_with_vllm_accepts_the_spec(tmp_path):
    import contextlib
    import io

    from grpo_core.cli import main

    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: some/model}\nrewards: [{name: accuracy}]\nrollout: {name: vllm}\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["validate", str(spec)])
    assert code == 0 and "gpu_memory_utilization: 0.3" in out.getvalue()
