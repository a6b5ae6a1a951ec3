"""Every "equals verl's X with option Y" of docs/algorithms.md, on verl 0.9.1's formulas as its source
writes them (re-implemented in ``verl_0_9_1.py``): values and gradients, on random batches."""

from __future__ import annotations

import pytest
import torch
from grpo_plugins.advantages.distillation import DistillationOptions, OnPolicyDistillation
from hypothesis import assume, given
from hypothesis import strategies as st

from grpo_core.contracts import BatchStats, Teacher
from grpo_core.train.learner.correction import rollout_correction
from grpo_core.train.learner.kl import adapted_beta

from . import verl_0_9_1 as verl
from .conftest import F64, FAST, assert_same, component, groups, inputs_of, ours, peer


def estimator(name, **options):
    return component("advantage_estimator", name, **options)


def distillation(**options):
    """``opd`` with its options and a stand-in teacher (the engine fills the log-probs it reads)."""
    return OnPolicyDistillation(DistillationOptions(teacher={"path": "unused"}, **options),
                                teacher=Teacher(torch.nn.Linear(1, 1)))


# --------------------------------------------------------------------------- advantage estimators
@FAST
@given(groups(), st.booleans())
def test_grpo_is_verl_grpo(batch, scale_by_std):
    """``grpo`` with ``std: unbiased`` = verl ``grpo`` (``norm_adv_by_std_in_grpo`` as ``scale_by_std``)."""
    scores, index, mask, *_ = batch
    got = estimator("grpo", std="unbiased", scale_by_std=scale_by_std)(inputs_of(scores, index, mask))
    torch.testing.assert_close(got, verl.grpo(scores, mask, index, norm_adv_by_std_in_grpo=scale_by_std))


@FAST
@given(groups())
def test_rloo_is_verl_rloo(batch):
    scores, index, mask, *_ = batch
    torch.testing.assert_close(estimator("rloo")(inputs_of(scores, index, mask)), verl.rloo(scores, mask, index))


@FAST
@given(groups())
def test_reinforce_plus_plus_is_verl_reinforce_plus_plus_baseline(batch):
    """Equal where the batch has a spread (verl's whitening of an all-equal batch leaves ~1e-5 from the
    1e-8 in its masked means, where grpo-core gives exactly 0)."""
    scores, index, mask, *_ = batch
    assume(any(len({float(scores[i]) for i in range(len(index)) if index[i] == g}) > 1 for g in set(index)))
    got = estimator("reinforce++")(inputs_of(scores, index, mask))
    torch.testing.assert_close(got, verl.reinforce_plus_plus_baseline(scores, mask, index), rtol=1e-7, atol=1e-7)


@FAST
@given(groups(), st.sampled_from([1.0, 0.9, 0.5]))
def test_reinforce_plus_plus_no_baseline_is_verl_reinforce_plus_plus(batch, gamma):
    """The sequence reward on its last token (verl's ``token_level_rewards`` without a KL in them);
    batches with a spread, as above."""
    scores, index, mask, *_ = batch
    assume(len(set(scores.tolist())) > 1)
    last = mask.sum(dim=1) - 1
    token_rewards = torch.zeros(mask.shape, dtype=F64)
    token_rewards[torch.arange(len(scores)), last] = scores
    got = estimator("reinforce++-no-baseline", gamma=gamma)(inputs_of(scores, index, mask))
    torch.testing.assert_close(got, verl.reinforce_plus_plus(token_rewards, mask.to(F64), gamma), rtol=1e-7,
                               atol=1e-7)


@FAST
@given(groups())
def test_opo_is_verl_opo(batch):
    scores, index, mask, *_ = batch
    torch.testing.assert_close(estimator("opo")(inputs_of(scores, index, mask)), verl.opo(scores, mask.to(F64), index))


@FAST
@given(groups())
def test_remax_is_verl_remax(batch):
    scores, index, mask, *_ = batch
    baseline = torch.tensor([float(scores[i]) - 0.5 * (i % 3) for i in range(len(scores))], dtype=F64)
    baseline = baseline.view(-1, index.count(0))[:, :1].expand(-1, index.count(0)).reshape(-1)  # one per prompt
    last = mask.sum(dim=1) - 1
    token_rewards = torch.zeros(mask.shape, dtype=F64)
    token_rewards[torch.arange(len(scores)), last] = scores
    got = estimator("remax")(inputs_of(scores, index, mask, baseline_scores=baseline))
    torch.testing.assert_close(got, verl.remax(token_rewards, baseline, mask.to(F64)))


@FAST
@given(groups())
def test_gpg_differs_from_verl_gpg_only_in_alpha(batch):
    """verl's alpha is B / (rows with a non-zero reward); grpo-core's (the paper's) B / (B - M):
    with ``rescale: false`` times verl's alpha, the two agree."""
    scores, index, mask, *_ = batch
    alpha = len(scores) / max(int(torch.count_nonzero(scores)), 1)
    got = estimator("gpg", rescale=False)(inputs_of(scores, index, mask))
    torch.testing.assert_close(alpha * got, verl.gpg(scores, mask, index))


@FAST
@given(groups(), st.integers(1, 3), st.data())
def test_gdpo_is_verl_gdpo(batch, functions, data):
    """``gdpo`` with ``batch_norm: token, batch_eps: 1e-8`` = verl ``gdpo`` (``gdpo_reward_keys`` the reward
    functions, ``gdpo_reward_weights`` their weights)."""
    _, index, mask, *_ = batch
    rows = len(index)
    table = torch.tensor(data.draw(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=functions,
                                                     max_size=functions), min_size=rows, max_size=rows)), dtype=F64)
    weights = torch.tensor(data.draw(st.lists(st.sampled_from([1.0, 0.5, 2.0]), min_size=functions,
                                              max_size=functions)), dtype=F64)
    got = estimator("gdpo", batch_norm="token", batch_eps=1e-8)(
        inputs_of((table * weights).sum(dim=1), index, mask, reward_scores=table, reward_weights=weights))
    expected = verl.gdpo([table[:, k] for k in range(functions)], mask.to(F64), index, weights=weights.tolist())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- kl estimators
@FAST
@given(st.lists(st.tuples(st.floats(-30.0, 0.0), st.floats(-30.0, 0.0)), min_size=1, max_size=10),
       st.sampled_from(["low_var_kl", "kl", "mse", "abs", "k1+", "k3+"]))
def test_kl_estimators_are_verl_kl_penalty(pairs, name):
    """Each KL estimator at its defaults (low_var_kl's and k3+'s clamps 20 and 10 included) = verl's
    ``kl_penalty`` of the same name: the value and the gradient of every token, far log-ratios
    included (logp -3, ref 0: k3+'s value 10 and gradient -3)."""
    logp = torch.tensor([[a for a, _ in pairs] + [-3.0]], dtype=F64)
    ref = torch.tensor([[b for _, b in pairs] + [0.0]], dtype=F64)
    mask = torch.ones_like(logp, dtype=torch.bool)
    mine, theirs = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    value = component("kl_penalty", name)(mine, ref, mask)
    expected = verl.kl_penalty(theirs, ref, name)
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    (g1,) = torch.autograd.grad(value.sum(), mine)
    (g2,) = torch.autograd.grad(expected.sum(), theirs)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)


@FAST
@given(st.floats(1e-3, 1.0), st.floats(0.0, 2.0), st.integers(1, 64), st.floats(0.01, 0.5),
       st.sampled_from([64, 1000, 10_000]))
def test_adaptive_kl_is_verl_adaptive_kl_controller_up_to_the_horizon(beta, kl, rows, target, horizon):
    """``algorithm.kl.adaptive`` (``target``, ``horizon``) = verl's ``kl_ctrl: adaptive`` (``target_kl``,
    ``horizon``) for one step of ``rows <= horizon`` completions, given the same step KL (verl's is the
    mean of each completion's token mean, grpo-core's the token mean: the docs say so); above the
    horizon verl's factor ``rows / horizon`` is not capped, and a horizon below ``rows / 5`` makes its
    beta negative where grpo-core's stays within 20%."""
    got = adapted_beta(beta, kl, rows, target=target, horizon=horizon)
    assert got == pytest.approx(verl.adaptive_kl_update(beta, kl, rows, target, horizon), rel=1e-12)
    assert adapted_beta(beta, 10 * target, 10 * horizon, target=target, horizon=horizon) == pytest.approx(1.2 * beta)
    assert verl.adaptive_kl_update(beta, 10 * target, 10 * horizon, target, horizon) == pytest.approx(3.0 * beta)


# --------------------------------------------------------------------------- aggregators
@FAST
@given(groups(), st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                  "token-sum"]))
def test_aggregators_are_verl_agg_loss(batch, mode):
    """Each aggregator = verl ``agg_loss`` of the same ``loss_agg_mode``, one process, every row with a
    token (verl leaves rows without one out of the sequence count); ``seq-mean-token-sum-norm`` with
    verl's ``loss_scale_factor`` set to the rollout's max_new_tokens (unset, verl divides by the
    micro-batch's padded width)."""
    _, _, mask, logp, *_ = batch
    max_length = mask.shape[1] + 3
    stats = BatchStats(int(mask.sum()), mask.shape[0], max_length)
    got = component("loss_aggregator", mode)(logp, mask, stats)
    expected = verl.agg_loss(logp, mask.to(F64), mode, loss_scale_factor=max_length)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9)


# --------------------------------------------------------------------------- policy losses
@FAST
@given(groups(spread=1.5), st.sampled_from(["token-mean", "seq-mean-token-mean"]),
       st.sampled_from([(0.2, 0.2), (0.2, 0.28)]))
def test_clip_with_dual_clip_3_is_verl_vanilla(batch, mode, clip):
    """``clip`` (eps_low, eps_high, ``dual_clip: 3``) = verl ``vanilla`` (clip_ratio_low, clip_ratio_high and
    its clip_ratio_c, 3 by default: verl always applies the dual clip)."""
    _, _, mask, logp, old, adv = batch
    low, high = clip
    mine = ours(component("policy_loss", "clip", eps_low=low, eps_high=high, dual_clip=3.0), mode, logp, old, adv,
                mask)
    theirs = peer(lambda lp: verl.agg_loss(verl.vanilla(old, lp, adv, low, high, 3.0), mask.to(F64), mode), logp)
    assert_same(mine, theirs)


@FAST
@given(groups(spread=0.5))
def test_gspo_is_verl_gspo(batch):
    """``gspo`` = verl ``gspo`` (clip_ratio_low/high as eps_low/eps_high, seq-mean-token-mean) wherever the
    sequence log-ratio is within [-20, 10] (verl clamps it at 10 from above, grpo-core at +-20)."""
    _, _, mask, logp, old, adv = batch
    mine = ours(component("policy_loss", "gspo", eps_low=0.05, eps_high=0.08), "seq-mean-token-mean", logp, old,
                adv, mask)
    theirs = peer(lambda lp: verl.agg_loss(verl.gspo(old, lp, adv, mask.to(F64), 0.05, 0.08), mask.to(F64),
                                           "seq-mean-token-mean"), logp)
    assert_same(mine, theirs)


@FAST
@given(groups(spread=1.5), st.sampled_from([(1.0, 1.05), (0.5, 2.0)]))
def test_sapo_is_verl_sapo(batch, taus):
    """``sapo`` with seq-mean-token-mean = verl ``sapo`` (which always aggregates that way)."""
    _, _, mask, logp, old, adv = batch
    mine = ours(component("policy_loss", "sapo", tau_pos=taus[0], tau_neg=taus[1]), "seq-mean-token-mean", logp,
                old, adv, mask)
    theirs = peer(lambda lp: verl.agg_loss(verl.sapo(old, lp, adv, *taus), mask.to(F64), "seq-mean-token-mean"), logp)
    assert_same(mine, theirs)


@FAST
@given(groups(spread=1.5))
def test_cispo_with_both_bounds_is_verl_cispo(batch):
    """``cispo`` with ``eps_low`` set = verl ``cispo`` (clip_ratio_low = eps_low, clip_ratio_high = eps_high;
    verl always clips below, grpo-core only when eps_low is set)."""
    _, _, mask, logp, old, adv = batch
    mine = ours(component("policy_loss", "cispo", eps_low=0.2, eps_high=0.28), "token-mean", logp, old, adv, mask)
    theirs = peer(lambda lp: verl.agg_loss(verl.cispo(old, lp, adv, 0.2, 0.28), mask.to(F64), "token-mean"), logp)
    assert_same(mine, theirs)


@FAST
@given(groups(spread=1.0))
def test_gmpo_is_verl_geo_mean(batch):
    """``gmpo`` with seq-mean-token-mean and one advantage per completion = verl ``geo_mean`` (its
    clip_ratio_low/high as eps_low/eps_high; it averages over rows itself)."""
    _, _, mask, logp, old, adv = batch
    mine = ours(component("policy_loss", "gmpo", eps_low=0.4, eps_high=0.3), "seq-mean-token-mean", logp, old,
                adv, mask)
    theirs = peer(lambda lp: verl.geo_mean_loss(old, lp, adv, mask.to(F64), 0.4, 0.3), logp)
    assert_same(mine, theirs)


@FAST
@given(groups(spread=1.0), st.sampled_from(["token-mean", "seq-mean-token-sum"]))
def test_gpg_and_reinforce_losses_are_verl_s(batch, mode):
    _, _, mask, logp, old, adv = batch
    for name, fn in (("gpg", verl.gpg_loss), ("reinforce", verl.reinforce_loss)):
        mine = ours(component("policy_loss", name), mode, logp, old, adv, mask)
        theirs = peer(lambda lp, fn=fn: verl.agg_loss(fn(lp, adv), mask.to(F64), mode), logp)
        assert_same(mine, theirs)


@FAST
@given(groups(spread=1.5, per_token=True), st.sampled_from([(-0.5, 0.5), (0.0, 5.0), (-5.0, 0.1)]))
def test_clip_cov_is_verl_clip_cov(batch, window):
    """``clip-cov`` with ``clip_cov_ratio: 1`` (every candidate is cut: verl's random draw has no choice)
    = verl ``clip_cov`` (clip_cov_lb/ub the window; no dual clip, no log-ratio clamp, both of which
    are grpo-core's defaults here or never bind)."""
    _, _, mask, logp, old, adv = batch
    lb, ub = window
    mine = ours(component("policy_loss", "clip-cov", clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub),
                "token-mean", logp, old, adv, mask)
    theirs = peer(lambda lp: verl.agg_loss(verl.clip_cov(old, lp, adv, mask.to(F64), 0.2, 0.2, 1.0, lb, ub),
                                           mask.to(F64), "token-mean"), logp)
    assert_same(mine, theirs)


@FAST
@given(groups(spread=1.5, per_token=True), st.sampled_from([0.2, 0.5, 1.0]), st.sampled_from([1.0, 0.1]))
def test_kl_cov_is_verl_kl_cov(batch, ratio, coef):
    _, _, mask, logp, old, adv = batch
    mine = ours(component("policy_loss", "kl-cov", kl_cov_ratio=ratio, kl_coef=coef), "token-mean", logp, old, adv,
                mask)
    theirs = peer(lambda lp: verl.agg_loss(verl.kl_cov(old, lp, adv, mask.to(F64), ratio, coef), mask.to(F64),
                                           "token-mean"), logp)
    assert_same(mine, theirs)


@FAST
@given(groups(spread=1.5), st.sampled_from(["tv", "kl"]), st.sampled_from([(0.15, 0.15), (0.05, 0.2)]),
       st.sampled_from([20.0, 3.0]))
def test_dppo_is_verl_dppo(batch, divergence, deltas, cap):
    """``dppo`` = verl ``dppo_tv`` / ``dppo_kl`` with clip_ratio_low/high = delta_low/delta_high and
    clip_ratio_c = truncation."""
    _, _, mask, logp, old, adv = batch
    low, high = deltas
    loss = component("policy_loss", "dppo", divergence=divergence, delta_low=low, delta_high=high, truncation=cap)
    mine = ours(loss, "token-mean", logp, old, adv, mask)
    theirs = peer(lambda lp: verl.agg_loss(verl.dppo(old, lp, adv, divergence, low, high, cap), mask.to(F64),
                                           "token-mean"), logp)
    assert_same(mine, theirs)


# --------------------------------------------------------------------------- rollout correction
@st.composite
def mismatch(draw):
    """(trainer log-probs, sampler log-probs, mask): token log-ratios up to +-0.6."""
    _, _, mask, logp, *_ = draw(groups())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return logp, logp + (torch.rand(logp.shape, generator=gen, dtype=F64) * 1.2 - 0.6), mask


def correction(trainer, sampler, mask, **options):
    return rollout_correction(trainer, sampler, mask, **{"level": "token", "mode": "truncate", "cap": 2.0,
                                                         **options})[0]


@FAST
@given(mismatch(), st.sampled_from(["token", "sequence"]), st.sampled_from([1.2, 2.0]), st.booleans())
def test_truncation_is_verl_rollout_is(drawn, level, cap, normalize):
    """``level: L, mode: truncate, cap: C`` = verl ``rollout_is: L`` with ``rollout_is_threshold: C``;
    ``normalize: true`` = ``rollout_is_batch_normalize: true`` when the call is the whole batch."""
    trainer, sampler, mask = drawn
    got = correction(trainer, sampler, mask, level=level, cap=cap, normalize=normalize)
    expected = verl.rollout_is_weights(trainer - sampler, mask.to(F64), level, cap, normalize)
    torch.testing.assert_close(got, expected * mask)


@FAST
@given(mismatch(), st.sampled_from(["token", "sequence"]), st.sampled_from([(0.8, 1.25), (0.5, 2.0)]))
def test_mask_with_a_lower_bound_is_verl_icepop(drawn, level, bounds):
    """``mode: mask, lower: L, cap: C`` = verl ``rollout_is`` with ``rollout_is_threshold: "L_C"`` (IcePop)."""
    trainer, sampler, mask = drawn
    lower, cap = bounds
    got = correction(trainer, sampler, mask, level=level, mode="mask", cap=cap, lower=lower)
    expected = verl.rollout_is_weights(trainer - sampler, mask.to(F64), level, f"{lower}_{cap}")
    torch.testing.assert_close(got, expected * mask)


@FAST
@given(mismatch())
def test_mask_without_a_lower_bound_is_verl_icepop_with_a_lower_bound_below_every_ratio(drawn):
    """verl has no upper-only mask: its IcePop needs a positive lower bound; one below every ratio
    (the ratios here are above exp(-0.6)) gives ``mode: mask``."""
    trainer, sampler, mask = drawn
    got = correction(trainer, sampler, mask, mode="mask", cap=1.3)
    expected = verl.rollout_is_weights(trainer - sampler, mask.to(F64), "token", "1e-3_1.3")
    torch.testing.assert_close(got, expected * mask)


@FAST
@given(mismatch(), st.sampled_from([("geometric", "seq_mean_k1"), ("product", "seq_sum_k1")]),
       st.sampled_from([(0.9, 1.1), (0.5, 1.5), (0.97, 1.0)]))
def test_rejection_is_verl_rollout_rs_with_the_inverse_bounds(drawn, statistics, bounds):
    """``reject: {statistic, low, high}`` (with ``level: off``: kept tokens weigh 1) = verl ``rollout_rs``
    ``seq_mean_k1`` (geometric) / ``seq_sum_k1`` (product) with ``rollout_rs_threshold: "{1/high}_{1/low}"``:
    verl's statistic is -log r, so its bounds are the inverse ones (the kept tokens are the same; verl
    takes the rejected ones out of the response mask, so they leave the aggregator's normalizer too,
    where grpo-core weighs them 0)."""
    trainer, sampler, mask = drawn
    statistic, option = statistics
    low, high = bounds
    got = correction(trainer, sampler, mask, level="off", reject=(statistic, low, high))
    expected = verl.rollout_rejection_mask(trainer - sampler, mask.to(F64), option, f"{1 / high}_{1 / low}")
    torch.testing.assert_close(got, expected)


def test_verl_token_k1_rejection_is_not_the_mask_mode():
    """verl ``rollout_rs: token_k1`` keeps weight 1 on the kept tokens (a filter, no importance weight);
    ``mode: mask`` keeps the ratio: they differ wherever a kept ratio is not 1."""
    trainer = torch.tensor([[-1.0, -1.0]], dtype=F64)
    sampler = torch.tensor([[-1.2, -3.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    ours_mask = correction(trainer, sampler, mask, mode="mask", cap=2.0)
    verl_rs = verl.rollout_rejection_mask(trainer - sampler, mask.to(F64), "token_k1", "0.5_2.0")
    assert ours_mask[0].tolist() == pytest.approx([float(torch.exp(torch.tensor(0.2, dtype=F64))), 0.0])
    assert verl_rs[0].tolist() == [1.0, 0.0]


# --------------------------------------------------------------------------- distillation
@FAST
@given(groups(), st.sampled_from([1.0, 0.3]), st.sampled_from([10.0, 0.5]))
def test_opd_mixed_with_the_task_is_verl_distillation(batch, coef, clamp):
    """``opd`` with ``task_weight: 1, kl_coef: c, kl_clamp: L`` under ``clip`` = verl's distillation with
    ``use_policy_gradient``, ``loss_mode: k1``, ``use_task_rewards``, ``distillation_loss_coef: c``,
    ``loss_max_clamp: L`` and its ``vanilla`` policy loss, with one update per rollout (ratio 1: verl
    sums two PPO losses, one per advantage, which is one loss of the summed advantages there)."""
    scores, index, mask, logp, _, _ = batch
    gen = torch.Generator().manual_seed(int(scores.abs().sum() * 100) % 1000)
    teacher = -torch.rand(logp.shape, generator=gen, dtype=F64) * 4
    task = estimator("grpo", std="unbiased")(inputs_of(scores, index, mask))
    adv = distillation(kl_coef=coef, kl_clamp=clamp, task_weight=1.0, task={"std": "unbiased"})(
        inputs_of(scores, index, mask, logp=logp * mask, teacher_logp=teacher * mask))
    mine = ours(component("policy_loss", "clip"), "token-mean", logp, logp, adv, mask)
    theirs = peer(lambda lp: verl.distillation_policy_gradient_loss(logp, lp, teacher, task, mask.to(F64), "token-mean",
                                                                    coef, clamp), logp)
    assert_same(mine, theirs)
