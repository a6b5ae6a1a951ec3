"""Loss aggregators: hand values, micro-batch invariance of the gradient, zero normalizers."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins import aggregators as agg
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.contracts import BatchStats
from grpo_core.plugin_manager import load_plugins

F64 = torch.float64
NAN = float("nan")

AGGREGATORS = {
    "token-mean": agg.token_mean,
    "seq-mean-token-mean": agg.seq_mean_token_mean,
    "seq-mean-token-sum": agg.seq_mean_token_sum,
    "seq-mean-token-sum-norm": agg.SeqMeanTokenSumNorm(agg.SeqMeanTokenSumNormOptions()),
    "seq-mean-token-sum-norm/L=3": agg.SeqMeanTokenSumNorm(
        agg.SeqMeanTokenSumNormOptions(norm_length=3)
    ),
    "token-sum": agg.token_sum,
}


def stats_of(mask: torch.Tensor, max_length: int | None = None) -> BatchStats:
    return BatchStats(int(mask.sum()), mask.shape[0], max_length or mask.shape[1])


# --------------------------------------------------------------------------- hand values
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, NAN]], dtype=F64)
MASK = torch.tensor([[True, True, True], [True, False, False]])
STATS = BatchStats(num_tokens=4, num_sequences=2, max_length=5)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("token-mean", 10 / 4),
        ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),
        ("seq-mean-token-sum", 10 / 2),
        ("seq-mean-token-sum-norm", 10 / (2 * 5)),
        ("seq-mean-token-sum-norm/L=3", 10 / (2 * 3)),
        ("token-sum", 10.0),
    ],
)
def test_hand_values_ignore_padding(name, expected):
    out = AGGREGATORS[name](LOSS, MASK, STATS)
    assert out.dim() == 0
    torch.testing.assert_close(out, torch.tensor(expected, dtype=F64))


def test_empty_rows_contribute_zero_to_seq_mean_token_mean():
    loss = torch.tensor([[2.0, 4.0], [NAN, math.inf]], dtype=F64)
    mask = torch.tensor([[True, True], [False, False]])
    out = agg.seq_mean_token_mean(loss, mask, BatchStats(2, 2, 2))
    torch.testing.assert_close(out, torch.tensor(1.5, dtype=F64))  # (3 + 0) / 2


@pytest.mark.parametrize("name", list(AGGREGATORS))
def test_zero_normalizers_give_zero_loss_not_nan(name):
    x = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out = AGGREGATORS[name](x + 1.0, mask, BatchStats(0, 0, 0))
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


# --------------------------------------------------------------------------- invariants
@st.composite
def ragged(draw):
    rows = draw(st.integers(1, 8))
    length = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    seed = draw(st.integers(0, 2**31 - 1))
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return mask, seed


def per_token_loss(x: torch.Tensor, coef: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A non-linear per-token loss with NaN on padding (which must never leak in)."""
    return torch.where(mask, coef * x + x**2, NAN)


@settings(max_examples=40, deadline=None)
@given(ragged(), st.sampled_from(list(AGGREGATORS)))
def test_micro_batch_gradients_sum_to_full_batch_gradient(data, name):
    mask, seed = data
    aggregate = AGGREGATORS[name]
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(mask.shape, generator=gen, dtype=F64)
    coef = torch.randn(mask.shape, generator=gen, dtype=F64)
    order = torch.randperm(mask.shape[0], generator=gen)  # rows are shuffled between micro-batches
    stats = stats_of(mask, max_length=7)

    x = x0.clone().requires_grad_(True)
    full_loss = aggregate(per_token_loss(x, coef, mask), mask, stats)
    full_loss.backward()
    full_grad = x.grad.clone()
    assert torch.isfinite(full_loss) and torch.isfinite(full_grad).all()

    for size in range(1, mask.shape[0] + 1):
        x = x0.clone().requires_grad_(True)
        total = torch.zeros((), dtype=F64)
        for chunk in order.split(size):
            part = aggregate(per_token_loss(x[chunk], coef[chunk], mask[chunk]), mask[chunk], stats)
            part.backward()  # as gradient accumulation does
            total = total + part.detach()
        torch.testing.assert_close(total, full_loss.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, full_grad, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_equal_lengths_token_mean_equals_seq_mean_token_mean(rows, length, seed):
    gen = torch.Generator().manual_seed(seed)
    valid = torch.randint(1, length + 1, (), generator=gen).item()
    mask = torch.zeros(rows, length, dtype=torch.bool)
    mask[:, :valid] = True
    loss = torch.randn(rows, length, generator=gen, dtype=F64)
    stats = stats_of(mask)
    torch.testing.assert_close(
        agg.token_mean(loss, mask, stats), agg.seq_mean_token_mean(loss, mask, stats)
    )


def test_unequal_lengths_token_mean_differs_from_seq_mean():
    # the length bias the aggregators differ by: a long row weighs more in token-mean
    assert agg.token_mean(LOSS, MASK, STATS) != agg.seq_mean_token_mean(LOSS, MASK, STATS)


# --------------------------------------------------------------------------- registration
def test_aggregators_registered_and_buildable():
    registry = load_plugins(external=False).registry
    names = [
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-sum",
    ]
    for name in names:
        component = registry.get("loss_aggregator", name)
        assert component.plugin == "grpo_plugins.aggregators"
        built = component.build(component.options() if component.options else None)
        torch.testing.assert_close(built(LOSS, MASK, STATS), AGGREGATORS[name](LOSS, MASK, STATS))
    assert registry.get("loss_aggregator", "token-mean").options is None
    assert (
        registry.get("loss_aggregator", "seq-mean-token-sum-norm").options
        is agg.SeqMeanTokenSumNormOptions
    )


def test_norm_length_options():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        agg.SeqMeanTokenSumNormOptions(length=3)
    for bad in (0, -4):
        with pytest.raises(
            ValidationError, match="norm_length must be a positive integer.*or null"
        ):
            agg.SeqMeanTokenSumNormOptions(norm_length=bad)
    with pytest.raises(ValidationError, match="valid integer"):
        agg.SeqMeanTokenSumNormOptions(norm_length=2.5)
    description = agg.SeqMeanTokenSumNormOptions.model_fields["norm_length"].description
    assert "max_new_tokens" in description
