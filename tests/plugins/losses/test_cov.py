"""Clip-Cov and KL-Cov (the entropy-mechanism paper) against plain-loop references: the centred
covariance, which tokens are eligible or selected, and what happens to their loss and gradient."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins.losses.clip import ClipOptions, ClipPolicyLoss
from grpo_plugins.losses.cov import ClipCovOptions, ClipCovPolicyLoss, KLCovOptions, KLCovPolicyLoss, centred_covariance
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.contracts import PolicyLossInputs
from grpo_core.plugin_manager import load_plugins

from .conftest import F64, FAST


@st.composite
def batches(draw):
    """(logp, old_logp, advantages, mask), ``(B, T)``, ragged with at least one valid token;
    advantages of a few units so that covariances fall inside and outside [1, 5]."""
    rows, length = draw(st.integers(1, 5)), draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows).filter(lambda x: sum(x) > 0))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    logp = -torch.rand(rows, length, generator=gen, dtype=F64) * 6
    old = logp + (torch.rand(rows, length, generator=gen, dtype=F64) - 0.5)
    adv = torch.randn(rows, length, generator=gen, dtype=F64) * 2
    return logp, old, torch.where(mask, adv, 0.0), mask


def loop_covariance(logp, adv, mask):
    cells = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    mean_a = sum(float(adv[c]) for c in cells) / len(cells)
    mean_l = sum(float(logp[c]) for c in cells) / len(cells)
    return {c: (float(adv[c]) - mean_a) * (float(logp[c]) - mean_l) for c in cells}


def run(loss, logp, old, adv, mask):
    leaf = logp.clone().requires_grad_(True)
    out = loss(PolicyLossInputs(leaf, old, adv, mask))
    (grad,) = torch.autograd.grad(out.loss.sum(), leaf)
    return out, grad


@FAST
@given(batches())
def test_centred_covariance_against_the_loop(batch):
    logp, _, adv, mask = batch
    got = centred_covariance(logp, adv, mask)
    expected = torch.zeros_like(logp)
    for cell, value in loop_covariance(logp, adv, mask).items():
        expected[cell] = value
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@FAST
@given(batches(), st.sampled_from([0.05, 0.3, 1.0]), st.integers(0, 2**31 - 1))
def test_clip_cov_cuts_a_random_draw_of_eligible_tokens_and_is_clip_elsewhere(batch, ratio, seed):
    logp, old, adv, mask = batch
    options = ClipCovOptions(clip_cov_ratio=ratio)
    loss = ClipCovPolicyLoss(options)
    torch.manual_seed(seed)
    out, grad = run(loss, logp, old, adv, mask)
    ppo, ppo_grad = run(ClipPolicyLoss(ClipOptions()), logp, old, adv, mask)
    # eligibility by loop: valid, not clipped by PPO, covariance strictly inside (lb, ub)
    covs = loop_covariance(logp, adv, mask)
    eligible = {c for c, v in covs.items() if ppo.metrics["clip/region"][c] == 0 and 1.0 < v < 5.0}
    selected = {tuple(c) for c in torch.nonzero(out.metrics["cov/selected"]).tolist()}
    assert selected <= eligible
    assert len(selected) == min(max(1, int(ratio * int(mask.sum()))), len(eligible))
    for c in selected:
        assert out.loss[c] == 0 and grad[c] == 0
    keep = torch.ones_like(mask)
    for c in selected:
        keep[c] = False
    assert torch.equal(out.loss[keep], ppo.loss[keep]) and torch.equal(grad[keep], ppo_grad[keep])
    # the draw comes from torch's global generator: the same seed gives the same tokens
    torch.manual_seed(seed)
    again, _ = run(loss, logp, old, adv, mask)
    assert torch.equal(again.metrics["cov/selected"], out.metrics["cov/selected"])


def test_clip_cov_hand_case():
    """Four tokens, ratio 1 (nothing PPO-clipped): A = [3, -3, 1, -1], logp = [-1, -3, -1, -3];
    means 0 and -2, so cov = [3, 3, 1, 1]: only the first two lie inside (1, 5) (1 is on the
    bound). With r = 0.5, floor(0.5 * 4) = 2 tokens: both eligible ones are cut."""
    logp = torch.tensor([[-1.0, -3.0, -1.0, -3.0]], dtype=F64)
    adv = torch.tensor([[3.0, -3.0, 1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    out, grad = run(ClipCovPolicyLoss(ClipCovOptions(clip_cov_ratio=0.5)), logp, logp, adv, mask)
    assert out.metrics["cov"].tolist() == [[3.0, 3.0, 1.0, 1.0]]
    assert out.metrics["cov/selected"].tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert grad.tolist() == [[0.0, 0.0, -1.0, 1.0]]  # the rest: the vanilla gradient -A at ratio 1


def kl_cov_loop(logp, old, adv, mask, top, coef):
    """The surrogate -A r on every token plus coef * |logp - old| on the ``top`` tokens."""
    loss, grad = torch.zeros_like(logp), torch.zeros_like(logp)
    for c in loop_covariance(logp, adv, mask):
        lr = float(logp[c] - old[c])
        r, a = math.exp(lr), float(adv[c])
        loss[c] = -a * r + (coef * abs(lr) if c in top else 0.0)
        grad[c] = -a * r + (coef * math.copysign(1.0, lr) if c in top and lr != 0 else 0.0)
    return loss, grad


@FAST
@given(batches(), st.sampled_from([0.05, 0.3, 1.0]), st.sampled_from([1.0, 0.25]))
def test_kl_cov_against_the_paper_loop(batch, k_ratio, coef):
    logp, old, adv, mask = batch
    out, grad = run(KLCovPolicyLoss(KLCovOptions(kl_cov_ratio=k_ratio, kl_coef=coef)), logp, old, adv, mask)
    covs = loop_covariance(logp, adv, mask)
    k = max(1, int(k_ratio * len(covs)))
    selected = {tuple(c) for c in torch.nonzero(out.metrics["cov/selected"]).tolist()}
    # the k largest covariances (ties, e.g. the two equal ones of a two-token batch, may go either way)
    assert len(selected) == k
    expected = sorted(covs.values(), reverse=True)[:k]
    assert sorted((covs[c] for c in selected), reverse=True) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    ref_loss, ref_grad = kl_cov_loop(logp, old, adv, mask, selected, coef)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_kl_cov_at_ratio_one_is_the_vanilla_policy_gradient():
    """mu = 1: |logp - old| is 0 with gradient 0 (torch's abs at 0), so only -A grad logp remains."""
    logp = torch.tensor([[-1.0, -3.0, -0.5], [-2.0, -0.1, -4.0]], dtype=F64)
    adv = torch.tensor([[2.0, -1.0, 0.5], [-2.0, 1.0, 0.0]], dtype=F64)
    mask = torch.ones_like(adv, dtype=torch.bool)
    out, grad = run(KLCovPolicyLoss(KLCovOptions(kl_cov_ratio=0.5)), logp, logp, adv, mask)
    assert out.metrics["cov/selected"].sum() == 3
    torch.testing.assert_close(grad, -adv, rtol=0, atol=0)


def test_registered_and_do_not_claim_zero_advantage_skips():
    registry = load_plugins(external=False).registry
    for name, impl, options in [("clip-cov", ClipCovPolicyLoss, ClipCovOptions),
                                ("kl-cov", KLCovPolicyLoss, KLCovOptions)]:
        component = registry.get("policy_loss", name)
        assert component.impl is impl and component.options is options
        assert component.plugin == "grpo_plugins.losses.cov"
        assert impl.zero_advantage_is_zero_loss is False  # skipping rows would move the covariance's means
        assert any("2505.22617" in (f.description or "") for f in options.model_fields.values())
