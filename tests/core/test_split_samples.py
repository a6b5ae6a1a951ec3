"""Split agent episodes in the learner's batch (:mod:`grpo_core.train.learner.samples`): splitting
an episode into ``k`` training samples changes none of its advantages, whatever the estimator
(the group stays the prompt's ``G`` episodes, not its samples), and the loss aggregators count
each sample as one sequence, padding rows none, every trained token once."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins.aggregators import seq_mean_token_mean, token_mean
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.contracts import AdvantageInputs, BatchStats, Episodes, RolloutBatch
from grpo_core.plugin_manager import load_plugins
from grpo_core.train.learner.learner import train_batch

#: Estimators that read only outcome scores, group ids and the mask, with their options.
ESTIMATORS = {"grpo": {}, "dapo-token-scale": {}, "rloo": {}, "reinforce++": {}, "gpg": {}, "opo": {},
              "reinforce++-no-baseline": {"gamma": 0.9}}


@pytest.fixture(scope="module")
def estimators():
    registry = load_plugins(external=False).registry
    out = {}
    for name, options in ESTIMATORS.items():
        component = registry.get("advantage_estimator", name)
        out[name] = component.build(component.options(**options) if component.options else None)
    return out


@st.composite
def split_episodes(draw):
    """``(rollout, scores)``: ``P`` prompts of ``G`` episodes, each of 1 to 3 samples of 0 to 4
    tokens (a random loss mask), the rollout's rows holding each episode's samples in a row."""
    prompts, group = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    rows, splits, masks = [], [], []
    for _ in range(prompts * group):
        segments = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        row_mask = draw(st.lists(st.booleans(), min_size=sum(segments), max_size=sum(segments)))
        starts = [sum(segments[:i]) for i in range(1, len(segments))]
        rows.append(sum(segments))
        splits.append(starts)
        masks.append(row_mask)
    width = max(1, max(rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row_mask in enumerate(masks):
        ids[i, : rows[i]] = torch.arange(1, rows[i] + 1)
        mask[i, : rows[i]] = torch.tensor(row_mask, dtype=torch.bool)
    value = st.one_of(st.integers(-8, 8).map(lambda k: k / 4), st.just(math.nan))
    scores = torch.tensor(draw(st.lists(value, min_size=len(rows), max_size=len(rows))), dtype=torch.float32)
    n = len(rows)
    episodes = Episodes([[] for _ in range(n)], [None] * n, torch.ones(n), torch.zeros(n), torch.zeros(n),
                        torch.tensor(rows), torch.zeros(n, dtype=torch.bool), splits)
    rollout = RolloutBatch(torch.ones((prompts, 2), dtype=torch.long), torch.ones((prompts, 2), dtype=torch.bool),
                           ids, mask, torch.zeros(n, dtype=torch.bool), [""] * n, torch.rand(n, width), episodes)
    return rollout, scores


def _unsplit(rollout: RolloutBatch) -> RolloutBatch:
    e = rollout.episodes
    episodes = Episodes(e.messages, e.env_rewards, e.turns, e.tool_calls, e.tool_errors, e.lengths, e.failed, None)
    return RolloutBatch(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask,
                        rollout.truncated, rollout.completions, rollout.sampling_logp, episodes)


@settings(max_examples=60, deadline=None)
@given(split_episodes())
def test_splitting_an_episode_changes_none_of_its_advantages(estimators, case):
    rollout, scores = case
    g = rollout.group_size
    group_ids = torch.arange(rollout.prompt_ids.shape[0]).repeat_interleave(g)
    whole = train_batch(_unsplit(rollout), False)
    batch = train_batch(rollout, False)
    assert whole.samples is None
    split = any(rollout.episodes.splits)
    assert (batch.samples is not None) == split
    # the batch: one row per sample, G' per prompt, each sample's tokens and mask at its place
    assert torch.equal(batch.per_episode(batch.mask, False), whole.mask)
    assert torch.equal(batch.per_episode(batch.completion_ids), whole.completion_ids)
    assert torch.equal(batch.per_episode(batch.sampling_logp).masked_fill(~whole.mask, 0),
                       whole.sampling_logp.masked_fill(~whole.mask, 0))
    assert batch.mask.sum() == whole.mask.sum()  # every trained token in exactly one sample
    for name, estimator in estimators.items():
        reference = estimator(AdvantageInputs(scores.clone(), group_ids, whole.mask))
        advantages = batch.per_sample(estimator(AdvantageInputs(scores.clone(), group_ids,
                                                                batch.per_episode(batch.mask, False))))
        if batch.samples is None:
            assert torch.equal(advantages, reference), name
            continue
        s = batch.samples
        for row in range(len(s.episode)):
            e, start, length = int(s.episode[row]), int(s.start[row]), int(s.length[row])
            if e < 0:  # a padding row: nothing
                assert not advantages[row].any() and not batch.mask[row].any(), name
                continue
            assert torch.equal(advantages[row, :length], reference[e, start:start + length]), name
            assert not advantages[row, length:].any(), name


@settings(max_examples=60, deadline=None)
@given(split_episodes())
def test_aggregators_count_samples_as_sequences(case):
    """token-mean: the same loss split or not (every trained token once, same normalizer);
    seq-mean-token-mean: the mean over samples of each sample's token mean, padding rows left
    out of ``num_sequences``."""
    rollout, _ = case
    batch, whole = train_batch(rollout, False), train_batch(_unsplit(rollout), False)
    loss = torch.randn(whole.mask.shape, dtype=torch.float64)
    per_sample = batch.per_sample(loss)
    rows = torch.arange(batch.mask.shape[0])
    tokens = int(whole.mask.sum())
    stats = BatchStats(tokens, batch.sequences(rows), 8)
    assert torch.allclose(token_mean(per_sample, batch.mask, stats),
                          token_mean(loss, whole.mask, BatchStats(tokens, len(whole.mask), 8)))
    real = [r for r in range(len(rows)) if batch.samples is None or int(batch.samples.episode[r]) >= 0]
    assert stats.num_sequences == len(real)
    means = [float(per_sample[r][batch.mask[r]].mean()) if batch.mask[r].any() else 0.0 for r in real]
    expected = sum(means) / len(real) if real else 0.0
    assert math.isclose(float(seq_mean_token_mean(per_sample, batch.mask, stats)), expected, abs_tol=1e-9)
