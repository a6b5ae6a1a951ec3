"""What the learner hands an advantage estimator (grpo_core.train.learner.learner): the reward table the
engine fills for every estimator (each function's scores and weights, whose weighted sum is the
reward; the KL-in-reward penalty as a column of its own), kept through dynamic sampling's group
selection and concatenation, and every field gathered from several processes as one would have it."""

from __future__ import annotations

import math
from dataclasses import fields

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.contracts import AdvantageInputs, RolloutBatch
from grpo_core.train.actor.rollout import concat_scored, select_groups
from grpo_core.train.actor.scoring import RewardFn, score
from grpo_core.train.experience import Scored
from grpo_core.train.learner.learner import advantage_inputs, global_advantages

VALUE = st.one_of(st.none(), st.integers(-4, 4).map(lambda k: k / 2))


def rollout(rows: int, group: int, width: int = 3) -> RolloutBatch:
    prompts = torch.ones((rows // group, 1), dtype=torch.long)
    mask = torch.ones((rows, width), dtype=torch.bool)
    return RolloutBatch(prompts, prompts.bool(), torch.ones((rows, width), dtype=torch.long), mask,
                        torch.zeros(rows, dtype=torch.bool), [f"c{i}" for i in range(rows)])


def column(table: list[list[float | None]], j: int):
    """A reward function returning column ``j`` of ``table``."""
    return lambda completions, **kw: [row[j] for row in table]


def scored_of(table: list[list[float | None]], weights: list[float], group: int = 2) -> Scored:
    fns = [RewardFn.of(f"f{j}", w, column(table, j)) for j, w in enumerate(weights)]
    rows = len(table)
    scores = score(fns, ["p"] * rows, [f"c{i}" for i in range(rows)], {}, [[1]] * rows)
    return Scored([None] * (rows // group), rollout(rows, group), scores)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3).flatmap(lambda f: st.tuples(
    st.lists(st.lists(VALUE, min_size=f, max_size=f), min_size=4, max_size=4).filter(
        lambda t: any(v is not None for row in t for v in row)),
    st.lists(st.sampled_from([1.0, 0.5, -2.0]), min_size=f, max_size=f))))
def test_the_weighted_sum_of_the_reward_table_is_the_reward(drawn):
    table, weights = drawn
    scored = scored_of(table, weights)
    inputs = advantage_inputs(scored, scored.scores.total, None, scored.rollout.completion_mask)
    assert inputs.reward_names == tuple(f"f{j}" for j in range(len(weights)))
    assert inputs.reward_weights.tolist() == weights
    got = inputs.reward_scores
    assert got.shape == (4, len(weights))
    for i, row in enumerate(table):
        assert [None if math.isnan(v) else v for v in got[i].tolist()] == row
        present = [w * v for w, v in zip(weights, row) if v is not None]
        if present:
            assert float(inputs.scores[i]) == sum(present)
        else:
            assert math.isnan(float(inputs.scores[i]))


def test_a_kl_in_the_reward_is_a_column_of_weight_one():
    scored = scored_of([[1.0], [0.0], [None], [0.5]], [2.0])
    penalty = torch.tensor([0.1, 0.2, 0.3, 0.4])
    inputs = advantage_inputs(scored, scored.scores.total - penalty, penalty, scored.rollout.completion_mask)
    assert inputs.reward_names == ("f0", "kl_penalty")
    assert inputs.reward_weights.tolist() == [2.0, 1.0]
    torch.testing.assert_close(inputs.reward_scores[:, 1], -penalty)
    scorable = ~torch.isnan(inputs.scores)
    weighted = torch.where(torch.isnan(inputs.reward_scores), 0.0, inputs.reward_scores * inputs.reward_weights)
    torch.testing.assert_close(weighted.sum(dim=1)[scorable], inputs.scores[scorable])


def test_selecting_and_concatenating_groups_keeps_the_weights():
    scored = scored_of([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]], [1.0, 0.25])
    picked = select_groups(scored, [1])
    assert picked.scores.weights.tolist() == [1.0, 0.25]
    both = concat_scored([picked, select_groups(scored, [0])])
    assert both.scores.weights.tolist() == [1.0, 0.25]
    assert both.scores.per_function.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]


class TwoProcesses:
    """A stand-in for :class:`grpo_core.train.distributed.Dist` of process ``rank`` of two whose
    ``gather`` answers with both processes' objects (the other one given in advance)."""

    active, world = True, 2

    def __init__(self, rank: int, other):
        self.rank, self.other = rank, other

    def gather(self, obj):
        return [obj, self.other] if self.rank == 0 else [self.other, obj]


def process_inputs(rows: int, width: int, seed: int) -> AdvantageInputs:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=gen) > 0.3
    return AdvantageInputs(
        torch.rand(rows, generator=gen), torch.arange(rows // 2).repeat_interleave(2), mask,
        baseline_scores=torch.rand(rows, generator=gen), reward_scores=torch.rand(rows, 2, generator=gen),
        reward_weights=torch.tensor([1.0, 0.5]), reward_names=("a", "b"),
        logp=-torch.rand(rows, width, generator=gen) * mask,
        teacher_logp=-torch.rand(rows, width, generator=gen) * mask,
    )


def test_every_input_field_is_gathered_as_one_process_would_hold_it():
    """Each process's rows (different widths T) go to an estimator that sees the whole batch:
    groups renumbered, per-token fields padded, the table concatenated, weights and names shared;
    each process gets back its own rows, and they are what one process holding both would get."""
    seen = []

    def estimator(inputs: AdvantageInputs) -> torch.Tensor:
        seen.append(inputs)
        table = (inputs.reward_scores * inputs.reward_weights).sum(dim=1)
        per_row = table + inputs.scores + inputs.baseline_scores + inputs.group_ids
        return (per_row[:, None] + inputs.logp - inputs.teacher_logp) * inputs.mask

    first, second = process_inputs(4, 3, 0), process_inputs(2, 5, 1)
    names = [f.name for f in fields(AdvantageInputs)]
    as_dicts = [{n: getattr(x, n) for n in names} for x in (first, second)]
    got0 = global_advantages(estimator, TwoProcesses(0, as_dicts[1]), first)
    got1 = global_advantages(estimator, TwoProcesses(1, as_dicts[0]), second)
    whole = seen[0]
    assert whole.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert whole.mask.shape == (6, 5) and whole.logp.shape == (6, 5) and whole.teacher_logp.shape == (6, 5)
    assert whole.reward_scores.shape == (6, 2) and whole.reward_names == ("a", "b")
    assert whole.step_scores is None
    assert got0.shape == (4, 3) and got1.shape == (2, 5)
    alone = [estimator(first), estimator(AdvantageInputs(**{**{n: getattr(second, n) for n in names},
                                                            "group_ids": second.group_ids + 2}))]
    torch.testing.assert_close(got0, alone[0])
    torch.testing.assert_close(got1, alone[1])
