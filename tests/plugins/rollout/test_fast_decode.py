"""The ``hf`` backend's fast decode: the one-token attention, the preallocated KV cache, the
sampler's log-probs, and ``dtype: auto`` (a bfloat16 generation copy where the CPU computes
bfloat16 natively, with the rollout correction weighting the sampler/trainer gap).

Tolerances: float32 paths agree to 1e-5 (the same math in another order); bfloat16 ones are
compared with float32 by how far bfloat16 rounding can move a log-prob on the tiny model."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from grpo_plugins.rollout import decode as decode_module
from grpo_plugins.rollout.decode import (
    DECODE_ATTENTION,
    SlabLayer,
    auto_dtype,
    decode_attention,
    lean_decode,
    use_decode_attention,
    use_slabs,
)
from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo_core.cli import main
from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.testing import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["What is 3 + 4?", "Hi", "Think step by step. What is 12 * 7? Answer:"]  # conftest's ragged prompts


@pytest.fixture(scope="module")
def tok(tokenizer):  # tokenizer, prompts: tests/plugins/conftest.py
    return tokenizer


@pytest.fixture(scope="module")
def policy(tok):
    return build_model(tok)  # 4 query heads on 2 key/value heads


# ------------------------------------------------------------------ decode attention
@pytest.mark.parametrize("with_mask", [True, False])
def test_decode_attention_is_sdpa_for_a_one_token_query(with_mask):
    """Grouped query heads against their key/value head, a padding mask: the same output as
    transformers' sdpa (which repeats the keys) to 1e-5."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    b, heads, kv_heads, length, d = 3, 6, 2, 9, 16
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    q = torch.randn(b, heads, 1, d)
    k, v = torch.randn(b, kv_heads, length, d), torch.randn(b, kv_heads, length, d)
    mask = None
    if with_mask:
        mask = torch.ones(b, 1, 1, length, dtype=torch.bool)
        mask[0, ..., :4] = False  # a left-padded row
        mask[2, ..., :1] = False
    ours, _ = decode_attention(module, q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (b, 1, heads, d)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    if with_mask:  # the masked keys play no part: changing them changes nothing
        k2 = k.clone()
        k2[0, :, :4] = 100.0
        assert torch.allclose(decode_attention(module, q, k2, v, mask, scaling=0.3)[0], ours, atol=1e-6)


def test_a_model_on_decode_attention_gives_the_same_logits(policy, tok, prompts):
    """The whole tiny model, prompts (sdpa) then decode steps (ours), left padding included."""
    fast = copy.deepcopy(policy)
    assert use_decode_attention(fast) and fast.config._attn_implementation == DECODE_ATTENTION
    assert policy.config._attn_implementation == "sdpa"  # the original is untouched
    sampling = SamplingParams(max_new_tokens=6, seed=5)
    out = {}
    for name, model in (("sdpa", policy), ("decode", fast)):
        backend = HFRollout(HFRolloutOptions(dtype=None))
        backend.setup(RolloutSetup(model, tok))
        out[name] = backend.generate(prompts, 3, sampling)
    assert torch.equal(out["sdpa"].completion_ids, out["decode"].completion_ids)
    full = torch.cat([out["sdpa"].prompt_ids.repeat_interleave(3, 0), out["sdpa"].completion_ids], dim=1)
    mask = torch.cat([out["sdpa"].prompt_mask.repeat_interleave(3, 0), out["sdpa"].completion_mask], dim=1)
    with torch.no_grad():
        a = policy(input_ids=full, attention_mask=mask.long()).logits
        b = fast(input_ids=full, attention_mask=mask.long()).logits  # many positions: sdpa inside
    assert torch.allclose(a, b, atol=1e-5)


def test_packed_linears_give_the_same_logits_and_are_undone(policy, tok):
    """A bfloat16 CPU model's linear layers on oneDNN-packed weights: the same logits (oneDNN
    runs the same bf16 matmul), and the plain layers back afterwards."""
    from grpo_plugins.rollout.decode import packed_linears

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")  # every torch CPU wheel has it
    if not decode_module._onednn_bf16():  # an AVX2 CPU: see the test below
        pytest.skip("oneDNN has no bfloat16 kernels on this CPU: nothing is packed")
    model = copy.deepcopy(policy).to(torch.bfloat16).eval()
    ids = torch.tensor([tok(TEXTS[2])["input_ids"]] * 3)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with packed_linears(model, 3):
            linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
            assert linears and all(hasattr(m, "_grpo_packed") for m in linears)
            packed = model(input_ids=ids).logits
        assert not any(hasattr(m, "_grpo_packed") or "forward" in vars(m) for m in linears)
        again = model(input_ids=ids).logits
    assert torch.allclose(packed.float(), plain.float(), atol=1e-2) and torch.equal(again, plain)
    with packed_linears(policy, 3):  # float32 layers are left as they are
        assert not any(hasattr(m, "_grpo_packed") for m in policy.modules())


# ------------------------------------------------------------------ the KV cache
@settings(max_examples=25, deadline=None)
@given(steps=st.lists(st.sampled_from(["one", "three", "drop", "repeat"]), min_size=1, max_size=12),
       room=st.integers(0, 4))
def test_slab_layer_holds_what_a_dynamic_layer_holds(steps, room):
    """Any sequence of appends (one or several positions), row drops and row repeats leaves a
    SlabLayer with exactly a DynamicLayer's keys and values, whether or not its buffer had
    room (``room`` 0 makes it grow at every append)."""
    torch.manual_seed(1)
    plain, slab = DynamicLayer(), DynamicLayer()
    first = torch.randn(4, 2, 3, 5), torch.randn(4, 2, 3, 5)
    plain.update(*first)
    slab.update(*first)
    slab = SlabLayer.from_layer(slab, room)
    for step in steps:
        b = plain.keys.shape[0]
        if step in ("one", "three"):
            n = 1 if step == "one" else 3
            new = torch.randn(b, 2, n, 5), torch.randn(b, 2, n, 5)
            got, want = slab.update(*new), plain.update(*new)
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        elif step == "drop" and b > 1:
            keep = torch.arange(0, b, 2)
            plain.batch_select_indices(keep)
            slab.batch_select_indices(keep)
        elif step == "repeat" and b < 8:
            plain.batch_repeat_interleave(2)
            slab.batch_repeat_interleave(2)
        assert torch.equal(slab.keys, plain.keys) and torch.equal(slab.values, plain.values)
        assert slab.get_seq_length() == plain.get_seq_length()


def test_slabs_replace_only_plain_layers_and_start_empty_ones_lazily(policy):
    cache = DynamicCache(config=policy.config)
    use_slabs(cache, 8)
    assert all(isinstance(layer, SlabLayer) for layer in cache.layers)
    keys = torch.randn(2, 2, 3, 8)
    k, v = cache.update(keys, keys + 1, 0)
    assert torch.equal(k, keys) and cache.layers[0]._k.shape[-2] == 3 + 8  # room for 8 more
    cache.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), 0)
    assert cache.layers[0]._k.data_ptr() == k.data_ptr()  # written in place, no new buffer


# ------------------------------------------------------------------ sampler log-probs
@pytest.mark.parametrize("sampler", ["inverse-cdf", "multinomial"])
@pytest.mark.parametrize("knobs", [{}, {"temperature": 0.7, "top_k": 20}, {"temperature": 1.3, "top_p": 0.8}],
                         ids=["plain", "top-k", "top-p"])
def test_the_lean_loop_returns_the_log_prob_of_each_drawn_token(policy, tok, sampler, knobs):
    """Each drawn token's log-prob is the model's log-softmax of the warped logits (the
    distribution it was drawn from), recomputed here with one full forward: to 1e-4. Zero
    after a row's end."""
    from grpo_plugins.rollout.decode import warpers

    prompt = torch.tensor([tok(TEXTS[0])["input_ids"]] * 4)
    mask = torch.ones_like(prompt, dtype=torch.bool)
    sampling = SamplingParams(max_new_tokens=7, seed=2, **knobs)
    torch.manual_seed(2)
    with torch.inference_mode():
        out, lengths, logp = lean_decode(policy, prompt, mask, DynamicCache(config=policy.config), sampling,
                                         [tok.eos_token_id], tok.pad_token_id, sampler=sampler, with_logp=True)
    full = torch.cat([prompt, out], dim=1)
    with torch.no_grad():
        logits = policy(input_ids=full).logits[:, prompt.shape[1] - 1:-1].float()
    processors = warpers(sampling)
    for row in range(4):
        n = int(lengths[row]) if lengths[row] >= 0 else out.shape[1]
        for t in range(n):
            scores = processors(full[row:row + 1, : prompt.shape[1] + t], logits[row, t][None].clone())
            want = torch.log_softmax(scores, dim=-1)[0, out[row, t]]
            assert math.isfinite(float(want)) and abs(float(logp[row, t]) - float(want)) < 1e-4
        assert torch.all(logp[row, n:] == 0)


def test_greedy_decoding_returns_no_log_probs(policy, tok):
    prompt = torch.tensor([tok(TEXTS[1])["input_ids"]])
    with torch.inference_mode():
        _, _, logp = lean_decode(policy, prompt, torch.ones_like(prompt, dtype=torch.bool),
                                 DynamicCache(config=policy.config), SamplingParams(max_new_tokens=3, greedy=True),
                                 [tok.eos_token_id], tok.pad_token_id, with_logp=True)
    assert logp is None


def test_a_bf16_copy_reports_its_log_probs_and_the_policy_itself_does_not(policy, tok, prompts):
    """A copy in another dtype gives ``sampling_logp`` (B, T), 0 on padding, within bf16
    rounding of the float32 policy's log-probs of the same tokens; the policy itself gives
    none (it samples from the weights the trainer evaluates)."""
    from grpo_core.train.learner.logprobs import completion_logprobs

    sampling = SamplingParams(max_new_tokens=8, seed=4)
    copied = HFRollout(HFRolloutOptions(dtype="bfloat16"))
    copied.setup(RolloutSetup(policy, tok))
    batch = copied.generate(prompts, 4, sampling)
    assert batch.sampling_logp is not None and batch.sampling_logp.shape == batch.completion_ids.shape
    assert batch.sampling_logp.dtype == torch.float32
    assert torch.all(batch.sampling_logp[~batch.completion_mask] == 0)
    assert torch.all(batch.sampling_logp[batch.completion_mask] < 0)
    with torch.no_grad():
        trainer, _ = completion_logprobs(policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                         batch.completion_mask)
    gap = (trainer - batch.sampling_logp)[batch.completion_mask].abs()
    assert float(gap.mean()) < 0.05 and float(gap.max()) < 0.5, gap  # bf16 rounding, not another model
    assert float(gap.max()) > 0  # and they are the copy's, not the policy's
    plain = HFRollout(HFRolloutOptions(dtype=None))
    plain.setup(RolloutSetup(policy, tok))
    assert plain.generate(prompts, 2, sampling).sampling_logp is None


# ------------------------------------------------------------------ dtype: auto
@pytest.mark.parametrize(("native", "size", "decode", "weights", "expect"), [
    (True, 0, "lean", torch.float32, torch.bfloat16),
    (False, 0, "lean", torch.float32, None),  # no native bf16 (an AVX2 CPU): the policy itself
    (True, 10**12, "lean", torch.float32, None),  # below the size where a copy pays
    (True, 0, "generate", torch.float32, None),  # generate does not return the sampler's log-probs
    (True, 0, "lean", torch.bfloat16, None),  # the policy is bf16 already
])
def test_auto_dtype(monkeypatch, tok, native, size, decode, weights, expect):
    monkeypatch.setattr(decode_module, "native_bf16", lambda device: native)
    monkeypatch.setattr(decode_module, "AUTO_MIN_PARAMETERS", size)
    assert auto_dtype(build_model(tok).to(weights), decode) == expect


def test_native_bf16_reads_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert not decode_module.native_bf16(torch.device("cpu"))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert decode_module.native_bf16(torch.device("cpu"))


def test_auto_generates_with_a_bf16_copy_on_decode_attention(monkeypatch, policy, tok, prompts):
    monkeypatch.setattr(decode_module, "native_bf16", lambda device: True)
    monkeypatch.setattr(decode_module, "AUTO_MIN_PARAMETERS", 0)
    backend = HFRollout()  # the defaults
    backend.setup(RolloutSetup(policy, tok))
    assert backend.model is not policy and next(backend.model.parameters()).dtype == torch.bfloat16
    assert backend.model.config._attn_implementation == DECODE_ATTENTION
    assert backend.options.sampler == "inverse-cdf"
    batch = backend.generate(prompts, 2, SamplingParams(max_new_tokens=5, seed=1))
    assert batch.sampling_logp is not None


VARIED = '''
from grpo_core import hookimpl

def varied(prompts, completions, **kwargs):
    """Rewards that differ within a group whatever the tiny model samples: every row trains."""
    return [float(i % 2) for i in range(len(completions))]

@hookimpl
def register_reward_functions(register):
    register.add("varied", varied)
'''


def test_a_run_on_a_bf16_copy_weights_the_loss_by_the_rollout_correction(tmp_path, monkeypatch, tok):
    """grpo-run with the defaults where the CPU has native bf16: every step logs the
    sampler/trainer gap and the truncated-IS weights, which are near 1 and not all 1."""
    from grpo_core.testing import save_tiny_model

    monkeypatch.setattr(decode_module, "native_bf16", lambda device: True)
    monkeypatch.setattr(decode_module, "AUTO_MIN_PARAMETERS", 0)
    model = save_tiny_model(tmp_path / "model")
    (tmp_path / "varied.py").write_text(VARIED)
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({
        "plugins": ["varied.py"],
        "model": {"path": str(model)},
        "data": {"name": "arithmetic", "train_size": 16, "eval_size": 0},
        "rollout": {"group_size": 4, "max_new_tokens": 6},
        "rewards": [{"name": "varied"}],
        "train": {"steps": 3, "prompts_per_step": 2, "lr": 1e-3, "progress": False, "seed": 0,
                  "output_dir": str(tmp_path / "out")},
        "eval": {"at_start": False, "at_end": False},
        "tracking": [],
    }))
    assert main([str(spec)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout_correction/logp_diff/max" in r]
    assert steps, "no step was weighted by the rollout correction"
    for row in steps:
        assert 0 < row["rollout_correction/logp_diff/max"] < 1.0, row


NO_ONEDNN_BF16 = """
import json
import torch
from grpo_plugins.rollout.decode import packed_linears
from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions
from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.testing import build_model, build_tokenizer

tok = build_tokenizer()
policy = build_model(tok)
model = policy.to(torch.bfloat16)
with packed_linears(model, 3):
    packed = [n for n, m in model.named_modules() if hasattr(m, "_grpo_packed")]
backend = HFRollout(HFRolloutOptions(dtype="bfloat16"))
backend.setup(RolloutSetup(build_model(tok), tok))
batch = backend.generate([tok("What is 3 + 4?")["input_ids"]], 2, SamplingParams(max_new_tokens=4, seed=1))
print(json.dumps({"packed": packed, "oneDNN bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                  "shape": list(batch.completion_ids.shape)}))
"""


def test_a_bf16_copy_generates_where_onednn_has_no_bf16_kernels():
    """Issue 47, item 16: a CPU whose oneDNN has no bfloat16 kernels (AVX2 only; here its ISA
    capped at AVX2 with ``ONEDNN_MAX_CPU_ISA``, in a process of its own since oneDNN reads it
    once). Before: ``rollout.dtype: bfloat16`` failed at the first generation with
    ``mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw,
    avx512vl and avx512dq``. After: nothing is packed and the copy generates."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", NO_ONEDNN_BF16], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"packed": [], "oneDNN bf16": False, "shape": [2, 4]}, got
