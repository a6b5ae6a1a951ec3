"""What the advantage-estimator tests share: the hypothesis strategy of grouped batches, the
rows of each group, and ``AdvantageInputs`` from plain lists (imported as ``from .conftest import ...``)."""

from __future__ import annotations

import math

import torch
from hypothesis import settings
from hypothesis import strategies as st

from grpo_core.contracts import AdvantageInputs

F64 = torch.float64
NAN = float("nan")
FAST = settings(max_examples=40, deadline=None)
BINARY = st.sampled_from([0.0, 1.0])


@st.composite
def grouped_batches(draw, values=None, nan=True, min_group=1, max_group=5):
    """(scores (B,), group_ids (B,), mask (B, T)): shuffled rows, ragged lengths (0 included), rewards
    from ``values`` or on a 0.25 grid (so distinct rewards stay distinct under the transforms used)."""
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


def members(group_ids: torch.Tensor) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for row, gid in enumerate(group_ids.tolist()):
        out.setdefault(gid, []).append(row)
    return out


def scorable(r: list[float], rows: list[int]) -> list[int]:
    return [i for i in rows if not math.isnan(r[i])]


def constant(r: list[float], rows: list[int]) -> bool:
    return len({r[i] for i in rows}) < 2


def inputs(scores, group_ids=None, mask=None, **steps) -> AdvantageInputs:
    scores = torch.as_tensor(scores, dtype=F64)
    if group_ids is None:
        group_ids = torch.zeros(len(scores), dtype=torch.long)
    if mask is None:
        mask = torch.ones(len(scores), 3, dtype=torch.bool)
    return AdvantageInputs(scores, torch.as_tensor(group_ids), mask, **steps)
