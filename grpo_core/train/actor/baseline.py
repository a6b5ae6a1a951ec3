"""The greedy-baseline rollout an advantage estimator can ask for (``needs_greedy_baseline``,
ReMax): one greedy completion per prompt from the step's rollout backend, scored by the
step's reward functions. The engine learns no estimator name: it reads the flag."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch

from grpo_core.contracts import EpisodeDriver, RolloutBatch, SamplingParams
from grpo_core.train.actor.data import Prompt
from grpo_core.train.experience import Scored


def greedy_baseline_scores(
    backend: Any,
    score: Callable[[list[Prompt], RolloutBatch], Scored],
    prompts: list[Prompt],
    group_size: int,
    sampling: SamplingParams,
    driver: EpisodeDriver,
    autocast: Callable = nullcontext,
) -> torch.Tensor:
    """``float (P*G,)``: the total score of one greedy completion of each of the ``P``
    ``prompts``, repeated for the ``G = group_size`` rows of its group (prompt-major, as the
    step's rows); ``NaN`` where a reward function could not score it.

    The completion comes from ``driver.run(backend, prompts, 1, sampling')`` with
    ``sampling' = sampling`` but ``greedy=True`` (argmax decoding; the same length limit
    and stop strings) run by the step's episode ``driver`` (single turn or multi-turn); ``score`` is the
    step's scoring of a rollout (the same reward functions, weights and error policy).
    """
    greedy = replace(sampling, greedy=True)
    with autocast():
        rollout = driver.run(backend, prompts, 1, greedy)
    if rollout.completion_ids.shape[0] != len(prompts):
        raise RuntimeError(
            f"greedy baseline: the rollout backend returned {rollout.completion_ids.shape[0]} completions for "
            f"{len(prompts)} prompts with group_size=1"
        )
    total = score(prompts, rollout).scores.total
    return total.float().repeat_interleave(group_size)
