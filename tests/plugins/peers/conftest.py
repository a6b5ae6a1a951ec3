"""What the peer-equivalence tests share: grpo-core's components built by name with options, batches
of groups (every row with at least one loss token, groups of two or more: the peers' conventions for
empty rows and lone completions differ, and docs/algorithms.md says how), and the loss and gradient
of a grpo-core objective (policy loss, then aggregator) next to a peer's scalar loss."""

from __future__ import annotations

from functools import cache

import torch
from hypothesis import settings
from hypothesis import strategies as st

from grpo_core.contracts import AdvantageInputs, BatchStats, PolicyLossInputs
from grpo_core.plugin_manager import load_plugins

F64 = torch.float64
FAST = settings(max_examples=40, deadline=None)


@cache
def _registry():
    return load_plugins(external=False).registry


def component(kind: str, name: str, **options):
    """The built component ``name`` of ``kind`` with ``options`` (validated by its options model)."""
    entry = _registry().get(kind, name)
    return entry.build(entry.options(**options) if entry.options is not None else None)


@st.composite
def groups(draw, binary: bool = False, per_token: bool = False, spread: float = 1.0, min_length: int = 1):
    """A batch of ``P`` groups of ``G >= 2``: ``(scores (B,), index list, mask bool (B, T), logp, old,
    advantages (B, T))``; every row has at least ``min_length`` tokens; log-ratios up to
    ``+-spread``; log-probs in (-4, 0)."""
    num_prompts, group = draw(st.integers(1, 3)), draw(st.integers(2, 5))
    rows, width = num_prompts * group, draw(st.integers(max(min_length, 1), 6))
    value = st.sampled_from([0.0, 1.0]) if binary else st.integers(-8, 8).map(lambda k: k / 4)
    scores = torch.tensor(draw(st.lists(value, min_size=rows, max_size=rows)), dtype=F64)
    lengths = torch.tensor(draw(st.lists(st.integers(max(min_length, 1), width), min_size=rows, max_size=rows)))
    mask = torch.arange(width)[None, :] < lengths[:, None]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logp = -torch.rand(rows, width, generator=gen, dtype=F64) * 4
    old = (logp + (torch.rand(rows, width, generator=gen, dtype=F64) * 2 - 1) * spread).clamp(max=-1e-4)
    adv = torch.randn(rows, width if per_token else 1, generator=gen, dtype=F64).expand(rows, width)
    index = [i // group for i in range(rows)]
    return scores, index, mask, logp, old, torch.where(mask, adv, 0.0).contiguous()


def inputs_of(scores, index, mask, **fields) -> AdvantageInputs:
    return AdvantageInputs(scores, torch.tensor(index), mask, **fields)


def ours(loss, aggregation: str, logp, old, adv, mask, *, sampling=None, max_length=None, weight=None):
    """``(scalar, d scalar / d logp)`` of grpo-core's objective: the policy loss (times ``weight``, a
    rollout-correction weight), aggregated over one micro-batch that is the whole mini-batch."""
    leaf = logp.clone().requires_grad_(True)
    per_token = loss(PolicyLossInputs(leaf, old, adv, mask, sampling_logp=sampling)).loss
    if weight is not None:
        per_token = per_token * weight
    stats = BatchStats(int(mask.sum()), mask.shape[0], max_length or mask.shape[1])
    value = component("loss_aggregator", aggregation)(per_token, mask, stats)
    (grad,) = torch.autograd.grad(value, leaf)
    return value.detach(), grad


def peer(fn, logp):
    """``(scalar, d scalar / d logp)`` of a peer's loss ``fn(logp)``."""
    leaf = logp.clone().requires_grad_(True)
    value = fn(leaf)
    (grad,) = torch.autograd.grad(value, leaf)
    return value.detach(), grad


def assert_same(a, b, rtol=1e-6, atol=1e-8):
    """Equal up to the peers' own 1e-8 constants in denominators (masked means) and the float32
    constants some build (TRL's SAPO temperatures)."""
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
