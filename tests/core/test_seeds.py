"""The seed derivations: one rule, one home (``grpo_core/train/seeds.py``).

The exact values are pinned: they are what every run drew before the derivations moved
here, and what a resumed or repeated run must draw again.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from grpo_core.train import seeds

ROOT = Path(__file__).resolve().parents[2]


def test_each_stream_gives_the_values_runs_have_always_drawn():
    # seed 3: 3 * 1_000_003 = 3_000_009
    assert seeds.rollout(3, 5, 2) == 3_000_009 + 5 * 65_537 + 2
    assert seeds.rollout(3, 5, 2, round_=1, prompts_per_step=4) == 3_000_009 + 327_685 + 4 + 2 == 3_327_700
    assert seeds.sampled_eval(3) == 3_007_928
    assert seeds.eval_batch(3_007_928, 1, 8) == 3_007_928 + 65_537 + 8
    assert seeds.iteration(3, 0) == 3_000_009 + 7_919_000_003
    assert seeds.iteration(3, 1) == 3_000_009 + 2 * 7_919_000_003
    assert seeds.stochastic_rounding(3, 2, 7) == 3_000_009 + 131_074 + 7
    assert seeds.stochastic_rounding(2**62, 1, 1) == (2**62 * 1_000_003 + 65_537 + 1) % 2**63


@given(
    seed=st.integers(0, 10**6), prompts=st.integers(1, 64), rounds=st.integers(1, 8),
    steps=st.integers(1, 50),
)
def test_no_two_rollouts_of_a_run_share_a_seed(seed, prompts, rounds, steps):
    """Every (step, dynamic-sampling round, first prompt) of a run draws its own seed."""
    drawn = [
        seeds.rollout(seed, step, first, round_=r, prompts_per_step=prompts)
        for step in range(steps) for r in range(rounds) for first in range(prompts)
    ]
    assert len(set(drawn)) == len(drawn)


def test_no_seed_is_derived_outside_the_seeds_module():
    """The multipliers of the rule appear in ``seeds.py`` alone: a new stream is a new
    function there, not a new formula at its call site."""
    pattern = re.compile(r"1_?000_?003|65_?537|7_?919")
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for folder in ("grpo_core", "plugins")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "seeds.py"
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
