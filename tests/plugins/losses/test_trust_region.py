"""``cispo``, ``sapo``, ``gmpo`` and ``dppo`` against plain-loop references written from their papers:
CISPO's kept gradient where PPO's clip drops it, SAPO's vanilla gradient at ratio 1 and the limits of
its temperature, GMPO's token form against the paper's sequence objective and its one-token case
(PPO's clip with the log-space range), DPPO's TV and binary-KL trust regions."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins.aggregators import seq_mean_token_mean
from grpo_plugins.losses.clip import ClipOptions, ClipPolicyLoss
from grpo_plugins.losses.trust_region import (
    CISPOOptions,
    CISPOPolicyLoss,
    DPPOOptions,
    DPPOPolicyLoss,
    GMPOOptions,
    GMPOPolicyLoss,
    SAPOOptions,
    SAPOPolicyLoss,
)
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.contracts import BatchStats, PolicyLossInputs

from .conftest import F64, FAST, loss_and_grad, off_policy, per_token_reference


# --------------------------------------------------------------------------- cispo
def cispo(**o):
    return CISPOPolicyLoss(CISPOOptions(**o))


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
    _, clip_grad = loss_and_grad(ClipPolicyLoss(ClipOptions()), logp, old, adv, mask)
    assert clip_grad.item() == 0.0
    assert grad.item() == pytest.approx(-1.2 * 2.0)
    assert out.metrics["clip/high"].item() == 1.0 and out.metrics["clip/low"].item() == 0.0


# --------------------------------------------------------------------------- sapo
def sapo(**o):
    return SAPOPolicyLoss(SAPOOptions(**o))


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
def gmpo(**o):
    return GMPOPolicyLoss(GMPOOptions(**o))


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
    clip = ClipPolicyLoss(ClipOptions(eps_low=1 - math.exp(-eps_low), eps_high=math.exp(eps_high) - 1))
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


# --------------------------------------------------------------------------- dppo
def dppo_token(divergence, low, high, cap=20.0):
    """Qi et al. 2026 with the binary approximations: the truncated-IS gradient -A min(r, C) grad logp on
    the tokens whose probability stays in the trust region (TV: p - p_old; KL: the Bernoulli KL)."""

    def token(lp, old_lp, a):
        p, q = math.exp(lp), math.exp(old_lp)
        if divergence == "tv":
            valid = (p - q <= high) if a > 0 else (p - q >= -low)
        else:
            kl = q * (old_lp - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            valid = (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)
        w = min(math.exp(lp - old_lp), cap)
        return (-a * w * lp, -a * w) if valid else (0.0, 0.0)

    return token


@FAST
@given(off_policy(), st.sampled_from([("tv", 0.15, 0.15), ("tv", 0.05, 0.3), ("kl", 0.05, 0.05), ("kl", 0.02, 0.2)]),
       st.sampled_from([20.0, 1.5]))
def test_dppo_against_the_paper_loop(batch, setting, cap):
    divergence, low, high = setting
    logp, old, adv, mask = batch
    batch = (logp, old.clamp(max=-1e-3), adv, mask)  # log-probabilities: p_old <= 1
    loss = DPPOPolicyLoss(DPPOOptions(divergence=divergence, delta_low=low, delta_high=high, truncation=cap))
    out, grad = loss_and_grad(loss, *batch)
    ref_loss, ref_grad = per_token_reference(*batch, dppo_token(divergence, low, high, cap))
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


@FAST
@given(off_policy(), st.sampled_from(["tv", "kl"]))
def test_dppo_on_policy_is_the_vanilla_policy_gradient(batch, divergence):
    logp, _, adv, mask = batch
    _, grad = loss_and_grad(DPPOPolicyLoss(DPPOOptions(divergence=divergence)), logp, logp, adv, mask)
    torch.testing.assert_close(grad, -adv * mask, rtol=0, atol=1e-15)


def test_dppo_bounds_the_probability_move_not_the_ratio():
    """A rare token tripling its probability (0.01 -> 0.03) moves it by 0.02 in TV: inside 0.15,
    where PPO's clip at 1.2 would drop it; a likely one moving 0.5 -> 0.7 (ratio 1.4) is outside."""
    logp = torch.tensor([[math.log(0.03), math.log(0.7)]], dtype=F64)
    old = torch.tensor([[math.log(0.01), math.log(0.5)]], dtype=F64)
    adv, mask = torch.ones(1, 2, dtype=F64), torch.ones(1, 2, dtype=torch.bool)
    out, grad = loss_and_grad(DPPOPolicyLoss(DPPOOptions()), logp, old, adv, mask)
    assert grad[0, 0].item() == pytest.approx(-3.0) and grad[0, 1].item() == 0.0
    assert out.metrics["clip/region"].tolist() == [[0.0, 1.0]]
    _, clip_grad = loss_and_grad(ClipPolicyLoss(ClipOptions()), logp, old, adv, mask)
    assert clip_grad[0, 0].item() == 0.0


def test_dppo_deltas_default_to_verl_s_examples():
    assert (DPPOOptions().delta_low, DPPOOptions().delta_high) == (0.15, 0.15)
    kl = DPPOOptions(divergence="kl")
    assert (kl.delta_low, kl.delta_high) == (0.05, 0.05)
    assert DPPOOptions(divergence="kl", delta_high=0.1).delta_low == 0.05
