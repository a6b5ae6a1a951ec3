"""The claims of docs/algorithms.md about the reference implementations outside verl, OpenRLHF and TRL
(re-implemented in ``others.py``): ROLL's TOPR, AReaL's M2PO mask and its decoupled PPO loss with
token-level rejection sampling (docs/guides/async.md), the tinker-cookbook's on-policy distillation
advantage."""

from __future__ import annotations

import torch
from grpo_plugins.advantages.distillation import DistillationOptions, OnPolicyDistillation
from grpo_plugins.losses.off_policy import m2po_mask
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.contracts import BatchStats, Teacher
from grpo_core.train.learner.correction import rollout_correction

from . import others
from .conftest import F64, FAST, assert_same, component, groups, inputs_of, ours, peer


@FAST
@given(groups(binary=True, spread=1.0), st.sampled_from([(1.0, 1.0), (0.5, 2.0)]),
       st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_topr_is_roll_topr_for_binary_rewards(batch, weights, mode):
    """``topr`` (``positive_weight``, ``negative_weight``) = ROLL's ``pg_variant: topr`` (``topr_positive_weight``,
    ``topr_negative_weight``, ``ratio_type: token``) with 0/1 rewards and grpo's advantages: ROLL splits
    by the score (> 0), grpo-core by the advantage's sign, which agree there (a group whose rewards are
    all equal has advantage 0: no loss either way)."""
    scores, index, mask, logp, old, _ = batch
    adv = component("advantage_estimator", "grpo")(inputs_of(scores, index, mask))
    w_pos, w_neg = weights
    mine = ours(component("policy_loss", "topr", positive_weight=w_pos, negative_weight=w_neg), mode, logp, old,
                adv, mask)

    def roll(lp):
        per_token = others.roll_topr_loss(torch.exp(lp - old), lp, adv, scores, w_pos, w_neg)
        stats = BatchStats(int(mask.sum()), mask.shape[0], mask.shape[1])
        return component("loss_aggregator", mode)(per_token, mask, stats)

    assert_same(mine, peer(roll, logp))


@FAST
@given(groups(spread=1.0), st.sampled_from([0.01, 0.04, 0.3]), st.data())
def test_m2po_mask_is_areal_s(batch, threshold, data):
    """``m2po``'s mask (``threshold``) = AReaL's M2PO mask (``actor.m2_threshold``), behaviour = the
    sampler's log-probs, proximal = the learner's old ones."""
    _, _, mask, _, old, _ = batch
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    sampled = old + (torch.rand(old.shape, generator=gen, dtype=F64) * 1.2 - 0.6)
    assert torch.equal(m2po_mask(sampled, old, mask, threshold), others.areal_m2po_mask(sampled, old, mask, threshold))


@FAST
@given(groups(spread=0.5), st.sampled_from([(None, 1.3), (None, 2.0), (0.8, 1.3)]), st.data())
def test_token_mask_under_clip_is_areal_decoupled_ppo_with_rejection_sampling(batch, bounds, data):
    """``clip`` (``eps_low``, ``eps_high``) under token-mean with ``rollout_correction: {level: token,
    mode: mask, cap: C}`` (and ``lower: L``) = AReaL's decoupled PPO loss (``actor.use_decoupled_loss``,
    ``eps_clip``, ``eps_clip_higher``, no ``c_clip``) with ``actor.rejection_sampling: {level: token,
    action: mask, metric: ratio, upper: C}`` (and ``lower: L``): behaviour = the sampler's log-probs,
    proximal = the learner's old ones. AReaL divides by the tokens of the mask before the rejection, so
    rejected tokens stay in the normalizer, as grpo-core's weight 0 leaves them."""
    _, _, mask, logp, old, adv = batch
    lower, cap = bounds
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    sampled = old + (torch.rand(old.shape, generator=gen, dtype=F64) * 1.2 - 0.6)
    weight, _ = rollout_correction(old, sampled, mask, level="token", mode="mask", cap=cap, lower=lower)
    mine = ours(component("policy_loss", "clip", eps_low=0.2, eps_high=0.28), "token-mean", logp, old, adv, mask,
                weight=weight)
    theirs = peer(lambda lp: others.areal_decoupled_ppo_loss(lp, old, sampled, adv, mask, 0.2, 0.28, cap, lower),
                  logp)
    assert_same(mine, theirs)


@FAST
@given(groups(), st.sampled_from([1.0, 0.5]), st.sampled_from([0.0, 0.9, 1.0]))
def test_opd_is_the_tinker_cookbook_s_distillation(batch, coef, discount):
    """``opd`` with ``kl_coef``, ``discount`` = the tinker-cookbook's ``incorporate_kl_penalty``
    (``kl_penalty_coef``, ``kl_discount_factor``) added to its task advantages (reward minus the group
    mean): ``task_weight: 1, task: {scale_by_std: false}``; distillation alone when the task adds nothing."""
    scores, index, mask, logp, _, _ = batch
    teacher = logp + 0.7 * torch.sin(3 * logp)
    estimator = OnPolicyDistillation(
        DistillationOptions(teacher={"path": "unused"}, kl_coef=coef, discount=discount, task_weight=1.0,
                            task={"scale_by_std": False}), teacher=Teacher(torch.nn.Linear(1, 1)))
    got = estimator(inputs_of(scores, index, mask, logp=logp * mask, teacher_logp=teacher * mask))
    task = component("advantage_estimator", "grpo", scale_by_std=False)(inputs_of(scores, index, mask))
    expected = others.tinker_kl_advantages(logp, teacher, mask, coef, discount) + task
    torch.testing.assert_close(got, expected * mask)
