"""The ``hf`` rollout backend on the tiny offline model."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions
from pydantic import ValidationError

from grpo_core.contracts import RolloutBackend, RolloutSetup, SamplingParams
from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner.logprobs import completion_logprobs

GREEDY = SamplingParams(max_new_tokens=10, greedy=True)
TEXTS = ["What is 3 + 4?", "Hi", "Think step by step. What is 12 * 7? Answer:"]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_model(tokenizer)


def _backend(model, tokenizer, **options) -> HFRollout:
    backend = HFRollout(HFRolloutOptions(**options))
    backend.setup(RolloutSetup(model, tokenizer))
    return backend


def test_shapes_row_order_and_prompt_padding(model, tokenizer, prompts):
    batch = _backend(model, tokenizer).generate(
        prompts, 4, SamplingParams(max_new_tokens=6, seed=0)
    )
    lengths = [len(p) for p in prompts]
    assert batch.prompt_ids.shape == batch.prompt_mask.shape == (3, max(lengths))
    for row, prompt in enumerate(prompts):
        assert batch.prompt_mask[row].sum() == len(prompt)
        assert batch.prompt_ids[row, -len(prompt) :].tolist() == prompt
        assert not batch.prompt_mask[row, : max(lengths) - len(prompt)].any()
    assert batch.completion_ids.shape == batch.completion_mask.shape
    assert batch.completion_ids.shape[0] == 12 and batch.completion_ids.shape[1] <= 6
    assert batch.truncated.shape == (12,) and len(batch.completions) == 12
    assert batch.group_size == 4 and batch.sampling_logp is None
    assert batch.completion_mask[:, -1].any()  # trailing all-pad columns trimmed
    # what a training forward needs: ordinary tensors, not inference-mode ones
    assert not any(
        t.is_inference() for t in (batch.prompt_ids, batch.completion_ids, batch.completion_mask)
    )


def test_greedy_rows_are_prompt_major_and_match_each_prompt_alone(model, tokenizer, prompts):
    batch = _backend(model, tokenizer).generate(prompts, 3, GREEDY)
    for index, prompt in enumerate(prompts):
        alone = _backend(model, tokenizer).generate([prompt], 1, GREEDY)
        group = slice(index * 3, index * 3 + 3)
        width = alone.completion_ids.shape[1]
        for row in batch.completion_ids[group]:
            assert row[:width].tolist() == alone.completion_ids[0].tolist()
        assert batch.completions[group] == alone.completions * 3


@pytest.mark.parametrize("seed", [None, 7])
def test_shared_prefill_gives_the_plain_paths_tokens(model, tokenizer, prompts, seed):
    greedy = seed is None
    sampling = GREEDY if greedy else SamplingParams(max_new_tokens=10, temperature=1.3, seed=seed)
    shared = _backend(model, tokenizer).generate(prompts, 4, sampling)
    plain = _backend(model, tokenizer, share_prompt_prefill=False).generate(prompts, 4, sampling)
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    assert torch.equal(shared.completion_mask, plain.completion_mask)
    assert shared.completions == plain.completions
    if not greedy:  # sampling really happened: the rows of a group differ
        assert len({tuple(r) for r in shared.completion_ids[:4].tolist()}) > 1


def test_prompts_per_generate_splits_without_changing_greedy_tokens(model, tokenizer, prompts):
    whole = _backend(model, tokenizer).generate(prompts, 2, GREEDY)
    split = _backend(model, tokenizer, prompts_per_generate=2).generate(prompts, 2, GREEDY)
    assert torch.equal(whole.completion_ids, split.completion_ids)


def test_seed_reproduces_and_leaves_the_global_rng_alone(model, tokenizer, prompts):
    backend = _backend(model, tokenizer)
    sampling = SamplingParams(max_new_tokens=8, seed=3)
    state = torch.get_rng_state()
    first = backend.generate(prompts, 3, sampling)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(backend.generate(prompts, 3, sampling).completion_ids, first.completion_ids)
    other = backend.generate(prompts, 3, SamplingParams(max_new_tokens=8, seed=4))
    assert not torch.equal(other.completion_ids, first.completion_ids)


def test_sampling_params_win_over_the_models_generation_defaults(model, tokenizer, prompts):
    greedy = _backend(model, tokenizer).generate(prompts, 3, GREEDY).completion_ids
    top1 = SamplingParams(max_new_tokens=10, top_k=1, temperature=2.0, seed=0)
    assert torch.equal(_backend(model, tokenizer).generate(prompts, 3, top1).completion_ids, greedy)
    model = copy.deepcopy(model)
    model.generation_config.top_k = 1  # a checkpoint default that must not leak in
    model.generation_config.repetition_penalty = 5.0
    free = SamplingParams(max_new_tokens=10, temperature=2.0, seed=0)  # top_k = 0: off
    sampled = _backend(model, tokenizer).generate(prompts, 3, free).completion_ids
    assert len({tuple(r) for r in sampled[:3].tolist()}) > 1


def test_mask_ends_at_eos_inclusive_and_text_skips_it(model, tokenizer, prompts):
    """An lm_head bias that makes the (special) EOS token the argmax everywhere."""
    model = copy.deepcopy(model)
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[tokenizer.eos_token_id] = 100.0
    model.lm_head = biased
    batch = _backend(model, tokenizer).generate(
        prompts, 2, SamplingParams(max_new_tokens=5, seed=0)
    )
    assert batch.completion_ids.tolist() == [[tokenizer.eos_token_id]] * 6
    assert batch.completion_mask.all() and not batch.truncated.any()
    assert batch.completions == [""] * 6


def test_eos_at_a_known_step_ends_one_row_and_the_other_is_truncated(model, tokenizer, prompts):
    """Make the token greedy decoding emits at step k of prompt 0 an EOS id."""
    reference = _backend(model, tokenizer).generate(prompts[:2], 1, GREEDY).completion_ids.tolist()
    step = next(k for k in range(2, 10) if reference[0][k] not in reference[0][:k] + reference[1])
    model = copy.deepcopy(model)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, reference[0][step]]
    batch = _backend(model, tokenizer).generate(prompts[:2], 2, GREEDY)
    lengths = batch.completion_mask.sum(1).tolist()
    assert lengths == [step + 1, step + 1, 10, 10]
    assert batch.truncated.tolist() == [False, False, True, True]
    assert batch.completion_ids[0, : step + 1].tolist() == reference[0][: step + 1]
    assert (batch.completion_ids[0, step + 1 :] == tokenizer.pad_token_id).all()
    assert batch.completions[0] == tokenizer.decode(
        reference[0][: step + 1], skip_special_tokens=True
    )


def _stop_string_at(tokenizer, prompt, tokens):
    """A step ``k`` and an ASCII stop string that first appears in prompt + completion
    text when (non-special) token ``k`` is emitted, ending exactly at that token's end.
    Returns ``(k, stop, completion text up to k with special tokens skipped)``."""
    prompt_text = tokenizer.decode(prompt)
    special = set(tokenizer.all_special_ids)
    for k in range(1, len(tokens)):
        before, text = tokenizer.decode(tokens[:k]), tokenizer.decode(tokens[: k + 1])
        stop = text[len(before) :][-2:]
        clean = tokenizer.decode(tokens[: k + 1], skip_special_tokens=True)
        if (
            tokens[k] not in special
            and stop.strip()
            and stop.isascii()
            and stop.isprintable()
            and stop not in prompt_text + text[:-1]
            and clean.endswith(stop)
        ):
            return k, stop, clean
    raise AssertionError("no usable stop string in the greedy completion")


def test_stop_string_ends_the_row_on_the_token_that_completes_it(model, tokenizer, prompts):
    tokens = _backend(model, tokenizer).generate(prompts[:1], 1, GREEDY).completion_ids[0].tolist()
    step, stop, text = _stop_string_at(tokenizer, prompts[0], tokens)
    sampling = SamplingParams(max_new_tokens=10, greedy=True, stop=(stop, "never seen"))
    batch = _backend(model, tokenizer).generate(prompts[:1], 2, sampling)
    assert batch.completion_mask.sum(1).tolist() == [step + 1, step + 1]
    assert batch.completion_ids[0].tolist() == tokens[: step + 1]
    assert not batch.truncated.any()
    assert batch.completions == [text, text] and text.endswith(stop)


def test_truncation_flag_when_max_new_tokens_is_reached(model, tokenizer, prompts):
    batch = _backend(model, tokenizer).generate(
        prompts, 2, SamplingParams(max_new_tokens=3, greedy=True)
    )
    assert batch.completion_ids.shape == (6, 3)
    assert batch.truncated.all() and batch.completion_mask.all()


def test_model_modes_are_restored(model, tokenizer, prompts):
    model = copy.deepcopy(model)
    model.train()
    model.model.layers[0].eval()  # a mixed state, restored module by module
    before = [m.training for m in model.modules()]
    seen = []
    handle = model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    _backend(model, tokenizer).generate(prompts, 2, GREEDY)
    handle.remove()
    assert seen and not any(seen)  # generated in eval mode
    assert [m.training for m in model.modules()] == before


def test_rollout_feeds_the_training_log_probs(model, tokenizer, prompts):
    """The batch goes straight into a training forward (with grad); greedy tokens are each
    step's argmax, so the log-probs computed there must say so."""
    model = copy.deepcopy(model)
    batch = _backend(model, tokenizer).generate(
        prompts, 2, SamplingParams(max_new_tokens=6, greedy=True)
    )
    logp, _ = completion_logprobs(
        model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
    )
    logp.sum().backward()
    assert model.lm_head.weight.grad is not None
    # the argmax of V probabilities is at least 1/V
    assert (
        logp[batch.completion_mask] > -torch.log(torch.tensor(float(model.config.vocab_size)))
    ).all()


def test_registered_as_hf_and_built_from_options(model, tokenizer, prompts):
    component = load_plugins(external=False).registry.get("rollout_backend", "hf")
    assert component.options is HFRolloutOptions
    backend = component.build(HFRolloutOptions(share_prompt_prefill=False, prompts_per_generate=1))
    assert isinstance(backend, HFRollout) and isinstance(backend, RolloutBackend)
    assert backend.options.share_prompt_prefill is False
    assert isinstance(component.build(), HFRollout)
    backend.setup(RolloutSetup(model, tokenizer))
    backend.sync_weights(model)  # a no-op
    assert backend.generate(prompts[:1], 2, GREEDY).completion_ids.shape[0] == 2
    with pytest.raises(ValidationError, match="prompts_per_generate"):
        HFRolloutOptions(prompts_per_generate=0)
    with pytest.raises(ValidationError, match="temperature"):
        HFRolloutOptions(temperature=0.7)
    assert all(field.description for field in HFRolloutOptions.model_fields.values())


def test_errors_name_the_problem(model, tokenizer, prompts):
    with pytest.raises(RuntimeError, match="setup"):
        HFRollout().generate(prompts, 2, GREEDY)
    backend = _backend(model, tokenizer)
    with pytest.raises(ValueError, match="at least one token"):
        backend.generate([[]], 2, GREEDY)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        backend.generate(prompts, 2, SamplingParams(max_new_tokens=4, temperature=0.0))
    with pytest.raises(ValueError, match="group_size"):
        backend.generate(prompts, 0, GREEDY)


def test_generation_copy_in_another_dtype_follows_the_policy():
    """With ``dtype`` and ``keep_copy`` the backend generates with its own resident copy,
    which sync_weights refreshes."""
    from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions

    from grpo_core.contracts import SamplingParams
    from grpo_core.testing import build_model, build_tokenizer

    tok = build_tokenizer()
    policy = build_model(tok)
    backend = HFRollout(HFRolloutOptions(dtype="bfloat16", keep_copy=True))
    backend.setup(RolloutSetup(policy, tok))
    assert backend.model is not policy
    assert next(backend.model.parameters()).dtype == torch.bfloat16
    assert next(policy.parameters()).dtype == torch.float32  # the policy is untouched
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)
    before = next(backend.model.parameters()).clone()
    backend.sync_weights(policy)
    after = next(backend.model.parameters())
    assert not torch.equal(before, after)
    assert torch.equal(after, next(policy.parameters()).to(torch.bfloat16))
    out = backend.generate([[5, 6, 7]], 2, SamplingParams(max_new_tokens=3, greedy=True))
    assert out.completion_ids.shape[0] == 2


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _policy(tok, tied: bool):
    """The tiny model, or the same architecture with tied input/output embeddings (SmolLM2's)."""
    model = build_model(tok)
    if not tied:
        return model
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_per_call_copy_is_not_resident_and_generates_what_a_resident_copy_does(tied):
    """The default copy (``keep_copy: false``) holds no weights between calls, is cast from the
    current training weights at each call (no sync needed), keeps tied embeddings tied, and
    gives exactly the tokens of a resident copy (the same bfloat16 weights)."""
    tok = build_tokenizer()
    policy = _policy(tok, tied)
    per_call = HFRollout(HFRolloutOptions(dtype="bfloat16"))
    resident = HFRollout(HFRolloutOptions(dtype="bfloat16", keep_copy=True))
    per_call.setup(RolloutSetup(policy, tok))
    resident.setup(RolloutSetup(policy, tok))
    assert _weight_bytes(per_call.model) == 0
    assert _weight_bytes(resident.model) == _weight_bytes(policy) // 2
    if tied:
        assert per_call.model.get_output_embeddings().weight is per_call.model.get_input_embeddings().weight
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    for _ in range(2):  # the second round after an "optimizer step" on the policy
        for params in (GREEDY, sampled):
            a, b = per_call.generate(prompts, 2, params), resident.generate(prompts, 2, params)
            assert torch.equal(a.completion_ids, b.completion_ids) and a.completions == b.completions
        assert _weight_bytes(per_call.model) == 0  # freed again after the call
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(1.5)
        resident.sync_weights(policy)
        per_call.sync_weights(policy)  # a no-op: nothing resident to refresh
        assert _weight_bytes(per_call.model) == 0


def test_bf16_copy_generates_close_to_the_policy_under_autocast():
    """Generating from the training weights under bf16 autocast (``dtype: null`` with
    ``train.mixed_precision: bf16``) and from a bf16 copy both round the matmul inputs to
    bf16; they differ only where autocast keeps float32 (norms, softmax). Greedy tokens agree
    on most positions of the tiny model (the stated tolerance: at least 90%)."""
    tok = build_tokenizer()
    policy = build_model(tok)
    plain, copied = HFRollout(), HFRollout(HFRolloutOptions(dtype="bfloat16"))
    plain.setup(RolloutSetup(policy, tok))
    copied.setup(RolloutSetup(policy, tok))
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = plain.generate(prompts, 1, GREEDY)
    b = copied.generate(prompts, 1, GREEDY)
    agree = (a.completion_ids == b.completion_ids).float().mean()
    assert agree >= 0.9, f"greedy tokens agree on {float(agree):.0%} of positions"
