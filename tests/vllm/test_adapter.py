"""Adapter-only LoRA pushes (``lora_push: adapter``) against real vLLM engines, in this
process: one engine that gets the adapter alone after each step (the base weights once), one
that gets the merged weights (the path every other test pins to the trainer's log-probs).

What each test pins: over several optimizer steps the adapter engine's log-probs of a fixed
sequence and its sampler log-probs equal the merged engine's (<= 1e-4) and the policy's; the
push is the adapter's bytes, a small fraction of the merged push's; the engine keeps the last
``max_staleness + 1`` versions; ``auto`` says its choice in the log.
"""

from __future__ import annotations

import logging

import pytest
import torch
from grpo_plugins.vllm.colocated import VLLMRollout
from peft import LoraConfig, get_peft_model

from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.testing import build_model

from .conftest import HIDDEN
from .test_engine import FIXED, engine_options, policy_logps

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

TOL = 1e-4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def engine_logps(backend: VLLMRollout, ids: list[int]) -> torch.Tensor:
    """The engine's prompt log-probs of ``ids[1:]`` under the policy version it samples with."""
    from vllm import SamplingParams as VLLMSampling
    from vllm.inputs import TokensPrompt

    (out,) = backend.llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        VLLMSampling(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0),
        use_tqdm=False, lora_request=backend.lora_request,
    )
    return torch.tensor([entry[t].logprob for t, entry in zip(ids[1:], out.prompt_logprobs[1:])])


@pytest.fixture(scope="module")
def policy(tokenizer):
    torch.manual_seed(1)
    return get_peft_model(
        build_model(tokenizer, hidden_size=HIDDEN, seed=0),
        LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False),
    )


def test_adapter_pushes_give_the_merged_pushes_log_probs_over_several_steps(policy, tokenizer, prompts, caplog):
    with caplog.at_level(logging.INFO, logger="grpo.rollout.vllm"):
        adapter = VLLMRollout(engine_options(lora_push="auto"))
        pushes = {"adapter": adapter.setup(RolloutSetup(policy, tokenizer, max_staleness=1))}
    assert "LoRA weight sync pushes the adapter alone (lora_push: auto)" in caplog.text
    merged = VLLMRollout(engine_options(lora_push="merged"))
    pushes["merged"] = merged.setup(RolloutSetup(policy, tokenizer))
    assert adapter.push == "adapter" and merged.push == "merged" and merged.lora_request is None

    ids = tokenizer(FIXED)["input_ids"]
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    for step in range(4):
        if step:  # an optimizer step on the adapter (the base is frozen), then both pushes
            policy.train()
            loss = -torch.log_softmax(policy(torch.tensor([ids])).logits[0, :-1], -1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            policy.eval()
            pushes = {"adapter": adapter.sync_weights(policy), "merged": merged.sync_weights(policy)}
        own = policy_logps(policy, ids)
        got, want = engine_logps(adapter, ids), engine_logps(merged, ids)
        assert (got - want).abs().max() <= TOL, step
        assert (got - own).abs().max() <= TOL, step
        a, m = adapter.generate(prompts, 2, sampling), merged.generate(prompts, 2, sampling)
        assert torch.equal(a.completion_ids, m.completion_ids), step
        mask = a.completion_mask
        assert (a.sampling_logp - m.sampling_logp)[mask].abs().max() <= TOL, step
        # the engine holds the last max_staleness + 1 = 2 versions
        assert adapter.llm.llm_engine.list_loras() == set(range(max(1, step), step + 2)), step
        assert pushes["adapter"].bytes < pushes["merged"].bytes / 10
        assert pushes["adapter"].seconds > 0 and pushes["merged"].seconds > 0  # each kind measured
    print(f"bytes per push: adapter {pushes['adapter'].bytes:.0f}, merged {pushes['merged'].bytes:.0f}")
    assert own.sub(engine_logps(merged, ids)).abs().max() <= TOL
