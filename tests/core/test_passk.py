"""pass@k (Chen et al. 2021) against brute force over every k-subset, and mean@n by hand."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.train.loop.passk import default_ks, mean_at_n, mean_pass_at_k, pass_at_k


def brute_force(n: int, c: int, k: int) -> Fraction:
    """The fraction of k-subsets of n samples (c of them correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


@st.composite
def nck(draw, max_n: int = 12):
    n = draw(st.integers(1, max_n))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@settings(max_examples=300, deadline=None)
@given(nck())
def test_pass_at_k_equals_brute_force_enumeration(case):
    n, c, k = case
    assert pass_at_k(n, c, k) == pytest.approx(float(brute_force(n, c, k)), abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(nck(max_n=8), min_size=1, max_size=5))
def test_mean_pass_at_k_averages_prompts(cases):
    n = max(n for n, _, _ in cases)
    counts = [min(c, n) for _, c, _ in cases]
    for k in range(1, n + 1):
        expected = sum(float(brute_force(n, c, k)) for c in counts) / len(counts)
        assert mean_pass_at_k(n, counts, k) == pytest.approx(expected, abs=1e-12)


def test_known_values_and_edges():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 6, 5) == 1.0  # only 4 wrong: every 5-subset holds a correct one
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 3 of the 6 pairs hold the correct one
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert math.isnan(mean_pass_at_k(4, [], 1))
    assert default_ks(1) == [1] and default_ks(8) == [1, 8]


def test_large_n_is_stable_and_exact():
    """n = 1000 would overflow a float binomial C(1000, 200); the product form does not."""
    n, c, k = 1000, 7, 200
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_out_of_range_arguments_are_errors(n, c, k):
    with pytest.raises(ValueError, match="0 <= c <= n and 1 <= k <= n"):
        pass_at_k(n, c, k)


def test_mean_at_n_by_hand_leaves_unscorable_out():
    assert mean_at_n([1.0, 0.0, 0.5, 0.5]) == pytest.approx(0.5)
    assert mean_at_n([1.0, math.nan, 0.0, math.nan]) == pytest.approx(0.5)
    assert math.isnan(mean_at_n([math.nan, math.nan]))
