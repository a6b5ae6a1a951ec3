"""Every "equals TRL's X with option Y" of docs/algorithms.md, on TRL 1.16's formulas as its source
writes them (re-implemented in ``trl_1_16.py``): values and gradients, one process, one
micro-batch."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.contracts import BatchStats, PolicyLossInputs
from grpo_core.train.learner.correction import rollout_correction
from grpo_core.train.learner.kl import Reference

from . import trl_1_16 as trl
from .conftest import F64, FAST, assert_same, component, groups, inputs_of, ours, peer

NAN = float("nan")


@st.composite
def reward_tables(draw):
    """(batch, rewards_per_func (B, F) with None as NaN, weights (F,)); a row may be all-NaN."""
    batch = draw(groups())
    rows, functions = len(batch[1]), draw(st.integers(1, 3))
    entry = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 3.0]), st.just(NAN))
    table = torch.tensor(draw(st.lists(st.lists(entry, min_size=functions, max_size=functions), min_size=rows,
                                       max_size=rows)), dtype=F64)
    weights = torch.tensor(draw(st.lists(st.sampled_from([1.0, 0.5, 2.0]), min_size=functions, max_size=functions)),
                           dtype=F64)
    return batch, table, weights


def engine_total(table, weights):
    """The engine's reward: the weighted sum of the scored functions, NaN where none scored."""
    scored = ~torch.isnan(table)
    return torch.where(scored.any(dim=1), torch.where(scored, table * weights, 0.0).sum(dim=1), NAN)


# --------------------------------------------------------------------------- advantages
@FAST
@given(reward_tables(), st.sampled_from([({}, "group"), ({"scale_by_std": False}, "none"),
                                          ({"std_scope": "batch"}, "batch")]))
def test_grpo_is_sum_then_normalize(drawn, case):
    """``grpo`` with ``std: unbiased, eps: 1e-4`` = GRPOTrainer's default advantage
    (``multi_objective_aggregation="sum_then_normalize"``, ``scale_rewards="group"``); with
    ``scale_by_std: false`` = ``scale_rewards="none"``; with ``std_scope: batch`` = ``"batch"``. Functions
    that return None and rows nobody scored included."""
    (_, index, mask, *_), table, weights = drawn
    options, scale_rewards = case
    got = component("advantage_estimator", "grpo", std="unbiased", eps=1e-4, **options)(
        inputs_of(engine_total(table, weights), index, mask))
    expected = trl.advantages(table, weights, index.count(0), "sum_then_normalize", scale_rewards)
    torch.testing.assert_close(got, expected[:, None] * mask)


@FAST
@given(reward_tables())
def test_gdpo_is_normalize_then_sum(drawn):
    """``gdpo`` with ``eps: 1e-4, batch_eps: 1e-4`` (its default batch_norm: sequence, std: unbiased) =
    ``multi_objective_aggregation="normalize_then_sum"``."""
    (_, index, mask, *_), table, weights = drawn
    got = component("advantage_estimator", "gdpo", eps=1e-4, batch_eps=1e-4)(
        inputs_of(engine_total(table, weights), index, mask, reward_scores=table, reward_weights=weights))
    expected = trl.advantages(table, weights, index.count(0), "normalize_then_sum")
    torch.testing.assert_close(got, expected[:, None] * mask)


# --------------------------------------------------------------------------- losses and aggregation
LOSSES = [  # (grpo-core policy loss with options, aggregator, TRL keyword arguments of _compute_loss)
    (("clip", {"eps_low": 0.2, "eps_high": 0.28}), "seq-mean-token-mean", {"loss_type": "grpo", "epsilon_high": 0.28}),
    (("clip", {}), "token-mean", {"loss_type": "dapo"}),
    (("clip", {}), "token-mean", {"loss_type": "bnpo"}),
    (("clip", {}), "seq-mean-token-sum-norm", {"loss_type": "dr_grpo"}),
    (("gspo", {"eps_low": 0.05, "eps_high": 0.08}), "seq-mean-token-mean",
     {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_low": 0.05, "epsilon_high": 0.08}),
    (("gspo", {"eps_low": 0.05, "eps_high": 0.08}), "seq-mean-token-sum",
     {"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon_low": 0.05, "epsilon_high": 0.08}),
    (("cispo", {"eps_high": 4.0}), "token-mean", {"loss_type": "cispo", "epsilon_high": 5.0}),
    (("sapo", {"tau_pos": 1.0, "tau_neg": 1.05}), "seq-mean-token-mean", {"loss_type": "sapo"}),
    (("vespo", {}), "token-mean", {"loss_type": "vespo"}),
]
# TRL builds SAPO's temperatures with torch.where of two Python floats: a float32 tensor, so 1.05 is
# 1.0499999523. Rows of positive and negative advantage cancel in the mean, which leaves that rounding
# at up to ~4e-8 absolute on losses of ~5e-3 (found by hypothesis at rtol 1e-6); a wrong temperature
# (tau_neg 1.0) moves the loss or its gradient by 0.036 in the median of 300 drawn batches.
TOLERANCE = {"sapo": {"atol": 1e-7}}


@FAST
@given(groups(spread=0.5), st.sampled_from(range(len(LOSSES))))
def test_losses_and_aggregators_are_trl_loss_types(batch, case):
    """Each row: ``clip`` = the default clipped loss (``epsilon``, ``epsilon_high``) aggregated by
    ``loss_type`` ``grpo`` (seq-mean-token-mean), ``dapo`` / ``bnpo`` (token-mean, over the whole batch /
    per process), ``dr_grpo`` (seq-mean-token-sum-norm, L = ``max_completion_length``); ``gspo`` =
    ``importance_sampling_level="sequence"``, and with seq-mean-token-sum ``loss_type="luspo"``; ``cispo`` =
    ``loss_type="cispo"`` with ``eps_high`` = TRL's ``epsilon_high`` - 1 (TRL caps the weight at
    epsilon_high itself); ``sapo`` and ``vespo`` = their loss types."""
    _, _, mask, logp, old, adv = batch
    (name, options), aggregation, kwargs = LOSSES[case]
    max_length = mask.shape[1] + 2
    mine = ours(component("policy_loss", name, **options), aggregation, logp, old, adv, mask, max_length=max_length)
    theirs = peer(lambda lp: trl.compute_loss(lp, old, adv, mask.to(F64), max_completion_length=max_length,
                                              **kwargs), logp)
    assert_same(mine, theirs, **TOLERANCE.get(name, {}))


@FAST
@given(groups(spread=0.5), st.sampled_from([0.05, 0.3]), st.booleans())
def test_opsm_is_off_policy_mask_threshold(batch, delta, with_sampler):
    """``opsm`` with ``delta`` = the default loss with ``off_policy_mask_threshold: delta``, the sampler's
    log-probs from vLLM or, without them, the old ones."""
    _, _, mask, logp, old, adv = batch
    sampled = (old + 0.3 * torch.sin(7 * old)) if with_sampler else None
    mine = ours(component("policy_loss", "opsm", delta=delta), "seq-mean-token-mean", logp, old, adv, mask,
                sampling=sampled)
    theirs = peer(lambda lp: trl.compute_loss(lp, old, adv, mask.to(F64), off_policy_mask_threshold=delta,
                                              sampling_per_token_logps=sampled), logp)
    assert_same(mine, theirs)


@FAST
@given(groups(spread=0.5), st.sampled_from([0.04, 0.3]))
def test_low_var_kl_without_clamps_is_trl_s_kl_without_its_bias_correction(batch, beta):
    """The KL in the loss: ``low_var_kl`` with ``log_ratio_clamp: null, output_clamp: null`` and ``beta`` =
    TRL's k3 with ``use_bias_correction_kl=False``. TRL's default (True) multiplies the k3 estimate by
    the importance ratio, whose gradient adds k3 * grad logp even on-policy: another gradient."""
    _, _, mask, logp, old, adv = batch
    ref = logp + 0.4 * torch.cos(5 * logp)
    kl = component("kl_penalty", "low_var_kl", log_ratio_clamp=None, output_clamp=None)
    clip = component("policy_loss", "clip")

    def mine_fn(lp):
        per_token = clip(PolicyLossInputs(lp, old, adv, mask)).loss + beta * kl(lp, ref, mask)
        stats = BatchStats(int(mask.sum()), mask.shape[0], mask.shape[1])
        return component("loss_aggregator", "seq-mean-token-mean")(per_token, mask, stats)

    kwargs = dict(beta=beta, ref_per_token_logps=ref)
    assert_same(peer(mine_fn, logp), peer(lambda lp: trl.compute_loss(
        lp, old, adv, mask.to(F64), use_bias_correction_kl=False, **kwargs), logp))
    on_policy = peer(mine_fn, old)
    corrected = peer(lambda lp: trl.compute_loss(lp, old, adv, mask.to(F64), **kwargs), old)
    torch.testing.assert_close(on_policy[0], corrected[0])  # the same value at ratio 1 ...
    assert not torch.allclose(on_policy[1], corrected[1])  # ... not the same gradient


# --------------------------------------------------------------------------- vLLM importance sampling
MODES = [  # (grpo-core's algorithm.rollout_correction, TRL's vllm_importance_sampling_mode, clip_min, clip_max)
    ({"level": "token", "mode": "truncate", "cap": 2.0}, "token_truncate", None, 2.0),
    ({"level": "sequence", "mode": "truncate", "cap": 2.0}, "sequence_truncate", None, 2.0),
    ({"level": "token", "mode": "mask", "cap": 1.3}, "token_mask", None, 1.3),
    ({"level": "token", "mode": "mask", "cap": 1.3, "lower": 0.8}, "token_mask", 0.8, 1.3),
    ({"level": "sequence", "mode": "mask", "cap": 1.5, "lower": 0.5}, "sequence_mask", 0.5, 1.5),
]


@FAST
@given(groups(spread=0.3), st.sampled_from(range(len(MODES))), st.data())
def test_rollout_correction_is_vllm_importance_sampling(batch, case, data):
    """``level``/``mode``/``cap``/``lower`` = ``vllm_importance_sampling_mode`` with
    ``vllm_importance_sampling_clip_max`` = cap and ``_clip_min`` = lower (unset); TRL's ``*_truncate``
    with a ``clip_min`` clamps below where grpo-core's ``lower`` zeroes, so that pair is left out."""
    _, _, mask, logp, old, adv = batch
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    sampled = old + (torch.rand(old.shape, generator=gen, dtype=F64) * 0.6 - 0.3) * mask
    options, mode, low, high = MODES[case]
    weight, _ = rollout_correction(old, sampled, mask, **options)
    ratio = trl.vllm_is_ratio(old, sampled, mask.to(F64), mode, clip_min=low, clip_max=high)
    mine = ours(component("policy_loss", "clip"), "seq-mean-token-mean", logp, old, adv, mask, weight=weight)
    theirs = peer(lambda lp: trl.compute_loss(lp, old, adv, mask.to(F64), importance_sampling_ratio=ratio), logp)
    assert_same(mine, theirs)


# --------------------------------------------------------------------------- reference sync
@FAST
@given(st.sampled_from([0.6, 0.25, 1.0]), st.integers(0, 2**31 - 1))
def test_ref_sync_is_sync_ref_model(alpha, seed):
    """``algorithm.kl.ref_sync: {every: N, alpha: a}`` = ``sync_ref_model=True, ref_model_sync_steps=N,
    ref_model_mixup_alpha=a``: each sync moves every reference parameter to ``a * policy + (1 - a) * ref``
    (docs/guides/dynamic-sampling-and-kl.md)."""
    torch.manual_seed(seed)
    policy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    reference = Reference(policy)
    theirs = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    theirs.load_state_dict(reference.model.state_dict())
    start = [p.detach().clone() for p in reference.model.parameters()]
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter))
    reference.mix_toward(policy, alpha)
    trl.sync_target_model(policy, theirs, alpha)
    for got, expected in zip(reference.model.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(got, expected)
    assert all(not torch.equal(got, before) for got, before in zip(reference.model.parameters(), start))


# --------------------------------------------------------------------------- the TRL door's settings
def door_algorithm(**fields) -> dict:
    """The ``algorithm`` section ``grpo_core.trl.GRPOConfig(**fields)`` writes (8 training rows)."""
    from grpo_core.trl import GRPOConfig

    return GRPOConfig("out", **fields).spec_data(rows=8)["algorithm"]


def built(section: dict, kind: str):
    """The component a spec section names, with the section's other keys as its options."""
    options = {k: v for k, v in section.items() if k != "name"}
    return component(kind, section["name"], **options)


DOOR_LOSSES = [  # TRL's GRPOConfig fields; the same fields as _compute_loss's keyword arguments
    ({"loss_type": "vespo"}, {"loss_type": "vespo"}),
    ({"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 4.0, "vespo_lambda_neg": 1.0},
     {"loss_type": "vespo", "vespo": {"k_pos": 1.5, "lambda_pos": 2.5, "k_neg": 4.0, "lambda_neg": 1.0}}),
    ({"loss_type": "vespo", "importance_sampling_level": "sequence", "use_bias_correction_kl": False},
     {"loss_type": "vespo", "importance_sampling_level": "sequence"}),
    ({"loss_type": "grpo", "off_policy_mask_threshold": 0.05},
     {"loss_type": "grpo", "off_policy_mask_threshold": 0.05}),
    ({"loss_type": "dapo", "off_policy_mask_threshold": 0.3, "epsilon_high": 0.28},
     {"loss_type": "dapo", "off_policy_mask_threshold": 0.3, "epsilon_high": 0.28}),
    ({"loss_type": "luspo"}, {"loss_type": "luspo"}),  # TRL's default token level: TRL warns and trains
    ({"loss_type": "luspo", "epsilon_high": 0.28, "off_policy_mask_threshold": 0.1},
     {"loss_type": "luspo", "epsilon_high": 0.28, "off_policy_mask_threshold": 0.1}),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence", "use_bias_correction_kl": False},
     {"loss_type": "luspo", "importance_sampling_level": "sequence"}),
]


@FAST
@given(groups(spread=0.5), st.sampled_from(range(len(DOOR_LOSSES))), st.booleans())
def test_the_doors_vespo_luspo_and_off_policy_mask_are_trls(batch, case, with_sampler):
    """The policy loss and aggregator the TRL door writes for ``loss_type="vespo"`` (with its
    ``vespo_*``; ``importance_sampling_level``, which vespo does not read), for ``loss_type="luspo"``
    at either ``importance_sampling_level`` (TRL warns at its default, ``"token"``, and trains) and for
    ``off_policy_mask_threshold`` = TRL's ``_compute_loss`` with those arguments, with and without
    the sampler's log-probs (vLLM's, with its importance-sampling correction off)."""
    _, _, mask, logp, old, adv = batch
    fields, kwargs = DOOR_LOSSES[case]
    algorithm = door_algorithm(**fields)
    sampled = (old + 0.3 * torch.sin(7 * old)) if with_sampler else None
    mine = ours(built(algorithm["policy_loss"], "policy_loss"), algorithm["aggregation"]["name"], logp, old, adv,
                mask, sampling=sampled)
    theirs = peer(lambda lp: trl.compute_loss(lp, old, adv, mask.to(F64), sampling_per_token_logps=sampled,
                                              **kwargs), logp)
    assert_same(mine, theirs)


@FAST
@given(reward_tables())
def test_the_doors_normalize_then_sum_is_trls(drawn):
    """The advantage estimator the TRL door writes for ``multi_objective_aggregation="normalize_then_sum"``
    (whatever ``scale_rewards``, which TRL does not read then) = TRL's advantages."""
    (_, index, mask, *_), table, weights = drawn
    for scale_rewards in ("group", "batch", False):
        algorithm = door_algorithm(multi_objective_aggregation="normalize_then_sum", scale_rewards=scale_rewards)
        got = built(algorithm["advantage"], "advantage_estimator")(
            inputs_of(engine_total(table, weights), index, mask, reward_scores=table, reward_weights=weights))
        expected = trl.advantages(table, weights, index.count(0), "normalize_then_sum")
        torch.testing.assert_close(got, expected[:, None] * mask)
