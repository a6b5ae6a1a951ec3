"""KL penalties: hand values, non-negativity, unbiasedness by sampling, padding, clamps."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins import kl as klmod
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.plugin_manager import load_plugins

F64 = torch.float64
FAST = settings(max_examples=60, deadline=None)
ALL = {"low_var_kl": klmod.LowVarKL, "kl": klmod.K1KL, "abs": klmod.AbsKL, "mse": klmod.MseKL,
       "k1+": klmod.K1PlusKL, "k3+": klmod.K3PlusKL}
NON_NEGATIVE = ["low_var_kl", "abs", "mse", "k3+"]


def build(name: str, **options):
    cls = ALL[name]
    model = klmod.LowVarKLOptions if cls in (klmod.LowVarKL, klmod.K3PlusKL) else klmod.KLOptions
    return cls(model(**options))


def full(shape):
    return torch.ones(shape, dtype=torch.bool)


# --------------------------------------------------------------------------- hand values
def test_hand_values():
    logp = torch.tensor([[math.log(0.5), 0.0]], dtype=F64)
    ref = torch.tensor([[math.log(0.25), -1.0]], dtype=F64)
    mask = full(logp.shape)
    d = logp - ref  # log 2, 1
    # k3 = exp(ref - logp) - (ref - logp) - 1
    expected_k3 = torch.tensor([[0.5 + math.log(0.5) * -1 - 1, math.exp(-1) + 1 - 1]], dtype=F64)
    torch.testing.assert_close(build("low_var_kl")(logp, ref, mask), expected_k3)
    torch.testing.assert_close(build("kl")(logp, ref, mask), d)
    torch.testing.assert_close(build("abs")(logp, ref, mask), d.abs())
    torch.testing.assert_close(build("mse")(logp, ref, mask), 0.5 * d**2)
    # the other sign: logp = 0, ref = 1 -> e - 1 - 1
    k3 = build("low_var_kl")(
        torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=F64), full((1, 1))
    )
    torch.testing.assert_close(k3, torch.tensor([[math.e - 2]], dtype=F64))
    k1 = build("kl")(torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=F64), full((1, 1)))
    assert k1.item() == -1.0  # k1 can be negative


# --------------------------------------------------------------------------- invariants
logps = st.lists(st.floats(-40.0, 0.0), min_size=1, max_size=12)


@FAST
@given(logps, logps, st.sampled_from(NON_NEGATIVE), st.booleans())
def test_non_negative_estimators(a, b, name, clamps):
    n = min(len(a), len(b))
    logp = torch.tensor(a[:n], dtype=F64)[None]
    ref = torch.tensor(b[:n], dtype=F64)[None]
    options = {} if clamps else {"log_ratio_clamp": None, "output_clamp": None}
    out = build(name, **options)(logp, ref, full(logp.shape))
    assert (out >= 0).all()


@FAST
@given(logps, st.sampled_from(NON_NEGATIVE), st.sampled_from([torch.float32, F64]))
def test_zero_where_logps_equal(a, name, dtype):
    logp = torch.tensor(a, dtype=dtype)[None]
    out = build(name)(logp, logp.clone(), full(logp.shape))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("name", list(ALL))
def test_zero_on_padding_with_inf_and_nan(name):
    logp = torch.tensor([[-0.5, -math.inf, math.nan], [-1.0, -2.0, math.inf]], dtype=F64)
    ref = torch.tensor([[-0.7, math.nan, -math.inf], [-1.5, math.inf, -math.inf]], dtype=F64)
    mask = torch.tensor([[True, False, False], [True, True, False]])
    # the valid (1, 1) position has ref = inf: exercise only the padded ones
    ref[1, 1] = -2.5
    logp.requires_grad_(True)
    out = build(name)(logp, ref, mask)
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    assert torch.isfinite(out).all()
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[~mask], torch.zeros(int((~mask).sum()), dtype=F64))


# --------------------------------------------------------------------------- unbiasedness
P = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)  # the policy
Q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=F64)  # the reference


@pytest.mark.parametrize("name", ["kl", "low_var_kl"])
def test_unbiased_estimators_recover_true_kl_by_sampling(name):
    """Tokens drawn from pi: the mean of k1 (and k3) approximates KL(pi || pi_ref).

    The tolerance is 5 standard errors of the sample mean, with the standard deviation of
    the per-token estimate computed exactly from the two distributions: a correct
    estimator fails with probability < 1e-6, while a sign error or the reverse KL
    (KL(ref || pi) = 0.2263 vs KL(pi || ref) = 0.2049 here) is 20+ errors away.
    """
    n = 200_000
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.multinomial(P, n, replacement=True, generator=gen)
    logp, ref = P.log()[tokens][None], Q.log()[tokens][None]
    estimate = build(name, log_ratio_clamp=None, output_clamp=None)(
        logp, ref, full(logp.shape)
    ).mean()
    true_kl = (P * (P / Q).log()).sum()
    per_token = build(name)(P.log()[None], Q.log()[None], full((1, 4)))[0]
    sd = ((P * (per_token - true_kl) ** 2).sum()).sqrt()
    assert abs(estimate - true_kl) < 5 * sd / math.sqrt(n)
    reverse = (Q * (Q / P).log()).sum()
    assert abs(reverse - true_kl) > 20 * sd / math.sqrt(n)


# --------------------------------------------------------------------------- clamps
def test_k3_default_clamps_keep_float32_finite():
    logp = torch.tensor([[-100.0, -0.1]], requires_grad=True)
    ref = torch.tensor([[0.0, -0.2]])
    mask = full(logp.shape)
    out = build("low_var_kl")(logp, ref, mask)
    assert out[0, 0].item() == 10.0  # output clamp (exp(20) - 21 > 10)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert grad[0, 0].item() == 0.0 and grad[0, 1].item() != 0.0
    unclamped = build("low_var_kl", log_ratio_clamp=None, output_clamp=None)(logp, ref, mask)
    assert math.isinf(unclamped[0, 0].item())  # why the log-ratio clamp exists


def test_log_ratio_clamp_without_output_clamp():
    logp, ref = torch.tensor([[-30.0]], dtype=F64), torch.tensor([[0.0]], dtype=F64)
    out = build("low_var_kl", output_clamp=None)(logp, ref, full((1, 1)))
    torch.testing.assert_close(out, torch.tensor([[math.exp(20.0) - 21.0]], dtype=F64))
    # k1 = logp - ref = -30: clamped to -5, then to -2 by the output clamp
    out = build("kl", log_ratio_clamp=5.0, output_clamp=2.0)(logp, ref, full((1, 1)))
    assert out.item() == -2.0
    out = build("kl", log_ratio_clamp=5.0)(ref, logp, full((1, 1)))
    assert out.item() == 5.0


# --------------------------------------------------------------------------- registration
EXPECTED = {
    "low_var_kl": klmod.LowVarKL,
    "k3": klmod.LowVarKL,
    "kl": klmod.K1KL,
    "k1": klmod.K1KL,
    "abs": klmod.AbsKL,
    "mse": klmod.MseKL,
    "k2": klmod.MseKL,
    "k1+": klmod.K1PlusKL,
    "k3+": klmod.K3PlusKL,
}


def test_kl_penalties_registered_and_buildable():
    registry = load_plugins(external=False).registry
    logp = torch.tensor([[-0.5, -1.0]], dtype=F64)
    ref = torch.tensor([[-1.0, -0.25]], dtype=F64)
    for name, cls in EXPECTED.items():
        component = registry.get("kl_penalty", name)
        assert component.impl is cls and component.plugin == "grpo_plugins.kl"
        out = component.build(component.options())(logp, ref, full((1, 2)))
        assert out.shape == (1, 2) and (out != 0).all(), name
    assert registry.get("kl_penalty", "k3").options is klmod.LowVarKLOptions
    assert registry.get("kl_penalty", "k3+").options is klmod.LowVarKLOptions
    assert klmod.LowVarKLOptions().log_ratio_clamp == 20.0
    assert klmod.LowVarKLOptions().output_clamp == 10.0
    assert klmod.KLOptions().log_ratio_clamp is None and klmod.KLOptions().output_clamp is None


@pytest.mark.parametrize("model", [klmod.KLOptions, klmod.LowVarKLOptions])
def test_options_validation(model):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        model(clamp=3)
    for field in ("log_ratio_clamp", "output_clamp"):
        for bad in (0.0, -1.0, math.inf):
            with pytest.raises(
                ValidationError, match=f"{field} must be a positive finite number.*or null"
            ):
                model(**{field: bad})
        assert getattr(model(**{field: None}), field) is None


# --------------------------------------------------------------------------- straight-through k1+ / k3+
@FAST
@given(st.lists(st.tuples(st.floats(-15.0, 0.0), st.floats(-15.0, 0.0)), min_size=1, max_size=12))
def test_plus_estimators_have_the_value_of_k1_k3_and_the_gradient_of_k2(pairs):
    logp = torch.tensor([[a for a, _ in pairs]], dtype=F64)
    ref = torch.tensor([[b for _, b in pairs]], dtype=F64)
    mask = full(logp.shape)
    for plus, value_of in (("k1+", "kl"), ("k3+", "low_var_kl")):
        leaf = logp.clone().requires_grad_(True)
        out = build(plus, log_ratio_clamp=None, output_clamp=None)(leaf, ref, mask)
        torch.testing.assert_close(out.detach(), build(value_of, log_ratio_clamp=None, output_clamp=None)(
            logp, ref, mask), rtol=1e-12, atol=1e-12)
        (grad,) = torch.autograd.grad(out.sum(), leaf)
        # d/dlogp of k2 = 0.5 (logp - ref)^2 is logp - ref, token by token
        torch.testing.assert_close(grad, logp - ref, rtol=1e-12, atol=1e-12)


def test_plus_estimators_give_the_true_kl_gradient_in_expectation():
    """Exact expectation over a 4-token softmax policy pi_theta: sum_x pi(x) grad est(x) is the
    gradient of KL(pi || ref) for k2 and so for k1+ / k3+ (the point of the straight-through),
    while plain k1's is 0 and plain k3's is the gradient of the reverse KL."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.0], dtype=F64, requires_grad=True)
    ref = Q.log()[None]

    def expected_grad(name):
        logp = torch.log_softmax(theta, dim=0)[None]
        est = build(name, log_ratio_clamp=None, output_clamp=None)(logp, ref, full((1, 4)))
        (grad,) = torch.autograd.grad((logp.detach().exp() * est).sum(), theta)
        return grad

    logp = torch.log_softmax(theta, dim=0)
    (true_grad,) = torch.autograd.grad((logp.exp() * (logp - Q.log())).sum(), theta)
    for name in ("k1+", "k3+", "mse"):
        torch.testing.assert_close(expected_grad(name), true_grad, rtol=1e-12, atol=1e-12)
    assert torch.allclose(expected_grad("kl"), torch.zeros(4, dtype=F64), atol=1e-15)
    assert (expected_grad("low_var_kl") - true_grad).abs().max() > 1e-2


def test_k3_plus_clamp_bounds_the_value_and_keeps_the_k2_gradient():
    """k3+ is the value of k3 and the gradient of k2 (verl 0.9.1 ``core_algos.kl_penalty``: the
    clamped k3 value is detached, the k2 surrogate is not clamped). At logp -3, ref 0, k3 is
    e^3 - 4 = 16.1, clamped to 10, and the gradient stays k2's, logp - ref = -3; plain k3
    (low_var_kl) gets gradient 0 there."""
    logp = torch.tensor([[-3.0, -100.0, -0.1]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[0.0, 0.0, -0.2]], dtype=F64)
    out = build("k3+")(logp, ref, full((1, 3)))
    assert out[0, 0].item() == 10.0 and out[0, 1].item() == 10.0  # verl's output clamp on k3's value
    assert out[0, 2].item() == pytest.approx(math.exp(-0.1) + 0.1 - 1, rel=1e-12)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert grad[0].tolist() == pytest.approx([-3.0, -100.0, 0.1], rel=1e-12)
    (k3_grad,) = torch.autograd.grad(build("low_var_kl")(logp, ref, full((1, 3))).sum(), logp)
    assert k3_grad[0, 0].item() == 0.0 and k3_grad[0, 1].item() == 0.0


@FAST
@given(st.lists(st.tuples(st.floats(-40.0, 0.0), st.floats(-40.0, 0.0)), min_size=1, max_size=12),
       st.sampled_from([(20.0, 10.0), (1.0, None), (None, 0.5), (3.0, 2.0)]))
def test_plus_estimators_clamp_the_value_only(pairs, clamps):
    """Whatever the clamps: the value of k1+ / k3+ is that of k1 / k3 with those clamps, and the
    gradient is k2's (logp - ref) on every token."""
    log_ratio_clamp, output_clamp = clamps
    logp = torch.tensor([[a for a, _ in pairs]], dtype=F64)
    ref = torch.tensor([[b for _, b in pairs]], dtype=F64)
    mask = full(logp.shape)
    for plus, value_of in (("k1+", klmod.K1KL), ("k3+", klmod.LowVarKL)):
        leaf = logp.clone().requires_grad_(True)
        opts = dict(log_ratio_clamp=log_ratio_clamp, output_clamp=output_clamp)
        out = build(plus, **opts)(leaf, ref, mask)
        expected = value_of(klmod.LowVarKLOptions(**opts))(logp, ref, mask)
        torch.testing.assert_close(out.detach(), expected, rtol=1e-12, atol=1e-12)
        (grad,) = torch.autograd.grad(out.sum(), leaf)
        torch.testing.assert_close(grad, logp - ref, rtol=1e-12, atol=1e-12)
