"""The estimators of grpo_plugins.advantages_ext against their papers: hand-computed cases,
plain-loop references written from the papers (pass@k by enumerating every k-subset),
hypothesis invariants, and the reductions to GRPO / Dr. GRPO at the limit settings."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from grpo_plugins import advantages as adv
from grpo_plugins import advantages_ext as ext
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.contracts import AdvantageInputs
from grpo_core.groups import group_mean
from grpo_core.plugin_manager import load_plugins

F64 = torch.float64
NAN = float("nan")
FAST = settings(max_examples=40, deadline=None)


# --------------------------------------------------------------------------- strategies and helpers
@st.composite
def batches(draw, values=None, nan=True, min_group=1, max_group=5):
    """(scores (B,), group_ids (B,), mask (B, T)): shuffled rows, ragged lengths (0 included)."""
    num_prompts = draw(st.integers(1, 4))
    group = draw(st.integers(min_group, max_group))
    rows = num_prompts * group
    length = draw(st.integers(1, 6))
    value = values if values is not None else st.integers(-12, 12).map(lambda k: k / 4)
    reward = st.one_of(value, st.just(NAN)) if nan else value
    scores = draw(st.lists(reward, min_size=rows, max_size=rows))
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    order = draw(st.permutations(range(rows)))
    group_ids = torch.tensor([p for p in range(num_prompts) for _ in range(group)])[list(order)]
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return torch.tensor(scores, dtype=F64), group_ids, mask


BINARY = st.sampled_from([0.0, 1.0])


def members(group_ids: torch.Tensor) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for row, gid in enumerate(group_ids.tolist()):
        out.setdefault(gid, []).append(row)
    return out


def scorable(r: list[float], rows: list[int]) -> list[int]:
    return [i for i in rows if not math.isnan(r[i])]


def constant(r: list[float], rows: list[int]) -> bool:
    return len({r[i] for i in rows}) < 2


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
    out = ext.passk_advantages(torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long),
                               torch.ones(4, 2, dtype=torch.bool), k=2, eps=0.0)
    torch.testing.assert_close(out[:, 0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    # n = 4, c = 2, k = 2: rho = 5/6, sigma = sqrt(5)/6; correct (1/6)/sigma = 1/sqrt(5), wrong
    # (1 - C(1,1)/C(3,1) - 5/6)/sigma = -1/sqrt(5).
    out = ext.passk_advantages(torch.tensor([1.0, 0, 1, 0]), torch.zeros(4, dtype=torch.long),
                               torch.ones(4, 1, dtype=torch.bool), k=2, eps=0.0)
    torch.testing.assert_close(out[:, 0], torch.tensor([1, -1, 1, -1]) / math.sqrt(5))


@pytest.mark.parametrize("rewards, k", [([1.0, 1, 1, 1], 2), ([0.0, 0, 0, 0], 3), ([1.0, 1, 1, 0], 2),
                                        ([1.0, 0, 0, 1], 3)])
def test_passk_zero_when_every_or_no_subset_passes(rewards, k):
    # fewer wrong completions than k: every k-subset holds a correct one, pass@k = 1 for all
    out = ext.passk_advantages(torch.tensor(rewards), torch.zeros(4, dtype=torch.long),
                               torch.ones(4, 2, dtype=torch.bool), k=k)
    assert torch.equal(out, torch.zeros(4, 2))


@FAST
@given(batches(values=BINARY), st.integers(1, 5), st.sampled_from([0.0, 1e-6]))
def test_passk_matches_subset_enumeration(batch, k, eps):
    scores, group_ids, mask = batch
    if k > int(torch.bincount(group_ids).max()):
        with pytest.raises(ValueError, match=f"k={k} exceeds the group size"):
            ext.passk_advantages(scores, group_ids, mask, k=k, eps=eps)
        return
    got = ext.passk_advantages(scores, group_ids, mask, k=k, eps=eps)
    torch.testing.assert_close(got, loop_passk(scores, group_ids, mask, k, eps), rtol=1e-9, atol=1e-9)


@FAST
@given(batches(values=BINARY), st.sampled_from([0.0, 1e-6]))
def test_passk_k1_is_grpo_with_population_std(batch, eps):
    scores, group_ids, mask = batch
    grpo = adv.grpo_outcome_advantages(scores, group_ids, mask, std="population", eps=eps)
    torch.testing.assert_close(ext.passk_advantages(scores, group_ids, mask, k=1, eps=eps), grpo)


@FAST
@given(batches(values=BINARY, nan=True, min_group=2), st.integers(1, 5))
def test_passk_zero_mean_per_group_and_zero_on_padding(batch, k):
    scores, group_ids, mask = batch
    k = min(k, int(torch.bincount(group_ids).max()))
    per_row = ext.passk_advantages(scores, group_ids, torch.ones(mask.shape[0], 1, dtype=torch.bool), k=k)[:, 0]
    for rows in members(group_ids).values():
        assert abs(float(per_row[rows].sum())) < 1e-9
    assert torch.all(ext.passk_advantages(scores, group_ids, mask, k=k)[~mask] == 0)


def test_passk_refuses_non_binary_rewards_naming_rows():
    with pytest.raises(ValueError, match=r"binary rewards, each 0 or 1; rows \[1\] have \[0.5\]"):
        ext.passk_advantages(torch.tensor([1.0, 0.5, NAN]), torch.zeros(3, dtype=torch.long),
                             torch.ones(3, 2, dtype=torch.bool), k=1)


def test_passk_group_short_of_k_scorable_is_zero():
    scores = torch.tensor([1.0, 0.0, NAN, NAN, 1.0, 0.0, 0.0, 0.0])
    out = ext.passk_advantages(scores, torch.arange(2).repeat_interleave(4), torch.ones(8, 1, dtype=torch.bool), k=3)
    assert torch.all(out[:4] == 0) and torch.all(out[4:] != 0)


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
    out = ext.opo_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3, dtype=torch.long), mask)
    # b = (1*1 + 2*0 + 3*0) / 6 = 1/6
    expected = torch.tensor([[5 / 6, 0, 0], [-1 / 6, -1 / 6, 0], [-1 / 6, -1 / 6, -1 / 6]])
    torch.testing.assert_close(out, expected)


@FAST
@given(batches())
def test_opo_matches_loop_reference(batch):
    scores, group_ids, mask = batch
    torch.testing.assert_close(ext.opo_advantages(scores, group_ids, mask), loop_opo(scores, group_ids, mask))


@FAST
@given(batches(nan=True))
def test_opo_length_weighted_zero_mean_per_group(batch):
    scores, group_ids, mask = batch
    out = ext.opo_advantages(scores, group_ids, mask)
    for rows in members(group_ids).values():
        assert abs(float(out[rows].sum())) < 1e-9  # sum_i |o_i| A_i = 0


@FAST
@given(batches(), st.integers(1, 6))
def test_opo_with_equal_lengths_is_dr_grpo(batch, length):
    scores, group_ids, _ = batch
    mask = torch.ones(scores.shape[0], length, dtype=torch.bool)
    torch.testing.assert_close(ext.opo_advantages(scores, group_ids, mask),
                               adv.grpo_outcome_advantages(scores, group_ids, mask, scale_by_std=False))


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
    out = ext.gpg_advantages(scores, torch.arange(2).repeat_interleave(4), torch.ones(8, 1, dtype=torch.bool))
    torch.testing.assert_close(out[:, 0], torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], dtype=torch.float32))
    every = ext.gpg_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool))
    assert torch.equal(every, torch.zeros(4, 2))  # no signal anywhere: zero, not a division by 0


@FAST
@given(batches(), st.booleans(), st.booleans(), st.sampled_from([0.0, 1e-6]))
def test_gpg_matches_loop_reference(batch, scale, rescale, eps):
    scores, group_ids, mask = batch
    got = ext.gpg_advantages(scores, group_ids, mask, scale_by_std=scale, rescale=rescale, eps=eps)
    torch.testing.assert_close(got, loop_gpg(scores, group_ids, mask, scale, rescale, eps))


@FAST
@given(batches())
def test_gpg_reduces_to_dr_grpo_and_grpo_without_rescale(batch):
    scores, group_ids, mask = batch
    plain = ext.gpg_advantages(scores, group_ids, mask, rescale=False)
    torch.testing.assert_close(plain, adv.grpo_outcome_advantages(scores, group_ids, mask, scale_by_std=False))
    scaled = ext.gpg_advantages(scores, group_ids, mask, scale_by_std=True, rescale=False)
    torch.testing.assert_close(scaled, adv.grpo_outcome_advantages(scores, group_ids, mask, std="unbiased"))


@FAST
@given(batches(nan=True))
def test_gpg_zero_mean_per_group_and_alpha_at_least_one(batch):
    scores, group_ids, mask = batch
    ones = torch.ones(scores.shape[0], 1, dtype=torch.bool)
    out = ext.gpg_advantages(scores, group_ids, ones)[:, 0]
    plain = ext.gpg_advantages(scores, group_ids, ones, rescale=False)[:, 0]
    for rows in members(group_ids).values():
        assert abs(float(out[rows].sum())) < 1e-9
    assert torch.all(out.abs() >= plain.abs())


# --------------------------------------------------------------------------- remax
def test_remax_hand_values_and_missing_baseline():
    scores = torch.tensor([1.0, 0.0, NAN, 0.5, 1.0, 0.0])
    greedy = torch.tensor([0.5, 0.5, 0.5, NAN, NAN, NAN])
    ids, mask = torch.arange(2).repeat_interleave(3), torch.ones(6, 2, dtype=torch.bool)
    out = ext.remax_advantages(scores, greedy, ids, mask)
    torch.testing.assert_close(out[:, 0], torch.tensor([0.5, -0.5, 0, 0, 0, 0]))
    out = ext.remax_advantages(scores, greedy, ids, mask, missing_baseline="group-mean")
    torch.testing.assert_close(out[:, 0], torch.tensor([0.5, -0.5, 0, 0, 0.5, -0.5]))


@FAST
@given(batches(nan=True), st.integers(-8, 8).map(lambda k: k / 4))
def test_remax_with_group_mean_baseline_is_dr_grpo_and_shift_invariant(batch, shift):
    scores, group_ids, mask = batch
    mean = group_mean(scores, group_ids)
    out = ext.remax_advantages(scores, mean, group_ids, mask)
    dr = adv.grpo_outcome_advantages(scores, group_ids, mask, scale_by_std=False)
    # equal but for constant groups, where Dr. GRPO is exactly 0 and ReMax's r - mean is too
    torch.testing.assert_close(out, dr)
    shifted = ext.remax_advantages(scores + shift, mean + shift, group_ids, mask)
    torch.testing.assert_close(shifted, out)
    assert torch.all(out[~mask] == 0)


@FAST
@given(batches(nan=False, min_group=2))
def test_remax_with_a_leave_one_out_baseline_is_rloo(batch):
    scores, group_ids, mask = batch
    loo = torch.zeros_like(scores)
    for rows in members(group_ids).values():
        for i in rows:
            loo[i] = sum(float(scores[j]) for j in rows if j != i) / (len(rows) - 1)
    torch.testing.assert_close(ext.remax_advantages(scores, loo, group_ids, mask),
                               adv.rloo_advantages(scores, group_ids, mask))


def test_remax_without_baseline_names_the_flag():
    component = ext.ReMaxAdvantage(ext.ReMaxOptions())
    batch = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long),
                            torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs inputs.baseline_scores.*needs_greedy_baseline = True"):
        component(batch)
    batch.baseline_scores = torch.tensor([0.25, 0.25])
    torch.testing.assert_close(component(batch)[:, 0], torch.tensor([0.75, -0.25]))


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
@given(batches(), st.sampled_from([1.0, 0.9, 0.5]), st.sampled_from([1e-8, 0.5]))
def test_reinforce_no_baseline_matches_loop_reference(batch, gamma, eps):
    scores, _, mask = batch
    got = ext.reinforce_no_baseline_advantages(scores, mask, gamma=gamma, eps=eps)
    torch.testing.assert_close(got, loop_reinforce(scores, mask, gamma, eps))


def test_reinforce_no_baseline_hand_values():
    mask = torch.tensor([[True, True], [True, False]])
    # gamma = 0.5: returns [0.5, 1] and [0]; mean 0.5, unbiased var 0.25
    out = ext.reinforce_no_baseline_advantages(torch.tensor([1.0, 0.0]), mask, gamma=0.5, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0], [-1.0, 0.0]]))


@FAST
@given(batches(nan=True))
def test_reinforce_no_baseline_whitened_over_the_batch_and_gamma_one_is_plain_whitening(batch):
    scores, _, mask = batch
    out = ext.reinforce_no_baseline_advantages(scores, mask, eps=1e-12)
    scorable = mask & ~torch.isnan(scores)[:, None]
    assert torch.all(out[~scorable] == 0)
    values = out[scorable]
    if values.numel() >= 2 and values.abs().max() > 0:
        assert abs(float(values.mean())) < 1e-9 and abs(float(values.var()) - 1) < 1e-6
    plain = adv.masked_whiten(torch.nan_to_num(scores)[:, None] * scorable, scorable, 1e-12)
    torch.testing.assert_close(out, plain)


# --------------------------------------------------------------------------- registration and options
NEW = {"passk": {"k": 1}, "opo": {}, "gpg": {}, "remax": {}, "reinforce++-no-baseline": {"gamma": 0.9}}


def test_new_estimators_registered_built_and_flagged():
    registry = load_plugins(external=False).registry
    batch = AdvantageInputs(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                            torch.ones(4, 3, dtype=torch.bool), baseline_scores=torch.tensor([0.5, 0.5, 0.0, 0.0]))
    for name, options in NEW.items():
        component = registry.get("advantage_estimator", name)
        assert component.plugin == "grpo_plugins.advantages_ext"
        assert "arxiv.org" in component.description, name
        built = component.build(component.options(**options))
        assert built.needs_greedy_baseline is (name == "remax")
        assert built.needs_step_scores is False
        out = built(batch)
        assert out.shape == (4, 3) and out.abs().sum() > 0, name


@pytest.mark.parametrize("model", [ext.PassKOptions, ext.OPOOptions, ext.GPGOptions, ext.ReMaxOptions,
                                   ext.ReinforceNoBaselineOptions])
def test_options_cite_the_paper_and_reject_unknown_keys(model):
    text = (model.__doc__ or "") + " ".join(f.description or "" for f in model.model_fields.values())
    assert "https://arxiv.org/abs/" in text
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        model(nonsense=1)


@pytest.mark.parametrize("model, kwargs, message", [
    (ext.PassKOptions, {}, "k\n  Field required"),
    (ext.PassKOptions, {"k": 0}, "greater than or equal to 1"),
    (ext.GPGOptions, {"eps": -1.0}, "greater than or equal to 0"),
    (ext.ReMaxOptions, {"missing_baseline": "mean"}, "'zero' or 'group-mean'"),
    (ext.ReinforceNoBaselineOptions, {"gamma": 1.5}, "less than or equal to 1"),
    (ext.ReinforceNoBaselineOptions, {"gamma": 0.0}, "greater than 0"),
])
def test_options_invalid_values_say_what_is_valid(model, kwargs, message):
    with pytest.raises(ValidationError, match=message):
        model(**kwargs)
