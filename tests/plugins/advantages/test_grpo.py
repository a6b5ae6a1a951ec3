"""``grpo``, ``dapo-token-scale``, ``gpg`` and ``opo``: hand values, plain-loop references over many
shapes, the invariants of the design (zero mean and unit std per group, zero for constant groups
and on padding, invariance to a positive affine map), DAPO's token-mean equivalence, GPG's and OPO's
reductions to (Dr.) GRPO."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins.advantages.grpo import (
    DAPOTokenScaleAdvantage,
    GRPOAdvantage,
    GRPOOptions,
    dapo_token_scale_advantages,
    gpg_advantages,
    grpo_outcome_advantages,
    grpo_sequence_advantages,
    opo_advantages,
)
from grpo_plugins.aggregators import seq_mean_token_mean, token_mean
from grpo_plugins.losses.clip import ppo_clip_loss
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.contracts import BatchStats

from .conftest import F64, FAST, NAN, constant, grouped_batches, inputs, members, scorable


# --------------------------------------------------------------------------- grpo by hand
def loop_grpo(
    scores, group_ids, mask, scale_by_std=True, std="population", std_scope="group", eps=1e-6
):
    """Plain-Python reference of the GRPO outcome advantage."""
    ddof = 1 if std == "unbiased" else 0
    r = scores.tolist()
    everyone = [x for x in r if not math.isnan(x)]
    per_row = [0.0] * len(r)
    for rows in members(group_ids).values():
        vals = [r[i] for i in rows if not math.isnan(r[i])]
        if len(vals) < 2 or len(set(vals)) == 1:
            continue
        mean = sum(vals) / len(vals)
        pool, centre = (
            (everyone, sum(everyone) / len(everyone)) if std_scope == "batch" else (vals, mean)
        )
        sd = math.sqrt(sum((x - centre) ** 2 for x in pool) / (len(pool) - ddof))
        for i in rows:
            if not math.isnan(r[i]):
                per_row[i] = (r[i] - mean) / (sd + eps) if scale_by_std else r[i] - mean
    return torch.tensor(per_row, dtype=F64)[:, None] * mask


def grpo(scores, group_ids=None, mask=None, **options):
    return GRPOAdvantage(GRPOOptions(**options))(inputs(scores, group_ids, mask))


def test_grpo_hand_values_population_std():
    # mean 4, population std sqrt(8/3): A = -+sqrt(3/2), 0
    out = grpo([2.0, 4.0, 6.0], eps=0.0)
    expected = torch.tensor([-math.sqrt(1.5), 0.0, math.sqrt(1.5)], dtype=F64)
    torch.testing.assert_close(out, expected[:, None].expand(3, 3))


def test_grpo_unbiased_vs_population_by_hand():
    r = [1.0, 0.0, 0.0, 0.0]  # mean 1/4; population var 3/16, unbiased var 1/4
    pop = grpo(r, eps=0.0)[:, 0]
    unb = grpo(r, eps=0.0, std="unbiased")[:, 0]
    s3 = math.sqrt(3.0)
    torch.testing.assert_close(pop, torch.tensor([s3, -1 / s3, -1 / s3, -1 / s3], dtype=F64))
    torch.testing.assert_close(unb, torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=F64))
    # eps is added to the std, not the variance: 0.75 / (0.5 + 0.25) = 1
    torch.testing.assert_close(
        grpo(r, eps=0.25, std="unbiased")[0, 0], torch.tensor(1.0, dtype=F64)
    )


def test_grpo_scale_by_std_false_is_dr_grpo():
    out = grpo([1.0, 0.0, 0.0, 0.0], scale_by_std=False)[:, 0]
    torch.testing.assert_close(out, torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=F64))


def test_grpo_batch_scope_by_hand():
    # scorable rewards 1, 0, 3, 3: batch mean 1.75, population var 27/16; the mean stays per group
    out = grpo([1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1], std_scope="batch", eps=0.0)[:, 0]
    a = 0.5 / math.sqrt(27 / 16)
    torch.testing.assert_close(out, torch.tensor([a, -a, 0.0, 0.0], dtype=F64))
    out = grpo([1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1], std_scope="batch", std="unbiased", eps=0.0)
    torch.testing.assert_close(out[0, 0], torch.tensor(0.5 / math.sqrt(27 / 12), dtype=F64))


@pytest.mark.parametrize("value", [0.1, 0.7, 1 / 3, 1e-3, 123.456])
@pytest.mark.parametrize("group", [3, 5, 7, 10])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"eps": 0.0},
        {"scale_by_std": False},
        {"std": "unbiased", "eps": 0.0},
        {"std_scope": "batch"},
    ],
)
def test_grpo_constant_group_is_exactly_zero(value, group, options):
    scores = [value] * group + [0.0, 1.0]
    out = grpo(scores, [0] * group + [1, 1], **options)
    assert torch.equal(out[:group], torch.zeros(group, 3, dtype=F64))
    assert (out[group:] != 0).all()  # the other group is untouched


def test_constant_group_float_residue_would_bite():
    """The case the exact check exists for: a naive mean leaves residue, eps=0 blows it up."""
    r = torch.tensor([0.1] * 3, dtype=F64)
    assert (r - r.mean() != 0).any()
    assert torch.equal(grpo(r.tolist(), eps=0.0), torch.zeros(3, 3, dtype=F64))


def test_grpo_nan_scores_excluded_and_zero():
    with_nan = grpo([1.0, NAN, 0.0, 0.5, NAN], eps=0.0)[:, 0]
    without = grpo([1.0, 0.0, 0.5], eps=0.0)[:, 0]
    assert with_nan[1] == 0 and with_nan[4] == 0
    torch.testing.assert_close(with_nan[[0, 2, 3]], without)


def test_grpo_single_scorable_member_is_zero():
    out = grpo([5.0, NAN, NAN, 1.0, 2.0], [0, 0, 0, 1, 1], scale_by_std=False)[:, 0]
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, -0.5, 0.5], dtype=F64))
    assert torch.equal(grpo([3.0])[0], torch.zeros(3, dtype=F64))


def test_grpo_groups_need_not_be_contiguous_nor_dense():
    scores = [1.0, 10.0, 0.0, 20.0]
    out = grpo(scores, [7, 3, 7, 3], eps=0.0)[:, 0]
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=F64))


def test_grpo_padding_zero_shape_dtype():
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    out = grpo([1.0, 0.0, 2.0], mask=mask)
    assert out.shape == (3, 3) and out.dtype == F64
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    out32 = grpo_outcome_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask[:2])
    assert out32.dtype == torch.float32


def test_grpo_rejects_infinite_scores_and_bad_shapes():
    with pytest.raises(ValueError, match="finite, or NaN.*rows \\[1\\]"):
        grpo([1.0, math.inf])
    with pytest.raises(ValueError, match="group_ids must have shape"):
        grpo([1.0, 0.0], group_ids=[0, 0, 0])
    with pytest.raises(ValueError, match="scores must be \\(B,\\) and mask \\(B, T\\)"):
        grpo([1.0, 0.0], mask=torch.ones(3, 2, dtype=torch.bool))


# --------------------------------------------------------------------------- grpo invariants
@FAST
@given(
    grouped_batches(),
    st.sampled_from([True, False]),
    st.sampled_from(["population", "unbiased"]),
    st.sampled_from(["group", "batch"]),
    st.sampled_from([0.0, 1e-6, 0.1]),
)
def test_grpo_matches_loop_reference(batch, scale, std, scope, eps):
    scores, group_ids, mask = batch
    out = grpo_outcome_advantages(
        scores, group_ids, mask, scale_by_std=scale, std=std, std_scope=scope, eps=eps
    )
    expected = loop_grpo(scores, group_ids, mask, scale, std, scope, eps)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)


@FAST
@given(grouped_batches())
def test_grpo_zero_mean_unit_std_per_group(batch):
    scores, group_ids, mask = batch
    full = torch.ones(mask.shape[0], 1, dtype=torch.bool)  # one token per row: read A_i
    a = grpo_outcome_advantages(scores, group_ids, full, eps=0.0)[:, 0]
    for rows in members(group_ids).values():
        idx = [i for i in rows if not math.isnan(scores[i].item())]
        group_a = a[idx]
        assert abs(group_a.sum().item()) < 1e-9
        if len(set(scores[idx].tolist())) > 1:
            torch.testing.assert_close(group_a.std(correction=0), torch.tensor(1.0, dtype=F64))
        else:
            assert torch.equal(group_a, torch.zeros_like(group_a))
    assert torch.equal(
        a[torch.isnan(scores)], torch.zeros(int(torch.isnan(scores).sum()), dtype=F64)
    )


@FAST
@given(grouped_batches())
def test_grpo_per_token_layout(batch):
    scores, group_ids, mask = batch
    out = grpo_outcome_advantages(scores, group_ids, mask)
    assert out.shape == mask.shape
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    row_value = grpo_sequence_advantages(scores, group_ids)
    torch.testing.assert_close(out, torch.where(mask, row_value[:, None], 0.0))


@FAST
@given(
    grouped_batches(),
    st.floats(0.5, 4.0),
    st.floats(-5.0, 5.0),
    st.sampled_from(["group", "batch"]),
)
def test_grpo_invariant_under_positive_affine_map(batch, a, b, scope):
    scores, group_ids, mask = batch
    before = grpo_outcome_advantages(scores, group_ids, mask, eps=0.0, std_scope=scope)
    after = grpo_outcome_advantages(a * scores + b, group_ids, mask, eps=0.0, std_scope=scope)
    torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------- dapo-token-scale
@FAST
@given(grouped_batches(nan=True, min_group=2), st.integers(0, 2**31 - 1))
def test_dapo_seq_mean_equals_grpo_token_mean(batch, seed):
    scores, group_ids, mask = batch
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(mask.shape, generator=gen, dtype=F64)).requires_grad_(True)
    stats = BatchStats(int(mask.sum()), mask.shape[0], mask.shape[1])

    def loss_and_grad(advantages, aggregate):
        out = ppo_clip_loss(logp, logp.detach(), advantages, mask)
        loss = aggregate(out.loss, mask, stats)
        (grad,) = torch.autograd.grad(loss, logp)
        return loss.detach(), grad

    dapo = dapo_token_scale_advantages(scores, group_ids, mask)
    base = grpo_outcome_advantages(scores, group_ids, mask)
    loss_d, grad_d = loss_and_grad(dapo, seq_mean_token_mean)
    loss_g, grad_g = loss_and_grad(base, token_mean)
    torch.testing.assert_close(loss_d, loss_g, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad_d, grad_g, rtol=1e-9, atol=1e-12)


def test_dapo_scale_by_hand_and_empty_batch():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)  # |o| = 3, 1; B = 2
    est = DAPOTokenScaleAdvantage(GRPOOptions(eps=0.0))
    out = est(inputs([1.0, 0.0], mask=mask))
    expected = torch.tensor([[1.5, 1.5, 1.5], [-0.5, 0.0, 0.0]], dtype=F64)  # +-1 * |o_i| * 2 / 4
    torch.testing.assert_close(out, expected)
    empty = est(inputs([1.0, 0.0], mask=torch.zeros(2, 3, dtype=torch.bool)))
    assert torch.equal(empty, torch.zeros(2, 3, dtype=F64))


# --------------------------------------------------------------------------- gpg
def loop_gpg(scores, group_ids, mask, scale_by_std=False, rescale=True, eps=1e-6):
    """GPG (https://arxiv.org/abs/2504.02546): alpha (r_i - mean) / F_norm, alpha = B / (B - M)."""
    r = scores.tolist()
    out = [0.0] * len(r)
    zeroed = sum(1 for x in r if math.isnan(x))
    for rows in members(group_ids).values():
        ok = scorable(r, rows)
        if constant(r, ok):
            zeroed += len(ok)
            continue
        mean = sum(r[i] for i in ok) / len(ok)
        sd = math.sqrt(sum((r[i] - mean) ** 2 for i in ok) / (len(ok) - 1))
        for i in ok:
            out[i] = (r[i] - mean) / (sd + eps if scale_by_std else 1.0)
    alpha = len(r) / (len(r) - zeroed) if rescale and len(r) > zeroed else 1.0
    return alpha * torch.tensor(out, dtype=F64)[:, None] * mask


def test_gpg_hand_values():
    scores = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1])  # second group constant: B = 8, M = 4, alpha = 2
    out = gpg_advantages(scores, torch.arange(2).repeat_interleave(4), torch.ones(8, 1, dtype=torch.bool))
    torch.testing.assert_close(out[:, 0], torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], dtype=torch.float32))
    every = gpg_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool))
    assert torch.equal(every, torch.zeros(4, 2))  # no signal anywhere: zero, not a division by 0


@FAST
@given(grouped_batches(), st.booleans(), st.booleans(), st.sampled_from([0.0, 1e-6]))
def test_gpg_matches_loop_reference(batch, scale, rescale, eps):
    scores, group_ids, mask = batch
    got = gpg_advantages(scores, group_ids, mask, scale_by_std=scale, rescale=rescale, eps=eps)
    torch.testing.assert_close(got, loop_gpg(scores, group_ids, mask, scale, rescale, eps))


@FAST
@given(grouped_batches())
def test_gpg_reduces_to_dr_grpo_and_grpo_without_rescale(batch):
    scores, group_ids, mask = batch
    plain = gpg_advantages(scores, group_ids, mask, rescale=False)
    torch.testing.assert_close(plain, grpo_outcome_advantages(scores, group_ids, mask, scale_by_std=False))
    scaled = gpg_advantages(scores, group_ids, mask, scale_by_std=True, rescale=False)
    torch.testing.assert_close(scaled, grpo_outcome_advantages(scores, group_ids, mask, std="unbiased"))


@FAST
@given(grouped_batches(nan=True))
def test_gpg_zero_mean_per_group_and_alpha_at_least_one(batch):
    scores, group_ids, mask = batch
    ones = torch.ones(scores.shape[0], 1, dtype=torch.bool)
    out = gpg_advantages(scores, group_ids, ones)[:, 0]
    plain = gpg_advantages(scores, group_ids, ones, rescale=False)[:, 0]
    for rows in members(group_ids).values():
        assert abs(float(out[rows].sum())) < 1e-9
    assert torch.all(out.abs() >= plain.abs())


# --------------------------------------------------------------------------- opo
def loop_opo(scores, group_ids, mask):
    """OPO (https://arxiv.org/abs/2505.23585): b = sum_j |o_j| r_j / sum_j |o_j| per group."""
    r, lengths = scores.tolist(), mask.sum(1).tolist()
    out = [0.0] * len(r)
    for rows in members(group_ids).values():
        ok = scorable(r, rows)
        if len(ok) < 2 or constant(r, ok):
            continue
        weight = sum(lengths[i] for i in ok)
        b = sum(lengths[i] * r[i] for i in ok) / weight if weight else 0.0
        for i in ok:
            out[i] = r[i] - b
    return torch.tensor(out, dtype=F64)[:, None] * mask


def test_opo_hand_values():
    mask = torch.arange(3)[None, :] < torch.tensor([1, 2, 3])[:, None]
    out = opo_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3, dtype=torch.long), mask)
    # b = (1*1 + 2*0 + 3*0) / 6 = 1/6
    expected = torch.tensor([[5 / 6, 0, 0], [-1 / 6, -1 / 6, 0], [-1 / 6, -1 / 6, -1 / 6]])
    torch.testing.assert_close(out, expected)


@FAST
@given(grouped_batches())
def test_opo_matches_loop_reference(batch):
    scores, group_ids, mask = batch
    torch.testing.assert_close(opo_advantages(scores, group_ids, mask), loop_opo(scores, group_ids, mask))


@FAST
@given(grouped_batches(nan=True))
def test_opo_length_weighted_zero_mean_per_group(batch):
    scores, group_ids, mask = batch
    out = opo_advantages(scores, group_ids, mask)
    for rows in members(group_ids).values():
        assert abs(float(out[rows].sum())) < 1e-9  # sum_i |o_i| A_i = 0


@FAST
@given(grouped_batches(), st.integers(1, 6))
def test_opo_with_equal_lengths_is_dr_grpo(batch, length):
    scores, group_ids, _ = batch
    mask = torch.ones(scores.shape[0], length, dtype=torch.bool)
    torch.testing.assert_close(opo_advantages(scores, group_ids, mask),
                               grpo_outcome_advantages(scores, group_ids, mask, scale_by_std=False))
