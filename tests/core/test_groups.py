"""The public group helpers an estimator author imports: against plain loops, with NaN
(unscorable) rows and groups whose rows are not contiguous, and against the built-in
``grpo`` estimator, which is made of them."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.contracts import AdvantageInputs
from grpo_core.groups import (
    check_scores,
    group_index,
    group_is_constant,
    group_mean,
    group_std,
    group_sum,
    per_token,
    safe_divide,
)
from grpo_core.plugin_manager import load_plugins

F64 = torch.float64

rows = st.lists(
    st.tuples(st.integers(0, 3), st.one_of(st.none(), st.floats(-100, 100, allow_nan=False))),
    min_size=1, max_size=12,
)


def _plain(data, unbiased):
    """Per row: mean and std of the non-None scores of its group, by hand."""
    out = []
    for gid, _ in data:
        group = [s for g, s in data if g == gid and s is not None]
        mean = statistics.fmean(group) if group else 0.0
        need = 2 if unbiased else 1
        if len(group) < need:
            std = 0.0
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - (1 if unbiased else 0)))
        out.append((mean, std))
    return out


@settings(max_examples=60, deadline=None)
@given(data=rows, unbiased=st.booleans())
def test_group_mean_and_std_match_plain_loops(data, unbiased):
    ids = torch.tensor([g for g, _ in data])
    scores = torch.tensor([math.nan if s is None else s for _, s in data], dtype=F64)
    mean, std = group_mean(scores, ids), group_std(scores, ids, unbiased=unbiased)
    for row, (m, s) in enumerate(_plain(data, unbiased)):
        assert mean[row].item() == pytest.approx(m, abs=1e-9)
        assert std[row].item() == pytest.approx(s, abs=1e-9)


def test_index_sum_constant_divide_and_per_token():
    ids = torch.tensor([7, 3, 7, 3, 9])  # non-contiguous groups, any ids
    inverse, n = group_index(ids, 5)
    assert n == 3 and inverse.tolist() == [1, 0, 1, 0, 2]
    values = torch.tensor([1.0, 2.0, 1.0, 5.0, 4.0])
    assert group_sum(values, inverse, n).tolist() == [7.0, 2.0, 4.0]
    valid = torch.tensor([True, True, True, True, False])
    assert group_is_constant(values, valid, inverse, n).tolist() == [False, True, True]
    assert safe_divide(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.0])).tolist() == [0.5, 0.0]
    mask = torch.tensor([[True, False], [True, True]])
    assert per_token(torch.tensor([3.0, -1.0]), mask).tolist() == [[3.0, 0.0], [-1.0, -1.0]]
    with pytest.raises(ValueError, match="group_ids must have shape"):
        group_index(ids, 4)


def test_check_scores_refuses_infinite_and_misshaped_scores():
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert check_scores(torch.tensor([1, 0]), mask).dtype == torch.get_default_dtype()
    with pytest.raises(ValueError, match=r"rows \[1\] are infinite"):
        check_scores(torch.tensor([0.0, math.inf]), mask)
    with pytest.raises(ValueError, match="same B"):
        check_scores(torch.tensor([0.0]), mask)


def test_the_builtin_grpo_estimator_is_these_helpers():
    registry = load_plugins(external=False).registry
    component = registry.get("advantage_estimator", "grpo")
    estimator = component.build(component.options(eps=0.0))
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, math.nan, 3.0], dtype=F64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.ones(6, 4, dtype=torch.bool)
    expected = ((scores - group_mean(scores, ids)) / group_std(scores, ids)).nan_to_num(0.0)
    got = estimator(AdvantageInputs(scores=scores, group_ids=ids, mask=mask))
    torch.testing.assert_close(got, per_token(expected, mask))
