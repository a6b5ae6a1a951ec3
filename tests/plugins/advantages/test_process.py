"""``process``: suffix sums of group-normalized step scores against a loop, by hand, zero for
constant groups, and the errors for missing or out-of-range steps."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins.advantages.process import ProcessAdvantage, ProcessOptions, process_advantages
from hypothesis import given
from hypothesis import strategies as st

from .conftest import F64, FAST, NAN, grouped_batches, inputs, members


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
    out = process_advantages(
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
    est = ProcessAdvantage(ProcessOptions(eps=0.0))
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
    est = ProcessAdvantage(ProcessOptions(**options))
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
    est = ProcessAdvantage(ProcessOptions())
    with pytest.raises(ValueError, match="step_scores, inputs.step_ends, inputs.step_mask missing"):
        est(inputs([1.0, 0.0]))
    with pytest.raises(ValueError, match="inputs.step_mask missing"):
        est(inputs([1.0], step_scores=torch.zeros(1, 1), step_ends=torch.zeros(1, 1).long()))


def test_process_rejects_out_of_range_step_ends():
    est = ProcessAdvantage(ProcessOptions())
    with pytest.raises(ValueError, match="0 <= end < T = 3.*\\[\\[0, 1\\]\\]"):
        est(
            inputs(
                [1.0],
                step_scores=torch.ones(1, 2),
                step_ends=torch.tensor([[0, 3]]),
                step_mask=torch.ones(1, 2, dtype=torch.bool),
            )
        )
