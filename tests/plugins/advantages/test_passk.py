"""``passk`` against subset enumeration and by hand: zero when every or no subset passes, ``k = 1``
is GRPO with the population std, zero mean per group, binary rewards only."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from grpo_plugins.advantages.grpo import grpo_outcome_advantages
from grpo_plugins.advantages.passk import passk_advantages
from hypothesis import given
from hypothesis import strategies as st

from .conftest import BINARY, F64, FAST, NAN, grouped_batches, members, scorable


# --------------------------------------------------------------------------- pass@k
def loop_passk(scores, group_ids, mask, k, eps=1e-6):
    """Pass@k training (https://arxiv.org/abs/2508.10751) by definition: every size-k subset
    of a group's scorable completions has reward max(r); rho and sigma are the mean and std
    of those rewards; a completion's advantage is the mean of (R_s - rho) / (sigma + eps) over
    the subsets s that contain it."""
    r = scores.tolist()
    out = [0.0] * len(r)
    for rows in members(group_ids).values():
        ok = scorable(r, rows)
        if len(ok) < k:
            continue
        subsets = list(itertools.combinations(ok, k))
        rewards = [max(r[i] for i in s) for s in subsets]
        rho = sum(rewards) / len(rewards)
        sigma = math.sqrt(sum((x - rho) ** 2 for x in rewards) / len(rewards))
        if sigma == 0:
            continue
        for i in ok:
            mine = [(x - rho) / (sigma + eps) for s, x in zip(subsets, rewards) if i in s]
            out[i] = sum(mine) / len(mine)
    return torch.tensor(out, dtype=F64)[:, None] * mask


def test_passk_hand_values():
    # n = 4, c = 1, k = 2: rho = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2; correct (1 - 1/2)/(1/2) = 1,
    # wrong: 1 - C(2,1)/C(3,1) = 1/3, (1/3 - 1/2)/(1/2) = -1/3.
    out = passk_advantages(torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long),
                               torch.ones(4, 2, dtype=torch.bool), k=2, eps=0.0)
    torch.testing.assert_close(out[:, 0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    # n = 4, c = 2, k = 2: rho = 5/6, sigma = sqrt(5)/6; correct (1/6)/sigma = 1/sqrt(5), wrong
    # (1 - C(1,1)/C(3,1) - 5/6)/sigma = -1/sqrt(5).
    out = passk_advantages(torch.tensor([1.0, 0, 1, 0]), torch.zeros(4, dtype=torch.long),
                               torch.ones(4, 1, dtype=torch.bool), k=2, eps=0.0)
    torch.testing.assert_close(out[:, 0], torch.tensor([1, -1, 1, -1]) / math.sqrt(5))


@pytest.mark.parametrize("rewards, k", [([1.0, 1, 1, 1], 2), ([0.0, 0, 0, 0], 3), ([1.0, 1, 1, 0], 2),
                                        ([1.0, 0, 0, 1], 3)])
def test_passk_zero_when_every_or_no_subset_passes(rewards, k):
    # fewer wrong completions than k: every k-subset holds a correct one, pass@k = 1 for all
    out = passk_advantages(torch.tensor(rewards), torch.zeros(4, dtype=torch.long),
                               torch.ones(4, 2, dtype=torch.bool), k=k)
    assert torch.equal(out, torch.zeros(4, 2))


@FAST
@given(grouped_batches(values=BINARY), st.integers(1, 5), st.sampled_from([0.0, 1e-6]))
def test_passk_matches_subset_enumeration(batch, k, eps):
    scores, group_ids, mask = batch
    if k > int(torch.bincount(group_ids).max()):
        with pytest.raises(ValueError, match=f"k={k} exceeds the group size"):
            passk_advantages(scores, group_ids, mask, k=k, eps=eps)
        return
    got = passk_advantages(scores, group_ids, mask, k=k, eps=eps)
    torch.testing.assert_close(got, loop_passk(scores, group_ids, mask, k, eps), rtol=1e-9, atol=1e-9)


@FAST
@given(grouped_batches(values=BINARY), st.sampled_from([0.0, 1e-6]))
def test_passk_k1_is_grpo_with_population_std(batch, eps):
    scores, group_ids, mask = batch
    grpo = grpo_outcome_advantages(scores, group_ids, mask, std="population", eps=eps)
    torch.testing.assert_close(passk_advantages(scores, group_ids, mask, k=1, eps=eps), grpo)


@FAST
@given(grouped_batches(values=BINARY, nan=True, min_group=2), st.integers(1, 5))
def test_passk_zero_mean_per_group_and_zero_on_padding(batch, k):
    scores, group_ids, mask = batch
    k = min(k, int(torch.bincount(group_ids).max()))
    per_row = passk_advantages(scores, group_ids, torch.ones(mask.shape[0], 1, dtype=torch.bool), k=k)[:, 0]
    for rows in members(group_ids).values():
        assert abs(float(per_row[rows].sum())) < 1e-9
    assert torch.all(passk_advantages(scores, group_ids, mask, k=k)[~mask] == 0)


def test_passk_refuses_non_binary_rewards_naming_rows():
    with pytest.raises(ValueError, match=r"binary rewards, each 0 or 1; rows \[1\] have \[0.5\]"):
        passk_advantages(torch.tensor([1.0, 0.5, NAN]), torch.zeros(3, dtype=torch.long),
                             torch.ones(3, 2, dtype=torch.bool), k=1)


def test_passk_group_short_of_k_scorable_is_zero():
    scores = torch.tensor([1.0, 0.0, NAN, NAN, 1.0, 0.0, 0.0, 0.0])
    out = passk_advantages(scores, torch.arange(2).repeat_interleave(4), torch.ones(8, 1, dtype=torch.bool), k=3)
    assert torch.all(out[:4] == 0) and torch.all(out[4:] != 0)
