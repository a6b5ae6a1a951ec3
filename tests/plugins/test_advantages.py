"""Advantage estimators: DeepSeekMath's formulas (https://arxiv.org/abs/2402.03300) by hand,
invariants with hypothesis, and the vectorized code against plain-loop references."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins import advantages as adv
from grpo_plugins.aggregators import seq_mean_token_mean, token_mean
from grpo_plugins.losses.clip import ppo_clip_loss
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.contracts import AdvantageInputs, BatchStats
from grpo_core.plugin_manager import load_plugins

F64 = torch.float64
NAN = float("nan")
FAST = settings(max_examples=40, deadline=None)


# --------------------------------------------------------------------------- strategies
@st.composite
def grouped_batches(draw, nan=True, min_group=1):
    """(scores (B,), group_ids (B,), mask (B, T)) with shuffled rows, ragged lengths and
    rewards on a 0.25 grid (so distinct rewards stay distinct under the transforms used)."""
    num_prompts = draw(st.integers(1, 4))
    group = draw(st.integers(min_group, 5))
    rows = num_prompts * group
    length = draw(st.integers(1, 6))
    value = st.integers(-12, 12).map(lambda k: k / 4)
    reward = st.one_of(value, st.just(NAN)) if nan else value
    scores = draw(st.lists(reward, min_size=rows, max_size=rows))
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    order = draw(st.permutations(range(rows)))
    group_ids = torch.tensor([p for p in range(num_prompts) for _ in range(group)])[list(order)]
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return torch.tensor(scores, dtype=F64), group_ids, mask


def members(group_ids: torch.Tensor) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for row, gid in enumerate(group_ids.tolist()):
        out.setdefault(gid, []).append(row)
    return out


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


def inputs(scores, group_ids=None, mask=None, **steps) -> AdvantageInputs:
    scores = torch.as_tensor(scores, dtype=F64)
    if group_ids is None:
        group_ids = torch.zeros(len(scores), dtype=torch.long)
    if mask is None:
        mask = torch.ones(len(scores), 3, dtype=torch.bool)
    return AdvantageInputs(scores, torch.as_tensor(group_ids), mask, **steps)


def grpo(scores, group_ids=None, mask=None, **options):
    return adv.GRPOAdvantage(adv.GRPOOptions(**options))(inputs(scores, group_ids, mask))


# --------------------------------------------------------------------------- grpo by hand
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
    out32 = adv.grpo_outcome_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask[:2])
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
    out = adv.grpo_outcome_advantages(
        scores, group_ids, mask, scale_by_std=scale, std=std, std_scope=scope, eps=eps
    )
    expected = loop_grpo(scores, group_ids, mask, scale, std, scope, eps)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)


@FAST
@given(grouped_batches())
def test_grpo_zero_mean_unit_std_per_group(batch):
    scores, group_ids, mask = batch
    full = torch.ones(mask.shape[0], 1, dtype=torch.bool)  # one token per row: read A_i
    a = adv.grpo_outcome_advantages(scores, group_ids, full, eps=0.0)[:, 0]
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
    out = adv.grpo_outcome_advantages(scores, group_ids, mask)
    assert out.shape == mask.shape
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    row_value = adv.grpo_sequence_advantages(scores, group_ids)
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
    before = adv.grpo_outcome_advantages(scores, group_ids, mask, eps=0.0, std_scope=scope)
    after = adv.grpo_outcome_advantages(a * scores + b, group_ids, mask, eps=0.0, std_scope=scope)
    torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------- process
def loop_process(step_scores, step_ends, step_mask, group_ids, mask, scale_by_std=True, eps=1e-6):
    """Plain-loop reference of DeepSeekMath's process advantage (suffix-sum definition)."""
    rows, length = mask.shape
    out = torch.zeros(rows, length, dtype=F64)
    for group_rows in members(group_ids).values():
        steps = [
            (i, k)
            for i in group_rows
            for k in range(step_scores.shape[1])
            if step_mask[i, k] and not math.isnan(step_scores[i, k].item())
        ]
        vals = [step_scores[i, k].item() for i, k in steps]
        if len(set(vals)) < 2:
            continue
        mean = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        for (i, k), v in zip(steps, vals, strict=True):
            rhat = (v - mean) / (sd + eps) if scale_by_std else v - mean
            for t in range(length):
                if mask[i, t] and step_ends[i, k].item() >= t:
                    out[i, t] += rhat
    return out


@st.composite
def step_batches(draw):
    scores, group_ids, mask = draw(grouped_batches(nan=False))
    rows, length = mask.shape
    k = draw(st.integers(0, 4))
    cells = rows * k
    value = st.one_of(st.integers(-8, 8).map(lambda x: x / 4), st.just(NAN))
    step_scores = torch.tensor(draw(st.lists(value, min_size=cells, max_size=cells)), dtype=F64)
    step_ends = torch.tensor(
        draw(st.lists(st.integers(0, length - 1), min_size=cells, max_size=cells))
    )
    step_mask = torch.tensor(
        draw(st.lists(st.booleans(), min_size=cells, max_size=cells)), dtype=torch.bool
    )
    return (
        step_scores.reshape(rows, k),
        step_ends.reshape(rows, k).long(),
        step_mask.reshape(rows, k),
        group_ids,
        mask,
    )


@FAST
@given(step_batches(), st.sampled_from([True, False]), st.sampled_from([0.0, 1e-6]))
def test_process_matches_loop_reference(batch, scale, eps):
    step_scores, step_ends, step_mask, group_ids, mask = batch
    # garbage where steps do not exist must not matter
    step_ends = torch.where(step_mask, step_ends, -7)
    out = adv.process_advantages(
        step_scores, step_ends, step_mask, group_ids, mask, scale_by_std=scale, eps=eps
    )
    expected = loop_process(step_scores, step_ends, step_mask, group_ids, mask, scale, eps)
    assert out.shape == mask.shape
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum()), dtype=F64))


def test_process_hand_values():
    # steps 3 (ends at 1), 1 (ends at 3) | 2 (ends at 0), 0 (ends at 2): mean 1.5, std sqrt(5)/2
    # rhat = 3/sqrt5, -1/sqrt5 | 1/sqrt5, -3/sqrt5
    s5 = math.sqrt(5.0)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    est = adv.ProcessAdvantage(adv.ProcessOptions(eps=0.0))
    out = est(
        inputs(
            [NAN, NAN],
            mask=mask,
            step_scores=torch.tensor([[3.0, 1.0], [2.0, 0.0]], dtype=F64),
            step_ends=torch.tensor([[1, 3], [0, 2]]),
            step_mask=torch.ones(2, 2, dtype=torch.bool),
        )
    )
    expected = torch.tensor(
        [[2 / s5, 2 / s5, -1 / s5, -1 / s5, 0.0], [-2 / s5, -3 / s5, -3 / s5, 0.0, 0.0]], dtype=F64
    )
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("options", [{"eps": 0.0}, {}, {"scale_by_std": False}])
def test_process_constant_group_is_exactly_zero(options):
    # three steps of 0.1 over two completions: the naive mean leaves float residue
    est = adv.ProcessAdvantage(adv.ProcessOptions(**options))
    out = est(
        inputs(
            [NAN, NAN],
            step_scores=torch.tensor([[0.1, 0.1], [0.1, 5.0]], dtype=F64),
            step_ends=torch.tensor([[0, 2], [1, 0]]),
            step_mask=torch.tensor([[True, True], [True, False]]),
        )
    )
    assert torch.equal(out, torch.zeros(2, 3, dtype=F64))


def test_process_missing_step_inputs_names_them():
    est = adv.ProcessAdvantage(adv.ProcessOptions())
    with pytest.raises(ValueError, match="step_scores, inputs.step_ends, inputs.step_mask missing"):
        est(inputs([1.0, 0.0]))
    with pytest.raises(ValueError, match="inputs.step_mask missing"):
        est(inputs([1.0], step_scores=torch.zeros(1, 1), step_ends=torch.zeros(1, 1).long()))


def test_process_rejects_out_of_range_step_ends():
    est = adv.ProcessAdvantage(adv.ProcessOptions())
    with pytest.raises(ValueError, match="0 <= end < T = 3.*\\[\\[0, 1\\]\\]"):
        est(
            inputs(
                [1.0],
                step_scores=torch.ones(1, 2),
                step_ends=torch.tensor([[0, 3]]),
                step_mask=torch.ones(1, 2, dtype=torch.bool),
            )
        )


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

    dapo = adv.dapo_token_scale_advantages(scores, group_ids, mask)
    base = adv.grpo_outcome_advantages(scores, group_ids, mask)
    loss_d, grad_d = loss_and_grad(dapo, seq_mean_token_mean)
    loss_g, grad_g = loss_and_grad(base, token_mean)
    torch.testing.assert_close(loss_d, loss_g, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad_d, grad_g, rtol=1e-9, atol=1e-12)


def test_dapo_scale_by_hand_and_empty_batch():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)  # |o| = 3, 1; B = 2
    est = adv.DAPOTokenScaleAdvantage(adv.GRPOOptions(eps=0.0))
    out = est(inputs([1.0, 0.0], mask=mask))
    expected = torch.tensor([[1.5, 1.5, 1.5], [-0.5, 0.0, 0.0]], dtype=F64)  # +-1 * |o_i| * 2 / 4
    torch.testing.assert_close(out, expected)
    empty = est(inputs([1.0, 0.0], mask=torch.zeros(2, 3, dtype=torch.bool)))
    assert torch.equal(empty, torch.zeros(2, 3, dtype=F64))


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
    out = adv.rloo(AdvantageInputs(scores, group_ids, mask))
    torch.testing.assert_close(out, loop_rloo(scores, group_ids, mask), rtol=1e-9, atol=1e-12)


def test_rloo_hand_values():
    out = adv.rloo(inputs([1.0, 0.0, 0.0, 0.0, NAN, 2.0, NAN], [0, 0, 0, 0, 0, 1, 1]))[:, 0]
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0], dtype=F64)
    torch.testing.assert_close(out, expected)
    assert torch.equal(adv.rloo(inputs([0.1] * 3)), torch.zeros(3, 3, dtype=F64))


# --------------------------------------------------------------------------- reinforce++
def loop_reinforce_pp(scores, group_ids, mask, eps=1e-8):
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
    var = sum((a[i] - mean) ** 2 for i, _ in tokens) / max(len(tokens) - 1, 1)
    for i, t in tokens:
        out[i, t] = (a[i] - mean) / math.sqrt(var + eps)
    return out


@FAST
@given(grouped_batches(), st.sampled_from([1e-8, 0.5]))
def test_reinforce_pp_matches_loop_reference(batch, eps):
    scores, group_ids, mask = batch
    est = adv.ReinforcePlusPlusAdvantage(adv.ReinforcePlusPlusOptions(eps=eps))
    out = est(AdvantageInputs(scores, group_ids, mask))
    expected = loop_reinforce_pp(scores, group_ids, mask, eps)
    torch.testing.assert_close(out, expected, rtol=1e-7, atol=1e-9)


def test_reinforce_pp_hand_values():
    # a = +0.5 (1 token), -0.5 (2 tokens); token mean -1/6; unbiased var 1/3
    mask = torch.tensor([[1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    out = adv.reinforce_plus_plus_advantages(
        torch.tensor([1.0, 0.0, NAN], dtype=F64), torch.tensor([0, 0, 0]), mask, eps=1e-8
    )
    d = math.sqrt(1 / 3 + 1e-8)
    expected = torch.tensor([[2 / 3 / d, 0.0], [-1 / 3 / d, -1 / 3 / d], [0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out, expected)


def test_masked_whiten_small_counts():
    values = torch.tensor([[3.0, 9.0]], dtype=F64)
    one = adv.masked_whiten(values, torch.tensor([[True, False]]))
    assert torch.equal(one, torch.zeros(1, 2, dtype=F64))
    none = adv.masked_whiten(values, torch.tensor([[False, False]]))
    assert torch.equal(none, torch.zeros(1, 2, dtype=F64))


# --------------------------------------------------------------------------- registration
ESTIMATORS = ["grpo", "process", "dapo-token-scale", "rloo", "reinforce++"]


def test_estimators_registered_and_buildable():
    registry = load_plugins(external=False).registry
    steps = dict(
        step_scores=torch.tensor([[1.0], [0.0]], dtype=F64),
        step_ends=torch.tensor([[2], [1]]),
        step_mask=torch.ones(2, 1, dtype=torch.bool),
    )
    batch = inputs([1.0, 0.0], **steps)
    for name in ESTIMATORS:
        component = registry.get("advantage_estimator", name)
        assert component.plugin == "grpo_plugins.advantages"
        built = component.build(component.options() if component.options else None)
        out = built(batch)
        assert out.shape == (2, 3) and out.abs().sum() > 0, name


@pytest.mark.parametrize(
    "model", [adv.GRPOOptions, adv.ProcessOptions, adv.ReinforcePlusPlusOptions]
)
def test_options_reject_unknown_keys(model):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        model(nonsense=1)


@pytest.mark.parametrize(
    "model, kwargs, message",
    [
        (adv.GRPOOptions, {"std": "sample"}, "'population' or 'unbiased'"),
        (adv.GRPOOptions, {"std_scope": "global"}, "'group' or 'batch'"),
        (adv.GRPOOptions, {"eps": -1.0}, "greater than or equal to 0"),
        (adv.ProcessOptions, {"eps": float("nan")}, "finite number"),
        (adv.ReinforcePlusPlusOptions, {"eps": 0.0}, "greater than 0"),
    ],
)
def test_options_invalid_values_say_what_is_valid(model, kwargs, message):
    with pytest.raises(ValidationError, match=message):
        model(**kwargs)
