"""Every random stream of a run, derived from ``train.seed`` by one rule.

A stream's seed is ``train.seed * RUN`` plus an offset that names the stream and indexes
its draws. ``RUN`` (a prime above a million) keeps the streams of two runs whose seeds
differ by one far apart; ``STEP`` (a prime above the largest step offset used within one
step) keeps two steps' draws apart. Each function below is one stream; no seed is derived
anywhere else, so two streams can never be made to collide by a change in one place.

The values are part of a run's reproducibility: a run resumed from a checkpoint, or run
again with the same spec, seed and thread count, draws the same numbers. Changing a
derivation changes every run's samples (``tests/core/test_seeds.py`` pins them).
"""

from __future__ import annotations

#: Multiplier of ``train.seed``: runs whose seeds differ by one draw unrelated streams.
RUN = 1_000_003
#: Distance between two training steps' rollout seeds (and two processes' evaluation draws).
STEP = 65_537
#: Offset of the sampled held-out evaluation's draw from the training steps' seeds.
EVAL = 7_919
#: Offset between two iterations' sampling at the start of each iteration of iterative GRPO.
ITERATION = 7_919_000_003


def rollout(seed: int, step: int, first_prompt: int, *, round_: int = 0, prompts_per_step: int = 0) -> int:
    """The rollout seed of training ``step`` for the process whose groups start at prompt
    ``first_prompt``; under dynamic sampling (DAPO) round ``round_`` of the step is
    ``prompts_per_step`` further on, so no two (step, round, prompt) share a seed."""
    return seed * RUN + step * STEP + round_ * prompts_per_step + first_prompt


def sampled_eval(seed: int) -> int:
    """The draw of the sampled held-out evaluation (``eval.n``): the same at every
    evaluation of a run, so two evaluations differ by the weights, not by the draw."""
    return seed * RUN + EVAL


def eval_batch(base: int, rank: int, first_prompt: int) -> int:
    """The seed of one batch of a sampled evaluation drawn with seed ``base``: each process
    (``rank``) and each batch (its first prompt) draws its own numbers, reproducibly for a
    given number of processes."""
    return base + rank * STEP + first_prompt


def iteration(seed: int, iteration_index: int) -> int:
    """The sampling seed of the reward model's fresh samples at the start of iteration
    ``iteration_index`` (0-based) of iterative GRPO."""
    return seed * RUN + ITERATION * (iteration_index + 1)


def stochastic_rounding(seed: int, optimizer_step: int, parameter_index: int) -> int:
    """The generator seed of the stochastic rounding of one parameter's AdamW moments to
    bfloat16 at one optimizer step (1-based ``optimizer_step``, 1-based ``parameter_index``),
    within ``[0, 2**63)``."""
    return (seed * RUN + optimizer_step * STEP + parameter_index) % (2**63)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs (a run's start, the SFT stage's hand-over)."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
