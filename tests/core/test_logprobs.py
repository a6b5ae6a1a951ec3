"""Chunked log-probs: equal to the full log-softmax reference, never (N, V) sized."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner.logprobs import completion_logprobs, logit_transform, token_logprobs

P, G, L, T = 2, 3, 7, 6


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def base_model():
    return build_model(build_tokenizer())


def _model(base, dtype):
    return copy.deepcopy(base).to(dtype)


def _batch(vocab: int, seed: int = 0):
    """Ragged batch: prompt 0 has 3 left pads, prompt 1 none; completions of lengths
    6, 4, 1, 6, 0, 2 (row 4 empty); every prompt column kept, one completion column all pad."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, vocab, (P, L), generator=gen)
    prompt_mask = torch.ones(P, L, dtype=torch.bool)
    prompt_mask[0, :3] = False
    prompt_ids[~prompt_mask] = 0
    completion_ids = torch.randint(2, vocab, (P * G, T + 1), generator=gen)
    lengths = torch.tensor([6, 4, 1, 6, 0, 2])
    completion_mask = torch.arange(T + 1)[None, :] < lengths[:, None]
    completion_ids[~completion_mask] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _reference(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    """Plain reference: full logits of the whole sequence, log_softmax, gather."""
    group = completion_ids.shape[0] // prompt_ids.shape[0]
    ids = torch.cat([prompt_ids.repeat_interleave(group, 0), completion_ids], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(group, 0), torch.ones_like(completion_mask)], 1)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    length, steps = prompt_ids.shape[1], completion_ids.shape[1]
    logits = logits[:, length - 1 : length - 1 + steps]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_all = torch.log_softmax(logits / temperature, -1)
    logp = logp_all.gather(-1, completion_ids[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros((), dtype=logp.dtype)
    return torch.where(completion_mask, logp, zero), torch.where(completion_mask, entropy, zero)


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# (values atol, gradient tolerance relative to the largest gradient entry of the tensor).
# Llama's RMSNorm computes in float32 even in a float64 model: the shared-prompt path sums
# the G rows' gradients before that float32 step instead of after it, so in float64 it
# agrees with the reference to float32 precision, the plain path to float64 precision.
TOLERANCES = {
    (torch.float64, False): (1e-10, 1e-10),
    (torch.float64, True): (1e-10, 1e-6),
    (torch.float32, False): (2e-5, 1e-5),
    (torch.float32, True): (2e-5, 1e-5),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_matches_reference_values_entropy_and_gradients(
    base_model, dtype, share_prompt, chunk_size
):
    model = _model(base_model, dtype)
    batch = _batch(model.config.vocab_size)
    value_tol, grad_tol = TOLERANCES[dtype, share_prompt]
    ref_logp, ref_ent = _reference(model, *batch)
    # a loss that weights tokens differently, so gradients are not a plain sum
    weights = torch.linspace(0.5, 1.5, ref_logp.numel()).view_as(ref_logp).to(ref_logp.dtype)
    ref_grads = _grads(model, (ref_logp * weights).sum() + 0.3 * ref_ent.sum())

    logp, entropy = completion_logprobs(
        model, *batch, chunk_size=chunk_size, with_entropy=True, share_prompt=share_prompt
    )
    assert logp.shape == entropy.shape == batch[2].shape
    assert logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(logp, ref_logp, atol=value_tol, rtol=0)
    torch.testing.assert_close(entropy, ref_ent, atol=value_tol, rtol=0)
    grads = _grads(model, (logp * weights).sum() + 0.3 * entropy.sum())
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(
            grads[name],
            ref_grads[name],
            rtol=0,
            atol=grad_tol * ref_grads[name].abs().max(),
            msg=lambda m, name=name: f"{name}: {m}",
        )


def test_activation_checkpointing_falls_back_to_the_plain_path(base_model):
    """transformers drops the KV cache under activation checkpointing in training; the
    result must still be the reference, not a prompt-less forward."""
    model = _model(base_model, torch.float64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as load_policy does
    model.train()
    batch = _batch(model.config.vocab_size)
    ref_logp, _ = _reference(model, *batch)
    ref_grads = _grads(model, ref_logp.sum())
    logp, _ = completion_logprobs(model, *batch, share_prompt=True)
    torch.testing.assert_close(logp, ref_logp, atol=1e-10, rtol=0)
    grads = _grads(model, logp.sum())
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-10, rtol=1e-8)


def test_zero_on_padding_and_no_nan(base_model):
    model = _model(base_model, torch.float32)
    batch = _batch(model.config.vocab_size, seed=3)
    logp, entropy = completion_logprobs(model, *batch, with_entropy=True)
    mask = batch[3]
    assert torch.all(logp[~mask] == 0) and torch.all(entropy[~mask] == 0)
    assert torch.all(logp[mask] < 0) and torch.all(entropy[mask] > 0)
    assert logp[4].abs().sum() == 0  # the empty completion
    grads = _grads(model, logp.sum())
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_left_padding_and_batch_do_not_change_a_prompts_logprobs(base_model):
    """A prompt scored alone equals the same prompt left padded next to a longer one."""
    model = _model(base_model, torch.float64)
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(model.config.vocab_size)
    batch_logp, _ = completion_logprobs(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask
    )
    alone_logp, _ = completion_logprobs(
        model, prompt_ids[:1, 3:], prompt_mask[:1, 3:], completion_ids[:G], completion_mask[:G]
    )
    torch.testing.assert_close(batch_logp[:G], alone_logp, atol=1e-10, rtol=0)


def test_temperature_divides_logits(base_model):
    model = _model(base_model, torch.float64)
    batch = _batch(model.config.vocab_size)
    ref_logp, ref_ent = _reference(model, *batch, temperature=0.7)
    logp, entropy = completion_logprobs(model, *batch, temperature=0.7, with_entropy=True)
    torch.testing.assert_close(logp, ref_logp, atol=1e-10, rtol=0)
    torch.testing.assert_close(entropy, ref_ent, atol=1e-10, rtol=0)


def test_no_grad_gives_same_values_and_no_graph(base_model):
    model = _model(base_model, torch.float64)
    batch = _batch(model.config.vocab_size)
    with_grad, _ = completion_logprobs(model, *batch, chunk_size=4)
    with torch.no_grad():
        without, _ = completion_logprobs(model, *batch, chunk_size=4)
    assert not without.requires_grad
    torch.testing.assert_close(without, with_grad.detach(), atol=0, rtol=0)


def test_all_padding_completions_give_zeros(base_model):
    model = _model(base_model, torch.float32)
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(model.config.vocab_size)
    logp, entropy = completion_logprobs(
        model,
        prompt_ids,
        prompt_mask,
        completion_ids,
        torch.zeros_like(completion_mask),
        with_entropy=True,
    )
    assert logp.shape == completion_ids.shape and logp.abs().sum() == 0 and entropy.abs().sum() == 0


def test_rows_not_a_multiple_of_prompts_is_an_error(base_model):
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(base_model.config.vocab_size)
    with pytest.raises(ValueError, match="not a multiple of 2 prompts"):
        completion_logprobs(
            base_model, prompt_ids, prompt_mask, completion_ids[:5], completion_mask[:5]
        )


# --------------------------------------------------------------------------- the chunked core
def _core_reference(hidden, weight, bias, targets, scale=1.0, softcap=None):
    logits = F.linear(hidden, weight, bias).to(torch.promote_types(hidden.dtype, torch.float32))
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logp_all = torch.log_softmax(logits * scale, -1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 23),
    hidden_size=st.integers(1, 9),
    vocab=st.integers(1, 40),
    chunk=st.integers(1, 30),
    with_bias=st.booleans(),
    temperature=st.sampled_from([1.0, 0.6, 1.7]),
    softcap=st.sampled_from([None, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_core_matches_full_log_softmax(
    n, hidden_size, vocab, chunk, with_bias, temperature, softcap, seed
):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = (
        torch.randn(vocab, generator=gen, dtype=torch.float64, requires_grad=True)
        if with_bias
        else None
    )
    targets = torch.randint(0, vocab, (n,), generator=gen)
    params = [hidden, weight] + ([bias] if with_bias else [])

    ref_logp, ref_ent = _core_reference(hidden, weight, bias, targets, 1 / temperature, softcap)
    ref = torch.autograd.grad((ref_logp * 1.3).sum() + ref_ent.sum(), params, allow_unused=True)
    logp, ent = token_logprobs(
        hidden,
        weight,
        targets,
        bias=bias,
        chunk_size=chunk,
        with_entropy=True,
        temperature=temperature,
        softcap=softcap,
    )
    assert logp.shape == ent.shape == (n,)
    torch.testing.assert_close(logp, ref_logp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    if n:
        got = torch.autograd.grad((logp * 1.3).sum() + ent.sum(), params, allow_unused=True)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_fused_output_layer_gives_the_checkpointed_values_and_gradients(softcap, with_entropy):
    """A weight (or a plain nn.Linear) takes the fused backward (logits recomputed once and
    turned into the gradient in place); any other module the checkpointed chunk. float32:
    the same values, gradients to 1e-5 of their largest entry."""
    from grpo_core.train.learner.head_logprobs import _linear_head

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 16, generator=gen, requires_grad=True)
    bias = torch.randn(300, generator=gen, requires_grad=True)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 300, (37,), generator=gen)
    kwargs = dict(chunk_size=10, with_entropy=with_entropy, temperature=0.7, softcap=softcap, logit_scale=1.5)
    out = {}
    for fused in (True, False):
        head = weight if fused else (lambda h: F.linear(h, weight, bias))
        logp, ent = token_logprobs(hidden, head, targets, bias=bias if fused else None, **kwargs)
        loss = (logp * torch.linspace(0.5, 1.5, 37)).sum() + (0.3 * ent.sum() if with_entropy else 0)
        out[fused] = (logp, ent, torch.autograd.grad(loss, [hidden, weight, bias]))
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-6, rtol=0)
    if with_entropy:
        torch.testing.assert_close(out[True][1], out[False][1], atol=1e-6, rtol=0)
    for got, want in zip(out[True][2], out[False][2]):
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)
    linear = torch.nn.Linear(16, 300)
    assert _linear_head(weight, bias, hidden.device) == (weight, bias)
    assert _linear_head(linear, None, hidden.device) == (linear.weight, linear.bias)
    assert _linear_head(lambda h: h, None, hidden.device) is None  # a wrapper (LoRA on the head): checkpointed
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _linear_head(weight, bias, hidden.device) is None  # autocast decides the matmul's dtype


def test_core_accepts_a_module_head_and_logit_scale():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, dtype=torch.float64)
    hidden = torch.randn(11, 8, dtype=torch.float64)
    targets = torch.randint(0, 50, (11,))
    logp, ent = token_logprobs(hidden, head, targets, chunk_size=4, logit_scale=0.5)
    assert ent is None
    ref, _ = _core_reference(hidden, head.weight, head.bias, targets, scale=0.5)
    torch.testing.assert_close(logp, ref, atol=1e-12, rtol=0)


def test_logit_transform_reads_known_config_attributes(base_model):
    assert logit_transform(base_model.config) == {"logit_scale": 1.0, "softcap": None}

    class Config:
        final_logit_softcapping = 30.0
        logits_scaling = 4.0

    assert logit_transform(Config()) == {"logit_scale": 0.25, "softcap": 30.0}


class _SizeWatch(TorchDispatchMode):
    """Records the largest output (in elements) of every op, forward or backward, that has
    a ``vocab``-sized dim, leaving out weight-shaped ``(V, H)`` / ``(H, V)`` tensors."""

    def __init__(self, vocab: int, hidden_size: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0
        self.weight_shapes = {(vocab, hidden_size), (hidden_size, vocab)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(t, torch.Tensor)
                and self.vocab in t.shape
                and tuple(t.shape) not in self.weight_shapes
            ):
                self.largest = max(self.largest, t.numel())
        return out


def _saved_tensors(fn):
    """Shapes and storages of every tensor autograd saves for backward while ``fn`` runs."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, saved


def test_core_saves_and_creates_nothing_of_size_n_times_v():
    n, hidden_size, vocab, chunk = 96, 16, 20_000, 8
    torch.manual_seed(0)
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))

    watch = _SizeWatch(vocab, hidden_size)
    with watch:
        (logp, ent), saved = _saved_tensors(
            lambda: token_logprobs(hidden, weight, targets, chunk_size=chunk, with_entropy=True)
        )
        (logp.sum() + ent.sum()).backward()
    # Saved for backward: only the inputs (weight, hidden rows, targets), no logits.
    for t in saved:
        if vocab in t.shape:
            assert t.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr(), t.shape
    # Created at any time, forward or backward: at most one chunk of logits at once.
    assert 0 < watch.largest <= chunk * vocab
    assert weight.grad is not None and hidden.grad is not None


def test_the_watchers_catch_a_full_log_softmax():
    """The two detectors above do see an (N, V) implementation."""
    n, vocab = 32, 1000
    hidden = torch.randn(n, 4, requires_grad=True)
    weight = torch.randn(vocab, 4, requires_grad=True)
    watch = _SizeWatch(vocab, 4)
    with watch:
        _, saved = _saved_tensors(lambda: torch.log_softmax(hidden @ weight.T, -1)[:, 0].sum())
    assert watch.largest == n * vocab
    assert any(t.numel() == n * vocab for t in saved)


def test_completion_logprobs_creates_nothing_of_size_b_t_v(base_model):
    model = _model(base_model, torch.float32)
    batch = _batch(model.config.vocab_size)
    chunk = 4
    watch = _SizeWatch(model.config.vocab_size, model.config.hidden_size)
    with watch:
        logp, entropy = completion_logprobs(model, *batch, chunk_size=chunk, with_entropy=True)
        (logp.sum() + entropy.sum()).backward()
    assert 0 < watch.largest <= chunk * model.config.vocab_size


def test_length_buckets_group_rows_and_skip_empty_ones():
    from grpo_core.train.learner.logprobs import _length_buckets

    groups = _length_buckets(torch.tensor([6, 4, 1, 6, 0, 2]))
    assert [g.tolist() for g in groups] == [[0, 3, 1], [5], [2]]  # 6,6,4 | 2 | 1; row 4 (empty) in none
    assert _length_buckets(torch.tensor([5, 4, 5, 3])) is None  # grouping would save < 20%
    assert _length_buckets(torch.tensor([0, 0])) is None
    many = _length_buckets(torch.tensor([64, 32, 16, 8, 4, 2, 1]))
    assert len(many) == 4 and many[-1].tolist() == [3, 4, 5, 6]  # at most 4 groups


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_length_buckets_give_the_unbucketed_values_and_gradients(base_model, dtype, monkeypatch):
    """Tolerance: the same per-row computation at other batch compositions; float64 to 1e-10,
    float32 to 1e-5 (values) and 1e-5 of the largest gradient entry."""
    from grpo_core.train.learner import logprobs as lp

    model = _model(base_model, dtype)
    batch = _batch(model.config.vocab_size)
    calls, original = [], lp._hidden_bucketed
    monkeypatch.setattr(lp, "_hidden_bucketed", lambda *a, **k: calls.append(1) or original(*a, **k))
    out = {}
    for buckets in (False, True):
        logp, ent = completion_logprobs(model, *batch, with_entropy=True, length_buckets=buckets)
        out[buckets] = (logp, ent, _grads(model, logp.sum() + 0.3 * ent.sum()))
    assert calls == [1]  # only the bucketed call took that path
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out[True][0], out[False][0], atol=tol, rtol=0)
    torch.testing.assert_close(out[True][1], out[False][1], atol=tol, rtol=0)
    for name, grad in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], grad, rtol=0, atol=tol * grad.abs().max())
