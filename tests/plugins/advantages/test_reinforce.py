"""``rloo``, ``reinforce++``, ``reinforce++-no-baseline`` and ``remax`` against plain loops and by
hand, ``masked_whiten`` on small counts, ReMax's reductions (to Dr. GRPO with a group-mean baseline,
to RLOO with a leave-one-out one)."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins.advantages.grpo import grpo_outcome_advantages
from grpo_plugins.advantages.reinforce import (
    ReinforcePlusPlusAdvantage,
    ReinforcePlusPlusOptions,
    ReMaxAdvantage,
    ReMaxOptions,
    masked_whiten,
    reinforce_no_baseline_advantages,
    reinforce_plus_plus_advantages,
    remax_advantages,
    rloo,
    rloo_advantages,
)
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.contracts import AdvantageInputs
from grpo_core.groups import group_mean

from .conftest import F64, FAST, NAN, grouped_batches, inputs, members


# --------------------------------------------------------------------------- rloo
def loop_rloo(scores, group_ids, mask):
    r = scores.tolist()
    per_row = [0.0] * len(r)
    for rows in members(group_ids).values():
        ok = [i for i in rows if not math.isnan(r[i])]
        if len(ok) < 2:
            continue
        for i in ok:
            others = [r[j] for j in ok if j != i]
            per_row[i] = r[i] - sum(others) / len(others)
    return torch.tensor(per_row, dtype=F64)[:, None] * mask


@FAST
@given(grouped_batches())
def test_rloo_matches_loop_reference(batch):
    scores, group_ids, mask = batch
    out = rloo(AdvantageInputs(scores, group_ids, mask))
    torch.testing.assert_close(out, loop_rloo(scores, group_ids, mask), rtol=1e-9, atol=1e-12)


def test_rloo_hand_values():
    out = rloo(inputs([1.0, 0.0, 0.0, 0.0, NAN, 2.0, NAN], [0, 0, 0, 0, 0, 1, 1]))[:, 0]
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0], dtype=F64)
    torch.testing.assert_close(out, expected)
    assert torch.equal(rloo(inputs([0.1] * 3)), torch.zeros(3, 3, dtype=F64))


# --------------------------------------------------------------------------- reinforce++
def loop_reinforce_pp(scores, group_ids, mask, eps=1e-8, variance="unbiased"):
    r = scores.tolist()
    a = [0.0] * len(r)
    for rows in members(group_ids).values():
        ok = [i for i in rows if not math.isnan(r[i])]
        for i in ok:
            a[i] = r[i] - sum(r[j] for j in ok) / len(ok)
    tokens = [
        (i, t)
        for i in range(len(r))
        for t in range(mask.shape[1])
        if mask[i, t] and not math.isnan(r[i])
    ]
    out = torch.zeros(mask.shape, dtype=F64)
    if not tokens:
        return out
    mean = sum(a[i] for i, _ in tokens) / len(tokens)
    divisor = len(tokens) - 1 if variance == "unbiased" else len(tokens)
    var = sum((a[i] - mean) ** 2 for i, _ in tokens) / max(divisor, 1)
    for i, t in tokens:
        out[i, t] = (a[i] - mean) / math.sqrt(var + eps)
    return out


@FAST
@given(grouped_batches(), st.sampled_from([1e-8, 0.5]), st.sampled_from(["unbiased", "population"]))
def test_reinforce_pp_matches_loop_reference(batch, eps, variance):
    scores, group_ids, mask = batch
    est = ReinforcePlusPlusAdvantage(ReinforcePlusPlusOptions(eps=eps, variance=variance))
    out = est(AdvantageInputs(scores, group_ids, mask))
    expected = loop_reinforce_pp(scores, group_ids, mask, eps, variance)
    torch.testing.assert_close(out, expected, rtol=1e-7, atol=1e-9)


def test_reinforce_pp_hand_values():
    # a = +0.5 (1 token), -0.5 (2 tokens); token mean -1/6; unbiased var 1/3
    mask = torch.tensor([[1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    out = reinforce_plus_plus_advantages(
        torch.tensor([1.0, 0.0, NAN], dtype=F64), torch.tensor([0, 0, 0]), mask, eps=1e-8
    )
    d = math.sqrt(1 / 3 + 1e-8)
    expected = torch.tensor([[2 / 3 / d, 0.0], [-1 / 3 / d, -1 / 3 / d], [0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out, expected)


def test_masked_whiten_small_counts():
    values = torch.tensor([[3.0, 9.0]], dtype=F64)
    one = masked_whiten(values, torch.tensor([[True, False]]))
    assert torch.equal(one, torch.zeros(1, 2, dtype=F64))
    none = masked_whiten(values, torch.tensor([[False, False]]))
    assert torch.equal(none, torch.zeros(1, 2, dtype=F64))


# --------------------------------------------------------------------------- reinforce++ without baseline
def loop_reinforce(scores, mask, gamma=1.0, eps=1e-8):
    """REINFORCE++ (https://arxiv.org/abs/2501.03262) without baseline: reward on the last
    completion token, G_t = r_t + gamma G_{t+1} over the completion's tokens, then
    (G - mean) / sqrt(var + eps) with mean and Bessel-corrected var over every scorable token."""
    r = scores.tolist()
    returns = torch.zeros(mask.shape, dtype=F64)
    tokens = []
    for i, row in enumerate(mask.tolist()):
        positions = [t for t, m in enumerate(row) if m]
        if math.isnan(r[i]) or not positions:
            continue
        running = 0.0
        for t in reversed(positions):
            running = (r[i] if t == positions[-1] else 0.0) + gamma * running
            returns[i, t] = running
            tokens.append((i, t))
    if not tokens:
        return returns
    values = [float(returns[i, t]) for i, t in tokens]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    out = torch.zeros(mask.shape, dtype=F64)
    for (i, t), v in zip(tokens, values):
        out[i, t] = (v - mean) / math.sqrt(var + eps)
    return out


@FAST
@given(grouped_batches(), st.sampled_from([1.0, 0.9, 0.5]), st.sampled_from([1e-8, 0.5]))
def test_reinforce_no_baseline_matches_loop_reference(batch, gamma, eps):
    scores, _, mask = batch
    got = reinforce_no_baseline_advantages(scores, mask, gamma=gamma, eps=eps)
    torch.testing.assert_close(got, loop_reinforce(scores, mask, gamma, eps))


def test_reinforce_no_baseline_hand_values():
    mask = torch.tensor([[True, True], [True, False]])
    # gamma = 0.5: returns [0.5, 1] and [0]; mean 0.5, unbiased var 0.25
    out = reinforce_no_baseline_advantages(torch.tensor([1.0, 0.0]), mask, gamma=0.5, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0], [-1.0, 0.0]]))


@FAST
@given(grouped_batches(nan=True))
def test_reinforce_no_baseline_whitened_over_the_batch_and_gamma_one_is_plain_whitening(batch):
    scores, _, mask = batch
    out = reinforce_no_baseline_advantages(scores, mask, eps=1e-12)
    scorable = mask & ~torch.isnan(scores)[:, None]
    assert torch.all(out[~scorable] == 0)
    values = out[scorable]
    if values.numel() >= 2 and values.abs().max() > 0:
        assert abs(float(values.mean())) < 1e-9 and abs(float(values.var()) - 1) < 1e-6
    plain = masked_whiten(torch.nan_to_num(scores)[:, None] * scorable, scorable, 1e-12)
    torch.testing.assert_close(out, plain)


# --------------------------------------------------------------------------- remax
def test_remax_hand_values_and_missing_baseline():
    scores = torch.tensor([1.0, 0.0, NAN, 0.5, 1.0, 0.0])
    greedy = torch.tensor([0.5, 0.5, 0.5, NAN, NAN, NAN])
    ids, mask = torch.arange(2).repeat_interleave(3), torch.ones(6, 2, dtype=torch.bool)
    out = remax_advantages(scores, greedy, ids, mask)
    torch.testing.assert_close(out[:, 0], torch.tensor([0.5, -0.5, 0, 0, 0, 0]))
    out = remax_advantages(scores, greedy, ids, mask, missing_baseline="group-mean")
    torch.testing.assert_close(out[:, 0], torch.tensor([0.5, -0.5, 0, 0, 0.5, -0.5]))


@FAST
@given(grouped_batches(nan=True), st.integers(-8, 8).map(lambda k: k / 4))
def test_remax_with_group_mean_baseline_is_dr_grpo_and_shift_invariant(batch, shift):
    scores, group_ids, mask = batch
    mean = group_mean(scores, group_ids)
    out = remax_advantages(scores, mean, group_ids, mask)
    dr = grpo_outcome_advantages(scores, group_ids, mask, scale_by_std=False)
    # equal but for constant groups, where Dr. GRPO is exactly 0 and ReMax's r - mean is too
    torch.testing.assert_close(out, dr)
    shifted = remax_advantages(scores + shift, mean + shift, group_ids, mask)
    torch.testing.assert_close(shifted, out)
    assert torch.all(out[~mask] == 0)


@FAST
@given(grouped_batches(nan=False, min_group=2))
def test_remax_with_a_leave_one_out_baseline_is_rloo(batch):
    scores, group_ids, mask = batch
    loo = torch.zeros_like(scores)
    for rows in members(group_ids).values():
        for i in rows:
            loo[i] = sum(float(scores[j]) for j in rows if j != i) / (len(rows) - 1)
    torch.testing.assert_close(remax_advantages(scores, loo, group_ids, mask),
                               rloo_advantages(scores, group_ids, mask))


def test_remax_without_baseline_names_the_flag():
    component = ReMaxAdvantage(ReMaxOptions())
    batch = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long),
                            torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs inputs.baseline_scores.*needs_greedy_baseline = True"):
        component(batch)
    batch.baseline_scores = torch.tensor([0.25, 0.25])
    torch.testing.assert_close(component(batch)[:, 0], torch.tensor([0.75, -0.25]))
