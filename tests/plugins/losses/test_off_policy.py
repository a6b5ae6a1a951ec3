"""``opsm``, ``m2po``, ``topr`` and ``vespo`` against plain-loop references written from their papers,
and their invariants: on-policy each is the vanilla policy gradient (or PPO's clip), OPSM only ever
drops completions with a negative advantage and a drift above delta, M2PO drops the fewest largest
squared log-ratios that bring the rest's mean under tau, TOPR's positive tokens ignore the ratio,
VESPO's weight is 1 on-policy and carries no gradient."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins.losses.clip import ClipOptions, ClipPolicyLoss
from grpo_plugins.losses.off_policy import (
    M2POOptions,
    M2POPolicyLoss,
    OPSMOptions,
    OPSMPolicyLoss,
    TOPROptions,
    TOPRPolicyLoss,
    VESPOOptions,
    VESPOPolicyLoss,
    m2po_mask,
)
from grpo_plugins.losses.policy_gradient import GPGPolicyLoss, PolicyGradientOptions
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.contracts import PolicyLossInputs

from .conftest import F64, FAST, off_policy, per_token_reference


@st.composite
def with_sampler(draw, per_row: bool | None = None):
    """An off-policy batch plus the sampler's log-probs (log-ratios to old_logp up to +-1)."""
    logp, old, adv, mask = draw(off_policy(per_row))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    sampled = old + (torch.rand(old.shape, generator=gen, dtype=F64) * 2 - 1)
    return logp, old, adv, mask, sampled


def run(loss, logp, old, adv, mask, sampled=None):
    leaf = logp.clone().requires_grad_(True)
    out = loss(PolicyLossInputs(leaf, old, adv, mask, sampling_logp=sampled))
    (grad,) = torch.autograd.grad(out.loss.sum(), leaf)
    return out, grad


def clip_token(eps=0.2):
    def token(lp, old_lp, a):
        r = math.exp(lp - old_lp)
        clipped = min(max(r, 1 - eps), 1 + eps)
        if -a * clipped > -a * r:  # the clipped term is the loss: no gradient
            return -a * clipped, 0.0
        return -a * r, -a * r
    return token


# --------------------------------------------------------------------------- opsm
@FAST
@given(with_sampler(), st.sampled_from([0.05, 0.3, 1.0]), st.booleans())
def test_opsm_against_the_paper_loop(batch, delta, with_sampler_logp):
    """DeepSeek-V3.2 eq. 9: M_i = 0 where A < 0 and 1/|o_i| sum_t log(pi_b / pi_theta) > delta."""
    logp, old, adv, mask, sampled = batch
    behaviour = sampled if with_sampler_logp else old
    out, grad = run(OPSMPolicyLoss(OPSMOptions(delta=delta)), logp, old, adv, mask,
                    sampled if with_sampler_logp else None)
    ref_loss, ref_grad = per_token_reference(logp, old, adv, mask, clip_token())
    for i in range(len(mask)):
        n = int(mask[i].sum())
        drift = sum(float(behaviour[i, t] - logp[i, t]) for t in range(mask.shape[1]) if mask[i, t]) / max(n, 1)
        for t in range(mask.shape[1]):
            if mask[i, t] and float(adv[i, t]) < 0 and drift > delta:
                ref_loss[i, t], ref_grad[i, t] = 0.0, 0.0
                assert out.metrics["opsm/masked"][i, t] == 1
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


@FAST
@given(with_sampler())
def test_opsm_is_clip_when_nothing_drifted_or_delta_is_loose(batch):
    logp, old, adv, mask, sampled = batch
    clip_out, clip_grad = run(ClipPolicyLoss(ClipOptions()), logp, old, adv, mask)
    loose, loose_grad = run(OPSMPolicyLoss(OPSMOptions(delta=1e6)), logp, old, adv, mask, sampled)
    torch.testing.assert_close(loose.loss, clip_out.loss, rtol=0, atol=0)
    torch.testing.assert_close(loose_grad, clip_grad, rtol=0, atol=0)
    on_policy, on_grad = run(OPSMPolicyLoss(OPSMOptions(delta=1e-9)), old, old, adv, mask)  # ratio 1, no sampler
    clip_on, clip_on_grad = run(ClipPolicyLoss(ClipOptions()), old, old, adv, mask)
    torch.testing.assert_close(on_grad, clip_on_grad, rtol=0, atol=0)
    assert on_policy.metrics["opsm/masked"].sum() == 0


@FAST
@given(with_sampler(), st.floats(0.01, 1.0), st.floats(0.01, 1.0))
def test_opsm_masks_only_negative_advantages_and_more_as_delta_shrinks(batch, d1, d2):
    logp, old, adv, mask, sampled = batch
    small, large = sorted((d1, d2))
    tight = run(OPSMPolicyLoss(OPSMOptions(delta=small)), logp, old, adv, mask, sampled)[0].metrics["opsm/masked"]
    loose = run(OPSMPolicyLoss(OPSMOptions(delta=large)), logp, old, adv, mask, sampled)[0].metrics["opsm/masked"]
    assert (loose <= tight).all()
    assert (tight[adv >= 0] == 0).all()


# --------------------------------------------------------------------------- m2po
def loop_m2po_keep(behaviour, proximal, mask, threshold):
    """AReaL's rule by hand: sort the squared log-ratios from the largest; drop the first k, k the
    smallest with mean(rest) < threshold, else all but one."""
    cells = [(float(proximal[i, t] - behaviour[i, t]) ** 2, i, t)
             for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    order = sorted(range(len(cells)), key=lambda j: (-cells[j][0], j))
    values = [cells[j][0] for j in order]
    drop = len(values) - 1 if values else 0
    for k in range(len(values)):
        rest = values[k:]
        if sum(rest) / len(rest) < threshold:
            drop = k
            break
    keep = torch.zeros_like(mask)
    for rank, j in enumerate(order):
        if rank >= drop:
            keep[cells[j][1], cells[j][2]] = True
    return keep


@FAST
@given(with_sampler(), st.sampled_from([1e-3, 0.04, 0.2, 10.0]))
def test_m2po_mask_against_the_loop(batch, threshold):
    logp, old, adv, mask, sampled = batch
    keep = m2po_mask(sampled, old, mask, threshold)
    assert torch.equal(keep, loop_m2po_keep(sampled, old, mask, threshold))
    m2 = (old - sampled).square()
    if mask.any():
        kept = m2[keep]
        assert len(kept) >= 1 and (float(kept.mean()) < threshold or len(kept) == 1)
        dropped = m2[mask & ~keep]
        if len(dropped):
            assert float(dropped.min()) >= float(kept.max())  # only the largest go


@FAST
@given(with_sampler(), st.sampled_from([0.01, 0.04, 0.5]))
def test_m2po_loss_against_the_paper_loop(batch, threshold):
    """J = sum_t M_t r_t A_t (no clip); the gradient -M_t r_t A_t per token."""
    logp, old, adv, mask, sampled = batch
    out, grad = run(M2POPolicyLoss(M2POOptions(threshold=threshold)), logp, old, adv, mask, sampled)
    keep = loop_m2po_keep(sampled, old, mask, threshold)

    def token(lp, old_lp, a):
        r = math.exp(lp - old_lp)
        return -r * a, -r * a

    ref_loss, ref_grad = per_token_reference(logp, old, adv, mask, token)
    torch.testing.assert_close(out.loss, ref_loss * keep, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad * keep, rtol=1e-12, atol=1e-12)
    assert torch.equal(out.metrics["m2po/masked"].bool(), mask & ~keep)


def test_m2po_without_sampler_logprobs_keeps_every_token():
    logp = torch.tensor([[-0.5, -1.0, -2.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    out, grad = run(M2POPolicyLoss(M2POOptions()), logp, logp, torch.ones(1, 3, dtype=F64), mask)
    assert out.metrics["m2po/masked"].sum() == 0
    assert grad.tolist() == [[-1.0, -1.0, -1.0]]


def test_m2po_hand_values():
    """Squared log-ratios 0.25, 0.01, 0.0, 0.09: means of the rest from the largest 0.0875, 0.0333..:
    with tau 0.04 only the largest goes."""
    old = torch.zeros(1, 4, dtype=F64)
    sampled = torch.tensor([[0.5, -0.1, 0.0, 0.3]], dtype=F64)
    keep = m2po_mask(sampled, old, torch.ones(1, 4, dtype=torch.bool), 0.04)
    assert keep.tolist() == [[False, True, True, True]]


# --------------------------------------------------------------------------- topr
@FAST
@given(off_policy(), st.sampled_from(["token", "sequence"]), st.sampled_from([(1.0, 1.0), (0.5, 2.0)]))
def test_topr_against_the_paper_loop(batch, level, weights):
    """TOPR eq. 8: -A log pi where A > 0, -[pi/mu]_0^1 A log pi (the ratio detached) elsewhere."""
    logp, old, adv, mask = batch
    w_pos, w_neg = weights
    out, grad = run(TOPRPolicyLoss(TOPROptions(level=level, positive_weight=w_pos, negative_weight=w_neg)),
                    logp, old, adv, mask)
    ref_loss, ref_grad = torch.zeros_like(logp), torch.zeros_like(logp)
    for i in range(len(mask)):
        seq = sum(float(logp[i, t] - old[i, t]) for t in range(mask.shape[1]) if mask[i, t])
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            a, lp = float(adv[i, t]), float(logp[i, t])
            if a > 0:
                w = w_pos
            else:
                rho = math.exp(min(20.0, max(-20.0, seq if level == "sequence" else lp - float(old[i, t]))))
                w = w_neg * min(max(rho, 0.0), 1.0)
            ref_loss[i, t], ref_grad[i, t] = -w * a * lp, -w * a
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


@FAST
@given(off_policy())
def test_topr_on_policy_is_the_plain_policy_gradient(batch):
    logp, _, adv, mask = batch
    topr_out, topr_grad = run(TOPRPolicyLoss(TOPROptions()), logp, logp, adv, mask)
    pg_out, pg_grad = run(GPGPolicyLoss(PolicyGradientOptions()), logp, logp, adv, mask)
    torch.testing.assert_close(topr_out.loss, pg_out.loss, rtol=0, atol=0)
    torch.testing.assert_close(topr_grad, pg_grad, rtol=0, atol=0)


# --------------------------------------------------------------------------- vespo
@FAST
@given(off_policy(), st.sampled_from([(2.0, 3.0, 3.0, 2.0), (1.0, 1.0, 4.0, 0.5)]))
def test_vespo_against_the_paper_loop(batch, params):
    """phi(w) = e^lambda w^k e^(-lambda w) of the sequence ratio w (TRL's clamps), (k, lambda) by the
    sign of A; loss -sg(phi) A log pi."""
    logp, old, adv, mask = batch
    k_pos, lam_pos, k_neg, lam_neg = params
    out, grad = run(VESPOPolicyLoss(VESPOOptions(k_pos=k_pos, lambda_pos=lam_pos, k_neg=k_neg, lambda_neg=lam_neg)),
                    logp, old, adv, mask)
    ref_loss, ref_grad = torch.zeros_like(logp), torch.zeros_like(logp)
    for i in range(len(mask)):
        log_w = sum(min(20.0, max(-20.0, float(logp[i, t] - old[i, t]))) for t in range(mask.shape[1]) if mask[i, t])
        log_w = min(20.0, max(math.log(1e-8), log_w))
        for t in range(mask.shape[1]):
            if mask[i, t]:
                a = float(adv[i, t])
                k, lam = (k_pos, lam_pos) if a >= 0 else (k_neg, lam_neg)
                phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
                ref_loss[i, t], ref_grad[i, t] = -phi * a * float(logp[i, t]), -phi * a
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


@FAST
@given(off_policy())
def test_vespo_on_policy_is_the_plain_policy_gradient(batch):
    logp, _, adv, mask = batch
    out, grad = run(VESPOPolicyLoss(VESPOOptions()), logp, logp, adv, mask)
    _, pg_grad = run(GPGPolicyLoss(PolicyGradientOptions()), logp, logp, adv, mask)
    assert torch.equal(out.metrics["vespo/weight"], mask.to(F64))  # phi(1) = 1
    torch.testing.assert_close(grad, pg_grad, rtol=1e-12, atol=1e-12)


def test_vespo_weight_peaks_at_k_over_lambda_and_fades_both_ways():
    """With A > 0 (k 2, lambda 3) phi(w) = e^3 w^2 e^(-3w): 1 at w = 1, largest at w = k / lambda = 2/3,
    small for a completion far off the policy either way (w = 0.05 or 5)."""
    mask = torch.ones(1, 1, dtype=torch.bool)

    def phi(ratio: float, advantage: float = 1.0) -> float:
        out, _ = run(VESPOPolicyLoss(VESPOOptions()), torch.full((1, 1), math.log(ratio), dtype=F64),
                     torch.zeros(1, 1, dtype=F64), torch.full((1, 1), advantage, dtype=F64), mask)
        return float(out.metrics["vespo/weight"])

    assert phi(1.0) == pytest.approx(1.0) and phi(1.0, -1.0) == pytest.approx(1.0)
    assert phi(0.5) == pytest.approx(math.exp(3 + 2 * math.log(0.5) - 1.5))
    grid = [0.3, 0.5, 2 / 3, 0.8, 1.0, 1.5]
    assert max(grid, key=phi) == pytest.approx(2 / 3)
    assert phi(0.05) < 0.1 and phi(5.0) < 0.01
    assert max(grid, key=lambda w: phi(w, -1.0)) == pytest.approx(1.5)  # k 3, lambda 2 for A < 0
