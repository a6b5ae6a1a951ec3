"""``gpg`` and ``reinforce``: ``-A logp`` against a loop, blind to the old log-probs, and equal at ratio 1
to every ratio-based loss (clip, cispo, sapo; gmpo with seq-mean-token-mean)."""

from __future__ import annotations

import torch
from grpo_plugins.aggregators import seq_mean_token_mean, token_mean
from grpo_plugins.losses.clip import ClipOptions, ClipPolicyLoss
from grpo_plugins.losses.policy_gradient import GPGPolicyLoss, PolicyGradientOptions, REINFORCEPolicyLoss
from grpo_plugins.losses.trust_region import (
    CISPOOptions,
    CISPOPolicyLoss,
    GMPOOptions,
    GMPOPolicyLoss,
    SAPOOptions,
    SAPOPolicyLoss,
)
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.contracts import BatchStats, PolicyLossInputs

from .conftest import FAST, loss_and_grad, off_policy, per_token_reference


def cispo(**o):
    return CISPOPolicyLoss(CISPOOptions(**o))


def sapo(**o):
    return SAPOPolicyLoss(SAPOOptions(**o))


def gmpo(**o):
    return GMPOPolicyLoss(GMPOOptions(**o))


def gpg():
    return GPGPolicyLoss(PolicyGradientOptions())


def reinforce():
    return REINFORCEPolicyLoss(PolicyGradientOptions())


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
    for other in (ClipPolicyLoss(ClipOptions()), cispo(), sapo(), gmpo()):
        if other.__class__ is GMPOPolicyLoss and aggregate is not seq_mean_token_mean:
            continue  # GMPO's gradient at ratio 1 is the sequence-mean one
        torch.testing.assert_close(aggregated(gpg(), same), aggregated(other, same), rtol=1e-12, atol=1e-12)
