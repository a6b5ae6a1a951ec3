"""``gdpo``: a hand example, a plain-loop reference over many tables (NaN scores, ragged groups,
weights), the invariants (one reward function is ``grpo``, each function's positive affine map
changes nothing, zero mean and unit std over the batch, zero on padding and unscorable rows), and
that it reads the reward table the engine fills."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins.advantages.gdpo import GDPOAdvantage, GDPOOptions, gdpo_advantages
from grpo_plugins.advantages.grpo import GRPOAdvantage, GRPOOptions
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.contracts import AdvantageInputs
from grpo_core.plugin_manager import load_plugins

from .conftest import F64, FAST, NAN, members

GRID = st.integers(-8, 8).map(lambda k: k / 4)


@st.composite
def reward_tables(draw, functions=None, nan=True):
    """(table (B, F), weights (F,), group_ids (B,), mask (B, T)): shuffled groups, ragged rows,
    some NaN entries (a function said None), positive and negative weights."""
    f = functions or draw(st.integers(1, 3))
    num_prompts, group = draw(st.integers(1, 4)), draw(st.integers(2, 5))
    rows, length = num_prompts * group, draw(st.integers(1, 5))
    entry = st.one_of(GRID, st.just(NAN)) if nan else GRID
    table = torch.tensor(draw(st.lists(st.lists(entry, min_size=f, max_size=f), min_size=rows, max_size=rows)),
                         dtype=F64)
    weights = torch.tensor(draw(st.lists(st.sampled_from([1.0, 0.5, 2.0, -1.0]), min_size=f, max_size=f)), dtype=F64)
    order = draw(st.permutations(range(rows)))
    group_ids = torch.tensor([p for p in range(num_prompts) for _ in range(group)])[list(order)]
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return table, weights, group_ids, mask


def weighted_total(table, weights):
    """The engine's total: the weighted sum of the non-NaN entries, NaN where a row has none."""
    scored = ~torch.isnan(table)
    total = torch.where(scored, table * weights, 0.0).sum(dim=1)
    return torch.where(scored.any(dim=1), total, NAN)


def gdpo(table, weights, group_ids, mask, **options):
    inputs = AdvantageInputs(weighted_total(table, weights), group_ids, mask, reward_scores=table,
                             reward_weights=weights)
    return GDPOAdvantage(GDPOOptions(**options))(inputs)


# --------------------------------------------------------------------------- the plain loop
def loop_gdpo(table, weights, group_ids, mask, scale_by_std=True, std="unbiased", eps=1e-6, batch_norm="sequence",
              batch_eps=1e-6):
    """Plain-Python GDPO: for each function and group, (r - mean) / (std + eps) over the non-NaN
    scores; the weighted sum per row; then the batch step over the rows with any score."""
    ddof = 1 if std == "unbiased" else 0
    rows, functions = table.shape
    r = table.tolist()
    summed = [0.0] * rows
    for k in range(functions):
        for members_ in members(group_ids).values():
            vals = [r[i][k] for i in members_ if not math.isnan(r[i][k])]
            if len(vals) < 2 or len(set(vals)) == 1:
                continue
            mean = sum(vals) / len(vals)
            sd = math.sqrt(sum((x - mean) ** 2 for x in vals) / (len(vals) - ddof))
            for i in members_:
                if not math.isnan(r[i][k]):
                    summed[i] += float(weights[k]) * ((r[i][k] - mean) / (sd + eps) if scale_by_std else r[i][k] - mean)
    scorable = [any(not math.isnan(x) for x in r[i]) for i in range(rows)]
    out = [[0.0] * mask.shape[1] for _ in range(rows)]
    if batch_norm == "token":
        pool = [summed[i] for i in range(rows) for t in range(mask.shape[1]) if scorable[i] and mask[i, t]]
        if not pool:
            return torch.tensor(out, dtype=F64)
        mean = sum(pool) / len(pool)
        var = sum((x - mean) ** 2 for x in pool) / max(len(pool) - 1, 1)
        value = [(summed[i] - mean) / math.sqrt(var + batch_eps) for i in range(rows)]
    elif batch_norm == "sequence":
        pool = [summed[i] for i in range(rows) if scorable[i]]
        if len(pool) <= ddof:
            return torch.tensor(out, dtype=F64)
        mean = sum(pool) / len(pool)
        sd = math.sqrt(sum((x - mean) ** 2 for x in pool) / max(len(pool) - ddof, 1))
        value = [(summed[i] - mean) / (sd + batch_eps) if sd + batch_eps > 0 else 0.0 for i in range(rows)]
    else:
        value = summed
    for i in range(rows):
        for t in range(mask.shape[1]):
            if scorable[i] and mask[i, t]:
                out[i][t] = value[i]
    return torch.tensor(out, dtype=F64)


@FAST
@given(reward_tables(), st.sampled_from(["sequence", "token", "none"]), st.sampled_from(["unbiased", "population"]),
       st.booleans())
def test_gdpo_matches_the_plain_loop(drawn, batch_norm, std, scale_by_std):
    table, weights, group_ids, mask = drawn
    options = dict(batch_norm=batch_norm, std=std, scale_by_std=scale_by_std)
    got = gdpo(table, weights, group_ids, mask, **options)
    torch.testing.assert_close(got, loop_gdpo(table, weights, group_ids, mask, **options), rtol=1e-9, atol=1e-9)
    assert got.shape == mask.shape


def test_gdpo_hand_values_keep_the_reward_combinations_grpo_merges():
    """Two binary rewards, four completions: (1,1), (1,0), (0,1), (0,0)... GRPO on the sum sees
    2, 1, 1, 0 and gives (1,0) and (0,1) the same advantage; GDPO too here, but with weights 1 and
    2 the sum 3, 1, 2, 0 is what GRPO sees, while GDPO normalizes each reward on its own first:
    each column [1,1,0,0] / [1,0,1,0] has mean 0.5 and unbiased std sqrt(1/3)."""
    table = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=F64)
    weights = torch.tensor([1.0, 2.0], dtype=F64)
    mask = torch.ones(4, 2, dtype=torch.bool)
    got = gdpo(table, weights, torch.zeros(4, dtype=torch.long), mask, batch_norm="none", eps=0.0)
    z = 0.5 / math.sqrt(1 / 3)  # each normalized score is +-z
    assert got[:, 0].tolist() == pytest.approx([3 * z, -z, z, -3 * z], rel=1e-12)
    batch = gdpo(table, weights, torch.zeros(4, dtype=torch.long), mask, eps=0.0, batch_eps=0.0)
    sd = math.sqrt((9 + 1 + 1 + 9) * z * z / 3)  # mean 0, unbiased std of the sums
    assert batch[:, 0].tolist() == pytest.approx([3 * z / sd, -z / sd, z / sd, -3 * z / sd], rel=1e-12)


# --------------------------------------------------------------------------- invariants
@FAST
@given(reward_tables(functions=1), st.sampled_from(["unbiased", "population"]), st.booleans())
def test_one_reward_function_without_the_batch_step_is_grpo(drawn, std, scale_by_std):
    table, weights, group_ids, mask = drawn
    weights = weights.abs()  # grpo sees the weighted total: a positive weight
    got = gdpo(table, torch.ones(1, dtype=F64), group_ids, mask, batch_norm="none", std=std,
               scale_by_std=scale_by_std)
    grpo = GRPOAdvantage(GRPOOptions(std=std, scale_by_std=scale_by_std))(
        AdvantageInputs(table[:, 0], group_ids, mask))
    torch.testing.assert_close(got, grpo, rtol=1e-12, atol=1e-12)
    # and the engine's inputs without a table (scores only) are that one column
    bare = GDPOAdvantage(GDPOOptions(batch_norm="none", std=std, scale_by_std=scale_by_std))(
        AdvantageInputs(table[:, 0], group_ids, mask))
    torch.testing.assert_close(bare, grpo, rtol=1e-12, atol=1e-12)


@FAST
@given(reward_tables(functions=1, nan=False))
def test_one_reward_function_with_the_batch_step_is_grpo_standardized_over_the_batch(drawn):
    table, _, group_ids, mask = drawn
    got = gdpo(table, torch.ones(1, dtype=F64), group_ids, mask, eps=0.0, batch_eps=0.0)
    every = torch.ones_like(mask)  # grpo's per-row value does not depend on the mask
    per_row = GRPOAdvantage(GRPOOptions(std="unbiased", eps=0.0))(AdvantageInputs(table[:, 0], group_ids, every))[:, 0]
    sd = per_row.std()
    expected = (per_row - per_row.mean()) / sd if sd > 0 else torch.zeros_like(per_row)
    torch.testing.assert_close(got, expected[:, None] * mask, rtol=1e-9, atol=1e-9)


@FAST
@given(reward_tables(nan=False), st.data())
def test_each_function_s_positive_affine_map_changes_nothing(drawn, data):
    """The point of GDPO: each reward is normalized on its own, so rescaling one (a 0/1 accuracy
    against a 0-10 format score) does not change its say; GRPO on the weighted sum would."""
    table, weights, group_ids, mask = drawn
    scale = torch.tensor(data.draw(st.lists(st.sampled_from([0.5, 2.0, 8.0]), min_size=table.shape[1],
                                            max_size=table.shape[1])), dtype=F64)
    shift = torch.tensor(data.draw(st.lists(st.sampled_from([-3.0, 0.0, 5.0]), min_size=table.shape[1],
                                            max_size=table.shape[1])), dtype=F64)
    for batch_norm in ("sequence", "token", "none"):
        before = gdpo(table, weights, group_ids, mask, eps=0.0, batch_eps=0.0, batch_norm=batch_norm)
        after = gdpo(table * scale + shift, weights, group_ids, mask, eps=0.0, batch_eps=0.0, batch_norm=batch_norm)
        torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-9)


@FAST
@given(reward_tables())
def test_batch_step_gives_zero_mean_and_unit_std_over_scorable_rows(drawn):
    table, weights, group_ids, mask = drawn
    mask = torch.ones_like(mask)  # every row has tokens, so each row's value is visible
    got = gdpo(table, weights, group_ids, mask, batch_eps=0.0)[:, 0]
    scorable = ~torch.isnan(weighted_total(table, weights))
    values = got[scorable]
    assert (got[~scorable] == 0).all()
    if len(values) > 1 and values.abs().max() > 0:
        assert abs(float(values.mean())) < 1e-9
        assert float(values.std()) == pytest.approx(1.0, rel=1e-9)


@FAST
@given(reward_tables())
def test_zero_on_padding_and_unscorable_rows(drawn):
    table, weights, group_ids, mask = drawn
    for batch_norm in ("sequence", "token", "none"):
        got = gdpo(table, weights, group_ids, mask, batch_norm=batch_norm)
        assert (got[~mask] == 0).all()
        unscorable = torch.isnan(table).all(dim=1)
        assert (got[unscorable] == 0).all()


def test_a_function_constant_in_a_group_adds_nothing_there():
    table = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 0.5]], dtype=F64)  # the first function is constant
    mask = torch.ones(3, 1, dtype=torch.bool)
    both = gdpo(table, torch.ones(2, dtype=F64), torch.zeros(3, dtype=torch.long), mask, batch_norm="none")
    second = gdpo(table[:, 1:], torch.ones(1, dtype=F64), torch.zeros(3, dtype=torch.long), mask, batch_norm="none")
    torch.testing.assert_close(both, second, rtol=0, atol=0)


# --------------------------------------------------------------------------- the component
def test_registered_with_its_options_and_reading_the_reward_table():
    component = load_plugins(external=False).registry.get("advantage_estimator", "gdpo")
    assert component.options is GDPOOptions
    built = component.build()
    assert built.needs_step_scores is False and built.teacher is None
    with pytest.raises(ValueError, match=r"reward_scores must be \(B, F\) and reward_weights \(F,\)"):
        gdpo_advantages(torch.zeros(3, 2), torch.ones(3), torch.zeros(3), torch.zeros(3, dtype=torch.long),
                        torch.ones(3, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch_norm"):
        GDPOOptions(batch_norm="group")


def test_a_kl_in_the_reward_is_warned_about_since_its_beta_cancels_out():
    """The KL-in-reward column is normalized like a reward: beta 1e-3 and 1 give the same
    advantages, so gdpo says so (once per call site) when the table holds it."""
    table = torch.tensor([[1.0, -0.001], [0.0, -0.003], [1.0, -0.002], [0.0, -0.0005]], dtype=F64)
    mask, groups = torch.ones(4, 2, dtype=torch.bool), torch.zeros(4, dtype=torch.long)
    weights = torch.ones(2, dtype=F64)
    with pytest.warns(UserWarning, match="beta has no effect"):
        small = gdpo_advantages(table, weights, table.sum(1), groups, mask, ("accuracy", "kl_penalty"))
    big = table.clone()
    big[:, 1] *= 1000  # beta 1000 times larger
    with pytest.warns(UserWarning, match="beta has no effect"):
        large = gdpo_advantages(big, weights, big.sum(1), groups, mask, ("accuracy", "kl_penalty"))
    assert torch.allclose(small, large, atol=1e-3)  # what the warning is about (eps aside)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gdpo_advantages(table[:, :1], weights[:1], table[:, 0], groups, mask, ("accuracy",))


def test_a_token_batch_without_spread_gets_zero_even_without_batch_eps():
    """Every counted token holds the same advantage: the token step's spread is 0, so the
    advantages are 0. The float mean of three copies of 0.2182 misses it by an ulp; divided by
    a spread of that same size (batch_eps 0) the rounding became +-sqrt(2/3), found by the
    affine-map property above."""
    table = torch.tensor([[-0.25], [0.5], [0.25]], dtype=F64)
    mask = torch.tensor([[False] * 3, [False] * 3, [True] * 3])
    got = gdpo(table, torch.ones(1, dtype=F64), torch.tensor([0, 0, 0]), mask, eps=0.0, batch_eps=0.0,
               batch_norm="token")
    assert torch.equal(got, torch.zeros_like(got))
