"""CISPO, SAPO, GMPO, GPG and REINFORCE against plain-loop references written from their papers,
hand values, limits (SAPO's temperature, GMPO with one token = clip), and equivalences."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins import policy_losses as pl
from grpo_plugins import policy_losses_ext as ext
from grpo_plugins.aggregators import seq_mean_token_mean, token_mean
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.contracts import BatchStats, PolicyLossInputs
from grpo_core.plugin_manager import load_plugins

F64 = torch.float64
NAN = float("nan")
FAST = settings(max_examples=40, deadline=None)


@st.composite
def off_policy(draw, per_row: bool | None = None):
    """(logp (B, T), old_logp (B, T), advantages (B, T), mask (B, T)): ragged rows (some empty),
    log-ratios up to +-1.5, so that every clip and gate is exercised."""
    rows, length = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    logp = -torch.rand(rows, length, generator=gen, dtype=F64) * 3
    old = logp + (torch.rand(rows, length, generator=gen, dtype=F64) * 3 - 1.5)
    row_adv = draw(st.booleans()) if per_row is None else per_row
    adv = torch.randn(rows, 1 if row_adv else length, generator=gen, dtype=F64).expand(rows, length)
    return logp, old, torch.where(mask, adv, 0.0), mask


def loss_and_grad(loss, logp, old, adv, mask):
    leaf = logp.clone().requires_grad_(True)
    out = loss(PolicyLossInputs(leaf, old, adv, mask))
    (grad,) = torch.autograd.grad(out.loss.sum(), leaf)
    return out, grad


def per_token_reference(logp, old, adv, mask, token_fn):
    """Loops over tokens: ``token_fn(lp, old_lp, a) -> (loss, d loss / d lp)``."""
    loss, grad = torch.zeros_like(logp), torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                loss[i, t], grad[i, t] = token_fn(float(logp[i, t]), float(old[i, t]), float(adv[i, t]))
    return loss, grad


def cispo(**o):
    return ext.CISPOPolicyLoss(ext.CISPOOptions(**o))


def sapo(**o):
    return ext.SAPOPolicyLoss(ext.SAPOOptions(**o))


def gmpo(**o):
    return ext.GMPOPolicyLoss(ext.GMPOOptions(**o))


def gpg():
    return ext.GPGPolicyLoss(ext.PolicyGradientOptions())


def reinforce():
    return ext.REINFORCEPolicyLoss(ext.PolicyGradientOptions())


# --------------------------------------------------------------------------- cispo
@FAST
@given(off_policy(), st.sampled_from([(None, 0.2), (0.2, 0.28), (0.5, 0.05)]))
def test_cispo_against_the_paper_loop(batch, eps):
    """MiniMax-M1: J = sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi; no lower clip when eps_low is null."""
    eps_low, eps_high = eps

    def token(lp, old_lp, a):
        r = math.exp(lp - old_lp)
        w = min(max(r, 0.0 if eps_low is None else 1 - eps_low), 1 + eps_high)
        return -w * a * lp, -w * a

    out, grad = loss_and_grad(cispo(eps_low=eps_low, eps_high=eps_high), *batch)
    ref_loss, ref_grad = per_token_reference(*batch, token)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips():
    """r = 1.5 with A > 0: PPO's clip drops the token's gradient; CISPO keeps -1.2 * A."""
    logp, old = torch.tensor([[math.log(1.5)]], dtype=F64), torch.zeros(1, 1, dtype=F64)
    adv, mask = torch.tensor([[2.0]], dtype=F64), torch.ones(1, 1, dtype=torch.bool)
    out, grad = loss_and_grad(cispo(eps_high=0.2), logp, old, adv, mask)
    _, clip_grad = loss_and_grad(pl.ClipPolicyLoss(pl.ClipOptions()), logp, old, adv, mask)
    assert clip_grad.item() == 0.0
    assert grad.item() == pytest.approx(-1.2 * 2.0)
    assert out.metrics["clip/high"].item() == 1.0 and out.metrics["clip/low"].item() == 0.0


# --------------------------------------------------------------------------- sapo
@FAST
@given(off_policy(), st.sampled_from([(1.0, 1.05), (0.5, 2.0), (4.0, 4.0)]))
def test_sapo_against_the_paper_loop(batch, taus):
    """SAPO: f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau by the sign of A; loss -f(r) A."""
    tau_pos, tau_neg = taus

    def token(lp, old_lp, a):
        r, tau = math.exp(lp - old_lp), tau_pos if a > 0 else tau_neg
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        return -s * 4 / tau * a, -4 * s * (1 - s) * r * a

    out, grad = loss_and_grad(sapo(tau_pos=tau_pos, tau_neg=tau_neg), *batch)
    ref_loss, ref_grad = per_token_reference(*batch, token)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


@FAST
@given(off_policy(), st.floats(0.05, 20.0), st.floats(0.05, 20.0))
def test_sapo_at_ratio_one_is_the_vanilla_policy_gradient_for_any_temperature(batch, tau_pos, tau_neg):
    logp, _, adv, mask = batch
    out, grad = loss_and_grad(sapo(tau_pos=tau_pos, tau_neg=tau_neg), logp, logp, adv, mask)
    torch.testing.assert_close(grad, -adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.metrics["gate"], mask.to(F64), rtol=0, atol=1e-15)


def test_sapo_limits_of_the_temperature():
    """tau -> 0: the gate's gradient tends to the unclipped surrogate's -r A; large tau: it
    vanishes away from r = 1 (a hard trust region), while clip would still pass r = 1.1."""
    rho = torch.tensor([[0.5, 0.9, 1.1, 1.7, 3.0]], dtype=F64)
    adv = torch.tensor([[1.0, -2.0, 0.5, -1.0, 2.0]], dtype=F64)
    mask = torch.ones_like(rho, dtype=torch.bool)
    old = torch.zeros_like(rho)
    _, soft = loss_and_grad(sapo(tau_pos=1e-6, tau_neg=1e-6), rho.log(), old, adv, mask)
    torch.testing.assert_close(soft, -adv * rho, rtol=1e-6, atol=0)
    _, hard = loss_and_grad(sapo(tau_pos=400.0, tau_neg=400.0), rho.log(), old, adv, mask)
    assert float(hard.abs().max()) < 1e-10


# --------------------------------------------------------------------------- gmpo
def gmpo_sequence_reference(logp, old, adv_row, mask, eps_low, eps_high):
    """The paper's objective, per sequence by loops: -1/G sum_i A_i exp(1/|o_i| sum_t c_it),
    c_it the log-ratio clipped on the side of sign(A_i)."""
    total = 0.0
    for i in range(logp.shape[0]):
        clipped = []
        for t in range(logp.shape[1]):
            if mask[i, t]:
                lr = logp[i, t] - old[i, t]
                if adv_row[i] > 0 and float(lr.detach()) > eps_high:
                    lr = lr.detach() * 0 + eps_high
                elif adv_row[i] < 0 and float(lr.detach()) < -eps_low:
                    lr = lr.detach() * 0 - eps_low
                clipped.append(lr)
        if clipped:
            total = total - adv_row[i] * torch.exp(sum(clipped) / len(clipped))
    return total / logp.shape[0]


@FAST
@given(off_policy(per_row=True), st.sampled_from([(0.4, 0.4), (0.1, 0.3)]))
def test_gmpo_token_form_with_seq_mean_token_mean_is_the_paper_objective(batch, eps):
    logp, old, adv, mask = batch
    stats = BatchStats(int(mask.sum()), mask.shape[0], mask.shape[1])
    loss = gmpo(eps_low=eps[0], eps_high=eps[1])
    leaf = logp.clone().requires_grad_(True)
    value = seq_mean_token_mean(loss(PolicyLossInputs(leaf, old, adv, mask)).loss, mask, stats)
    (grad,) = torch.autograd.grad(value, leaf)
    leaf_ref = logp.clone().requires_grad_(True)
    ref = gmpo_sequence_reference(leaf_ref, old, adv[:, 0], mask, *eps)
    ref_grad = torch.autograd.grad(ref, leaf_ref)[0] if torch.is_tensor(ref) and ref.requires_grad else 0 * logp
    torch.testing.assert_close(value, torch.as_tensor(ref, dtype=F64).detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


@FAST
@given(st.floats(-1.5, 1.5), st.floats(-3, 3).filter(lambda a: abs(a) > 1e-3),
       st.sampled_from([(0.4, 0.4), (0.1, 0.3)]))
def test_gmpo_with_one_token_is_ppo_clip_with_the_log_space_range(log_ratio, a, eps):
    """One token: s = the clipped ratio, so GMPO is PPO clip at eps_low' = 1 - e^-eps_low,
    eps_high' = e^eps_high - 1 (loss and gradient)."""
    eps_low, eps_high = eps
    if min(abs(log_ratio - eps_high), abs(log_ratio + eps_low)) < 1e-6:
        log_ratio = 0.0  # off the boundaries, where either side is a valid subgradient
    batch = (torch.tensor([[log_ratio]], dtype=F64), torch.zeros(1, 1, dtype=F64),
             torch.tensor([[a]], dtype=F64), torch.ones(1, 1, dtype=torch.bool))
    out, grad = loss_and_grad(gmpo(eps_low=eps_low, eps_high=eps_high), *batch)
    clip = pl.ClipPolicyLoss(pl.ClipOptions(eps_low=1 - math.exp(-eps_low), eps_high=math.exp(eps_high) - 1))
    ref, ref_grad = loss_and_grad(clip, *batch)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(out.metrics["clip/region"], ref.metrics["clip/region"])


def test_gmpo_hand_values():
    # row 0, A = 1: log-ratios 0.2 and 0.6 -> 0.6 clipped to 0.4 (no gradient); s = exp(0.3)
    # row 1, A = -1: log-ratios -0.8 (clipped to -0.4) and 0.0; s = exp(-0.2)
    logp = torch.tensor([[0.2, 0.6], [-0.8, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=F64)
    out, grad = loss_and_grad(gmpo(), logp, torch.zeros_like(logp), adv, torch.ones(2, 2, dtype=torch.bool))
    s0, s1 = math.exp(0.3), math.exp(-0.2)
    torch.testing.assert_close(out.loss, torch.tensor([[-s0, -s0], [s1, s1]], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[-s0, 0.0], [0.0, s1]], dtype=F64))
    assert out.metrics["clip/region"].tolist() == [[0.0, 1.0], [1.0, 0.0]]


# --------------------------------------------------------------------------- gpg, reinforce
@FAST
@given(off_policy(), st.sampled_from([token_mean, seq_mean_token_mean]))
def test_gpg_and_reinforce_are_minus_a_logp_and_equal_clip_at_ratio_one(batch, aggregate):
    logp, old, adv, mask = batch
    stats = BatchStats(int(mask.sum()), mask.shape[0], mask.shape[1])
    g_out, g_grad = loss_and_grad(gpg(), logp, old, adv, mask)
    r_out, r_grad = loss_and_grad(reinforce(), logp, old, adv, mask)
    ref_loss, ref_grad = per_token_reference(logp, old, adv, mask, lambda lp, _, a: (-a * lp, -a))
    torch.testing.assert_close(g_out.loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(g_out.loss, r_out.loss) and torch.equal(g_grad, r_grad)
    # the old log-probs do not enter the gradient: no ratio
    _, moved = loss_and_grad(gpg(), logp, old - 5.0, adv, mask)
    assert torch.equal(moved, g_grad)

    def aggregated(loss, old_logp):
        leaf = logp.clone().requires_grad_(True)
        value = aggregate(loss(PolicyLossInputs(leaf, old_logp, adv, mask)).loss, mask, stats)
        return torch.autograd.grad(value, leaf)[0]

    # with mu = 1 (old = logp), every loss here gives the vanilla policy gradient: GPG = clip = CISPO = SAPO
    same = logp.detach()
    for other in (pl.ClipPolicyLoss(pl.ClipOptions()), cispo(), sapo(), gmpo()):
        if other.__class__ is ext.GMPOPolicyLoss and aggregate is not seq_mean_token_mean:
            continue  # GMPO's gradient at ratio 1 is the sequence-mean one
        torch.testing.assert_close(aggregated(gpg(), same), aggregated(other, same), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- shared properties
ALL = {"cispo": cispo, "sapo": sapo, "gmpo": gmpo, "gpg": gpg, "reinforce": reinforce}


@pytest.mark.parametrize("name", list(ALL))
def test_padding_inf_nan_never_leaks(name):
    loss = ALL[name]()
    logp = torch.tensor([[-0.5, -math.inf, NAN], [-1.0, math.inf, -math.inf]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-0.6, NAN, -math.inf], [-1.1, -math.inf, NAN]], dtype=F64)
    adv = torch.tensor([[1.0, NAN, math.inf], [-1.0, 2.0, NAN]], dtype=F64)
    mask = torch.tensor([[True, False, False], [True, False, False]])
    out = loss(PolicyLossInputs(logp, old, adv, mask))
    assert torch.equal(out.loss[~mask], torch.zeros(4, dtype=F64)) and torch.isfinite(out.loss).all()
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    assert torch.isfinite(grad).all() and torch.equal(grad[~mask], torch.zeros(4, dtype=F64))
    for metric, value in out.metrics.items():
        assert value.shape == mask.shape and not value.requires_grad, metric
        assert torch.equal(value[~mask], torch.zeros(4, dtype=F64)), metric


@pytest.mark.parametrize("name", list(ALL))
def test_zero_advantage_is_zero_loss(name):
    loss = ALL[name]()
    assert type(loss).zero_advantage_is_zero_loss is True
    logp = torch.tensor([[-0.1, -4.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-3.0, -0.5, -2.0]], dtype=F64)
    out = loss(PolicyLossInputs(logp, old, torch.zeros(1, 3, dtype=F64), torch.ones(1, 3, dtype=torch.bool)))
    assert torch.equal(out.loss, torch.zeros(1, 3, dtype=F64))
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    assert torch.equal(grad, torch.zeros(1, 3, dtype=F64))


def test_registered_and_buildable():
    registry = load_plugins(external=False).registry
    logp = torch.tensor([[-0.5, -1.0]], dtype=F64)
    batch = PolicyLossInputs(logp, logp - 0.01, torch.ones(1, 2, dtype=F64), torch.ones(1, 2, dtype=torch.bool))
    for name, impl, options in [
        ("cispo", ext.CISPOPolicyLoss, ext.CISPOOptions), ("sapo", ext.SAPOPolicyLoss, ext.SAPOOptions),
        ("gmpo", ext.GMPOPolicyLoss, ext.GMPOOptions), ("gpg", ext.GPGPolicyLoss, ext.PolicyGradientOptions),
        ("reinforce", ext.REINFORCEPolicyLoss, ext.PolicyGradientOptions),
    ]:
        component = registry.get("policy_loss", name)
        assert component.impl is impl and component.options is options
        assert component.plugin == "grpo_plugins.policy_losses_ext"
        out = component.build(options())(batch)
        assert out.loss.shape == (1, 2) and (out.loss != 0).all() and {"ratio", "ratio/max"} <= set(out.metrics)


@pytest.mark.parametrize("model, kwargs, message", [
    (ext.CISPOOptions, {"eps": 0.2}, "Extra inputs are not permitted"),
    (ext.CISPOOptions, {"eps_low": 1.0}, "eps_low must be in \\(0, 1\\).*or null"),
    (ext.CISPOOptions, {"eps_high": 0.0}, "eps_high must be a positive finite number"),
    (ext.SAPOOptions, {"tau_pos": 0.0}, "tau_pos must be a positive finite number \\(a temperature\\)"),
    (ext.SAPOOptions, {"tau_neg": math.inf}, "tau_neg must be a positive finite number"),
    (ext.SAPOOptions, {"log_ratio_clamp": -1.0}, "log_ratio_clamp must be a positive finite number.*or null"),
    (ext.GMPOOptions, {"eps_low": -0.4}, "eps_low must be a positive finite number \\(a bound in log space\\)"),
    (ext.PolicyGradientOptions, {"eps_low": 0.2}, "Extra inputs are not permitted"),
])
def test_options_invalid_values_say_what_is_valid(model, kwargs, message):
    with pytest.raises(ValidationError, match=message):
        model(**kwargs)


def test_option_descriptions_cite_their_papers():
    for model, paper in [(ext.CISPOOptions, "2506.13585"), (ext.SAPOOptions, "2511.20347"),
                         (ext.GMPOOptions, "2507.20673")]:
        assert any(paper in (f.description or "") for f in model.model_fields.values()), model
        assert all(f.description for f in model.model_fields.values()), model
    assert "2504.02546" in ext.PolicyGradientOptions.__doc__
