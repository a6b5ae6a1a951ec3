"""Every "equals OpenRLHF's X with option Y" of docs/algorithms.md, on OpenRLHF 0.11.2's formulas as
its source writes them (re-implemented in ``openrlhf_0_11_2.py``): values and gradients."""

from __future__ import annotations

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from grpo_core.train.learner.correction import rollout_correction

from . import openrlhf_0_11_2 as openrlhf
from .conftest import F64, FAST, assert_same, component, groups, inputs_of, ours, peer


def estimator(name, **options):
    return component("advantage_estimator", name, **options)


def grouped(scores, index):
    return scores.view(-1, index.count(0))


# --------------------------------------------------------------------------- advantages
@FAST
@given(groups())
def test_grpo_is_group_norm_and_dr_grpo(batch):
    """``grpo`` with ``std: unbiased, eps: 1e-9`` = ``--algo.advantage.estimator group_norm``; with
    ``scale_by_std: false`` = ``dr_grpo``."""
    scores, index, mask, *_ = batch
    got = estimator("grpo", std="unbiased", eps=1e-9)(inputs_of(scores, index, mask))
    torch.testing.assert_close(got, openrlhf.advantages(grouped(scores, index), mask.to(F64), "group_norm"))
    got = estimator("grpo", scale_by_std=False)(inputs_of(scores, index, mask))
    torch.testing.assert_close(got, openrlhf.advantages(grouped(scores, index), mask.to(F64), "dr_grpo"))


@FAST
@given(groups())
def test_rloo_is_rloo(batch):
    scores, index, mask, *_ = batch
    got = estimator("rloo")(inputs_of(scores, index, mask))
    torch.testing.assert_close(got, openrlhf.advantages(grouped(scores, index), mask.to(F64), "rloo"))


@FAST
@given(groups())
def test_reinforce_plus_plus_population_is_reinforce_baseline(batch):
    """``reinforce++`` with ``variance: population`` = ``reinforce_baseline`` (OpenRLHF divides by
    sqrt(max(var, 1e-8)), grpo-core by sqrt(var + 1e-8): equal up to 1e-8 where the batch has a spread)."""
    scores, index, mask, *_ = batch
    assume(any(len({float(scores[i]) for i in range(len(index)) if index[i] == g}) > 1 for g in set(index)))
    got = estimator("reinforce++", variance="population")(inputs_of(scores, index, mask))
    expected = openrlhf.advantages(grouped(scores, index), mask.to(F64), "reinforce_baseline")
    torch.testing.assert_close(got, expected * mask, rtol=1e-6, atol=1e-7)  # OpenRLHF whitens padding too


@FAST
@given(groups(), st.sampled_from([1.0, 0.9]))
def test_reinforce_plus_plus_no_baseline_population_is_reinforce(batch, gamma):
    scores, index, mask, *_ = batch
    assume(len(set(scores.tolist())) > 1)
    got = estimator("reinforce++-no-baseline", gamma=gamma, variance="population")(inputs_of(scores, index, mask))
    expected = openrlhf.advantages(grouped(scores, index), mask.to(F64), "reinforce", gamma=gamma)
    torch.testing.assert_close(got, expected * mask, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- kl
@FAST
@given(st.lists(st.tuples(st.floats(-30.0, 0.0), st.floats(-30.0, 0.0)), min_size=1, max_size=10),
       st.sampled_from([("low_var_kl", {}, "k3", False), ("kl", {"output_clamp": 10.0}, "k1", False),
                        ("mse", {"output_clamp": 10.0}, "k2", False), ("k3+", {}, "k3", True),
                        ("k1+", {"output_clamp": 10.0}, "k1", True)]))
def test_kl_estimators_are_compute_approx_kl(pairs, case):
    """``low_var_kl`` = ``--algo.kl.estimator k3``; ``kl`` / ``mse`` with ``output_clamp: 10`` = ``k1`` /
    ``k2`` (OpenRLHF clamps every estimate to [-10, 10]); ``k3+`` and ``k1+`` (output_clamp 10) = k3 /
    k1 with ``--algo.kl.unbiased_gradient`` when each rollout gets one update (its weight pi/pi_old is 1).
    In float32: OpenRLHF computes the KL in float32 whatever the log-probs' dtype."""
    name, options, estimator_name, unbiased = case
    logp = torch.tensor([[a for a, _ in pairs] + [-3.0, -12.0]], dtype=torch.float32)
    ref = torch.tensor([[b for _, b in pairs] + [0.0, 0.0]], dtype=torch.float32)
    mask = torch.ones_like(logp, dtype=torch.bool)
    mine, theirs = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    value = component("kl_penalty", name, **options)(mine, ref, mask)
    expected = openrlhf.compute_approx_kl(theirs, ref, estimator_name, log_probs_old=logp,
                                          unbiased_gradient=unbiased)
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    (g1,) = torch.autograd.grad(value.sum(), mine)
    (g2,) = torch.autograd.grad(expected.sum(), theirs)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- policy losses
@FAST
@given(groups(spread=1.5), st.sampled_from([("token-mean", True), ("seq-mean-token-mean", False)]),
       st.sampled_from([None, 3.0]), st.sampled_from([(0.2, 0.2), (0.2, 0.28)]))
def test_clip_is_ppo(batch, aggregation, dual_clip, eps):
    """``clip`` (eps_low, eps_high, dual_clip) = ``--actor.policy_loss_type ppo`` with
    ``--actor.eps_clip_low_high`` and ``--actor.dual_clip``; ``token-mean`` / ``seq-mean-token-mean`` =
    ``--actor.loss_agg_mode`` of the same name."""
    _, _, mask, logp, old, adv = batch
    mode, token_level = aggregation
    mine = ours(component("policy_loss", "clip", eps_low=eps[0], eps_high=eps[1], dual_clip=dual_clip), mode,
                logp, old, adv, mask)
    theirs = peer(lambda lp: openrlhf.policy_loss(lp, old, adv, mask.to(F64), clip_eps_low=eps[0],
                                                  clip_eps_high=eps[1], dual_clip=dual_clip,
                                                  token_level_loss=token_level), logp)
    assert_same(mine, theirs)


@FAST
@given(groups(spread=0.5))
def test_gspo_is_gspo(batch):
    """``gspo`` with seq-mean-token-mean = ``--actor.policy_loss_type gspo`` (which forces the per-sample
    mean) with ``--actor.eps_clip_low_high`` as eps_low/eps_high, without the rollout correction (with
    it, OpenRLHF's gspo ratio is against the sampler's log-probs)."""
    _, _, mask, logp, old, adv = batch
    mine = ours(component("policy_loss", "gspo", eps_low=0.05, eps_high=0.08), "seq-mean-token-mean", logp, old,
                adv, mask)
    theirs = peer(lambda lp: openrlhf.policy_loss(lp, old, adv, mask.to(F64), clip_eps_low=0.05, clip_eps_high=0.08,
                                                  policy_loss_type="gspo"), logp)
    assert_same(mine, theirs)


# --------------------------------------------------------------------------- rollout correction
CORRECTIONS = [  # (grpo-core's algorithm.rollout_correction, OpenRLHF's level / mode / threshold)
    ({"level": "token", "mode": "truncate", "cap": 2.0}, ("token", "clip", (0.0, 2.0))),
    ({"level": "token", "mode": "mask", "cap": 1.3}, ("token", "mask", (0.0, 1.3))),
    ({"level": "token", "mode": "mask", "cap": 1.3, "lower": 0.8}, ("token", "mask", (0.8, 1.3))),
    ({"level": "token", "mode": "truncate", "cap": 1e6, "reject": ("geometric", 0.9, 1.1)},
     ("seq", "mask", (0.9, 1.1))),
]


@FAST
@given(groups(spread=0.5), st.sampled_from(range(len(CORRECTIONS))), st.data())
def test_rollout_correction_is_is_correction(batch, case, data):
    """Under ``clip`` and token-mean: ``level: token, mode: truncate, cap: C`` = ``--algo.advantage.
    is_correction_level token --algo.advantage.is_correction_mode clip --algo.advantage.
    is_correction_threshold C`` (TIS); ``mode: mask`` (``cap: C``, ``lower: L``) = ``mode mask``,
    ``threshold C`` or ``L C`` (IcePop); ``reject: {statistic: geometric, low, high}`` with the token
    ratio as the weight (``level: token`` and a cap above every ratio) = ``is_correction_level seq``,
    ``mode mask``, ``threshold low high`` (seq-mask-tis: the kept rows keep their token weights)."""
    _, _, mask, logp, old, adv = batch
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    sampled = old + (torch.rand(old.shape, generator=gen, dtype=F64) * 0.8 - 0.4)
    options, (level, mode, threshold) = CORRECTIONS[case]
    weight, _ = rollout_correction(old, sampled, mask, **options)
    mine = ours(component("policy_loss", "clip"), "token-mean", logp, old, adv, mask, weight=weight)
    theirs = peer(lambda lp: openrlhf.policy_loss(lp, old, adv, mask.to(F64), is_correction_level=level,
                                                  is_correction_mode=mode, is_correction_threshold=threshold,
                                                  rollout_log_probs=sampled), logp)
    assert_same(mine, theirs)
