"""``clip`` and ``gspo``: the vanilla policy gradient at ratio 1, where clipping zeroes the gradient,
dual clip, asymmetric eps, the metrics by hand, the log-ratio clamp; GSPO's sequence ratio by hand,
its token form against the sequence objective, whole sequences clipped, the clamp cutting the gradient."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins.aggregators import seq_mean_token_mean, token_mean
from grpo_plugins.losses.clip import ClipOptions, ClipPolicyLoss, GSPOOptions, GSPOPolicyLoss, sequence_log_ratio
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.contracts import BatchStats, PolicyLossInputs

from .conftest import F64, FAST, NAN, batches, grad_of, per_token_grad


def clip(**options):
    return ClipPolicyLoss(ClipOptions(**options))


def gspo(**options):
    return GSPOPolicyLoss(GSPOOptions(**options))


@FAST
@given(
    batches(),
    st.sampled_from([token_mean, seq_mean_token_mean]),
    st.sampled_from([{}, {"eps_high": 0.28}, {"dual_clip": 3.0}]),
)
def test_clip_at_ratio_one_is_vanilla_policy_gradient(batch, aggregate, options):
    logp, adv, mask = batch
    stats = BatchStats(int(mask.sum()), mask.shape[0], mask.shape[1])
    loss = clip(**options)

    def clipped(leaf):
        return aggregate(loss(PolicyLossInputs(leaf, leaf.detach(), adv, mask)).loss, mask, stats)

    def vanilla(leaf):
        return aggregate(-adv * leaf, mask, stats)

    value, grad = grad_of(clipped, logp)
    _, expected_grad = grad_of(vanilla, logp)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(value, aggregate(-adv, mask, stats), rtol=1e-12, atol=1e-12)


@FAST
@given(
    st.lists(
        st.tuples(st.floats(0.3, 2.5), st.floats(0.1, 3.0), st.booleans()), min_size=1, max_size=16
    ),
    st.sampled_from([(0.2, None), (0.2, 0.28), (0.1, 0.5)]),
)
def test_clip_gradient_zero_exactly_outside_trust_region_on_the_advantage_side(tokens, eps):
    eps_low, eps_high = eps
    high = eps_low if eps_high is None else eps_high
    rho = torch.tensor([t[0] for t in tokens], dtype=F64)[None]
    adv = torch.tensor([t[1] * (1 if t[2] else -1) for t in tokens], dtype=F64)[None]
    # keep clear of the boundaries, where either side is a valid subgradient
    near = ((rho - (1 + high)).abs() < 1e-6) | ((rho - (1 - eps_low)).abs() < 1e-6)
    rho = torch.where(near, torch.ones_like(rho), rho)
    out, grad = per_token_grad(clip(eps_low=eps_low, eps_high=eps_high), rho.log(), adv)
    clipped = ((adv > 0) & (rho > 1 + high)) | ((adv < 0) & (rho < 1 - eps_low))
    assert torch.equal(grad[clipped], torch.zeros(int(clipped.sum()), dtype=F64))
    # elsewhere the unclipped term is active: d(-A rho)/d logp = -A rho, never zero
    torch.testing.assert_close(grad[~clipped], (-adv * rho)[~clipped], rtol=1e-12, atol=0)
    assert torch.equal(out.metrics["clip/region"], clipped.to(F64))


def test_clip_hand_values_and_asymmetric_eps():
    rho = torch.tensor([[1.25, 1.25, 0.75, 1.1]], dtype=F64)
    adv = torch.tensor([[2.0, -2.0, -1.0, 3.0]], dtype=F64)
    symmetric, grad_s = per_token_grad(clip(), rho.log(), adv)
    higher, grad_h = per_token_grad(clip(eps_high=0.28), rho.log(), adv)
    # A>0, rho 1.25: clipped at 1.2 with eps_high = eps_low = 0.2, free with 0.28
    torch.testing.assert_close(symmetric.loss, torch.tensor([[-2.4, 2.5, 0.8, -3.3]], dtype=F64))
    torch.testing.assert_close(higher.loss, torch.tensor([[-2.5, 2.5, 0.8, -3.3]], dtype=F64))
    assert grad_s[0, 0] == 0 and grad_h[0, 0] != 0
    # A<0, rho 0.75 < 1 - eps_low: clipped either way (eps_high does not touch the low side)
    assert grad_s[0, 2] == 0 and grad_h[0, 2] == 0
    assert symmetric.metrics["clip/high"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert higher.metrics["clip/high"].tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_clip_dual_clip_caps_negative_advantage_loss():
    rho = torch.tensor([[5.0, 2.0, 5.0, 0.5]], dtype=F64)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=F64)
    plain, grad_p = per_token_grad(clip(), rho.log(), adv)
    dual, grad_d = per_token_grad(clip(dual_clip=3.0), rho.log(), adv)
    torch.testing.assert_close(plain.loss, torch.tensor([[5.0, 2.0, -1.2, 0.8]], dtype=F64))
    # rho 5 > c = 3 with A < 0: loss capped at -c A = 3, no gradient; the rest unchanged
    torch.testing.assert_close(dual.loss, torch.tensor([[3.0, 2.0, -1.2, 0.8]], dtype=F64))
    assert grad_p[0, 0] != 0 and grad_d[0, 0] == 0
    torch.testing.assert_close(grad_d[0, 1:], grad_p[0, 1:])
    assert dual.metrics["clip/dual"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert "clip/dual" not in plain.metrics


def test_clip_metrics_by_hand():
    log_ratio = torch.tensor(
        [[math.log(1.5), math.log(0.5), math.log(1.5), math.log(0.5), 0.0, 7.0]], dtype=F64
    )
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, 5.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, True, True, False]])
    out = clip()(PolicyLossInputs(log_ratio, torch.zeros_like(log_ratio), adv, mask))
    m = {k: v.tolist()[0] for k, v in out.metrics.items()}
    assert m["clip/high"] == [1, 0, 0, 0, 0, 0]
    assert m["clip/low"] == [0, 1, 0, 0, 0, 0]
    assert m["clip/region"] == [1, 1, 0, 0, 0, 0]
    torch.testing.assert_close(
        out.metrics["ratio"], torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.0, 0.0]], dtype=F64)
    )
    assert torch.equal(out.metrics["ratio/max"], out.metrics["ratio"])
    assert all(v.shape == (1, 6) and not v.requires_grad for v in out.metrics.values())


def test_log_ratio_clamp_keeps_float32_finite():
    logp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-200.0]])
    adv = torch.tensor([[-1.0]])
    out = clip()(PolicyLossInputs(logp, old, adv, torch.ones(1, 1, dtype=torch.bool)))
    assert out.loss.item() == pytest.approx(math.exp(20.0), rel=1e-5)
    unclamped = clip(log_ratio_clamp=None)(
        PolicyLossInputs(logp, old, adv, torch.ones(1, 1, dtype=torch.bool))
    )
    assert math.isinf(unclamped.loss.item())


def test_clip_option_defaults():
    assert ClipOptions().high == 0.2 and ClipOptions(eps_high=0.28).high == 0.28


# --------------------------------------------------------------------------- gspo
def test_gspo_sequence_ratio_by_hand():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]], dtype=F64)
    old = torch.tensor([[-1.1, -2.3, 5.0], [-0.9, -1.0, -1.2], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    adv = torch.tensor([[1.0], [-1.0], [0.0]], dtype=F64).expand(3, 3)
    out = gspo(eps_low=0.5, eps_high=0.5)(PolicyLossInputs(logp, old, adv, mask))
    s0, s1 = math.exp((0.1 + 0.3) / 2), math.exp((-0.1 + 0.0 + 0.2) / 3)
    expected_ratio = torch.tensor([[s0, s0, 0.0], [s1, s1, s1], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out.metrics["ratio"], expected_ratio)
    torch.testing.assert_close(out.loss, -adv * expected_ratio)


def test_gspo_empty_row_has_log_ratio_zero_not_nan():
    logp = torch.tensor([[-1.0, -2.0], [NAN, -math.inf]], dtype=F64)
    old = torch.tensor([[-1.5, -2.5], [-1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[True, True], [False, False]])
    assert sequence_log_ratio(logp, old, mask).tolist() == [0.5, 0.0]


@FAST
@given(batches())
def test_gspo_at_ratio_one_is_seq_mean_vanilla_policy_gradient(batch):
    logp, adv, mask = batch
    stats = BatchStats(int(mask.sum()), mask.shape[0], mask.shape[1])
    loss = gspo()

    def gspo_loss(leaf):
        return seq_mean_token_mean(
            loss(PolicyLossInputs(leaf, leaf.detach(), adv, mask)).loss, mask, stats
        )

    def vanilla(leaf):
        return seq_mean_token_mean(-adv * leaf, mask, stats)

    _, grad = grad_of(gspo_loss, logp)
    _, expected = grad_of(vanilla, logp)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


@FAST
@given(batches(), st.integers(0, 2**31 - 1))
def test_gspo_token_form_equals_sequence_objective(batch, seed):
    """Inside the clip range, the token form aggregated with seq-mean-token-mean has the
    gradient of GSPO's sequence objective -1/S sum_i A_i s_i(theta)."""
    logp, adv, mask = batch
    adv = adv[:, :1].expand_as(adv) * mask  # a per-sequence advantage
    gen = torch.Generator().manual_seed(seed)
    old = logp + 0.1 * torch.randn(logp.shape, generator=gen, dtype=F64)
    stats = BatchStats(int(mask.sum()), mask.shape[0], mask.shape[1])
    loss = gspo(eps_low=0.9, eps_high=10.0)  # nothing clips at log-ratios of ~0.1

    def token_form(leaf):
        return seq_mean_token_mean(loss(PolicyLossInputs(leaf, old, adv, mask)).loss, mask, stats)

    def sequence_form(leaf):
        lengths = mask.sum(1).clamp(min=1)
        s = torch.exp(torch.where(mask, leaf - old, 0.0).sum(1) / lengths)
        return -(adv[:, 0] * s).sum() / stats.num_sequences

    value, grad = grad_of(token_form, logp)
    expected_value, expected = grad_of(sequence_form, logp)
    torch.testing.assert_close(value, expected_value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def test_gspo_clips_whole_sequences():
    # row 0: token ratios 1.3 and 0.9 -> s = sqrt(1.17) ~ 1.0817 > 1 + 0.05 with A > 0: clipped
    # row 1: same tokens, A < 0: not clipped on this side; row 2: s = 1, free
    tok = torch.tensor([[math.log(1.3), math.log(0.9)]], dtype=F64).expand(3, 2)
    logp = tok.clone().requires_grad_(True)
    adv = torch.tensor([[1.0], [-1.0], [1.0]], dtype=F64).expand(3, 2)
    old = torch.stack([torch.zeros(2), torch.zeros(2), tok[2]]).to(F64)
    out = gspo(eps_low=0.05, eps_high=0.05)(
        PolicyLossInputs(logp, old, adv, torch.ones(3, 2, dtype=torch.bool))
    )
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    s = math.sqrt(1.3 * 0.9)
    assert torch.equal(grad[0], torch.zeros(2, dtype=F64))
    torch.testing.assert_close(grad[1], torch.full((2,), s, dtype=F64))
    torch.testing.assert_close(grad[2], torch.full((2,), -1.0, dtype=F64))
    assert out.metrics["clip/high"].tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert out.metrics["clip/region"].tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    torch.testing.assert_close(out.loss[0], torch.full((2,), -1.05, dtype=F64))


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_gspo_log_ratio_clamp_cuts_the_gradient_like_clip(dtype):
    """Issue 28's row: one token, logp 0, old_logp -15, A = -1, log_ratio_clamp 10. Before the
    fix gspo clamped only the detached log s_i: loss e^10 = 22026.5 and d loss/d logp 22026.5;
    clip gives the same loss and gradient 0. Both now give 22026.5 and exactly 0."""
    old = torch.tensor([[-15.0]], dtype=dtype)
    adv = torch.tensor([[-1.0]], dtype=dtype)
    mask = torch.ones(1, 1, dtype=torch.bool)
    for loss in (gspo(log_ratio_clamp=10.0), clip(log_ratio_clamp=10.0)):
        logp = torch.zeros(1, 1, dtype=dtype, requires_grad=True)
        out = loss(PolicyLossInputs(logp, old, adv, mask))
        (grad,) = torch.autograd.grad(out.loss.sum(), logp)
        assert out.loss.item() == pytest.approx(math.exp(10.0), rel=1e-6)  # 22026.47
        assert grad.item() == 0.0
    # inside the clamp the gradient is GSPO's s_i * (-A) per token: unchanged by the fix
    logp = torch.zeros(1, 1, dtype=dtype, requires_grad=True)
    out = gspo(log_ratio_clamp=20.0)(PolicyLossInputs(logp, old, adv, mask))
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    assert grad.item() == pytest.approx(math.exp(15.0), rel=1e-5)


def test_gspo_clamp_description_says_the_gradient_is_cut():
    text = GSPOOptions.model_fields["log_ratio_clamp"].description
    assert "token-form" in text and "no gradient" in text


def test_gspo_option_defaults():
    g = GSPOOptions()
    assert (g.eps_low, g.eps_high, g.high) == (3e-4, 4e-4, 4e-4)
    assert GSPOOptions(eps_high=None).high == 3e-4
