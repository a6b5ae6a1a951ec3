"""What crosses the seam between the actor and the learner, defined on neither side.

The actor (:mod:`grpo_core.train.actor.actor`, and its thread in an asynchronous run,
:mod:`grpo_core.train.pipeline`) makes an :class:`Experience`; the learner
(:mod:`grpo_core.train.learner.learner`) consumes it. Both import this module and neither imports
the other, so a queue or a process boundary can stand between them.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from grpo_core.contracts import PromptImages, RolloutBatch

if TYPE_CHECKING:
    from grpo_core.train.reasoning_steps import StepLayout


@dataclass
class Prompt:
    """One prompt ready for rollout: the row, what the rewards see, and its tokens."""

    row: dict[str, Any]
    prompt: Any  # a string, or the list of chat messages (system prompt included)
    text: str
    ids: list[int]
    index: int | None = None  # its row's index in the training rows (a prompt sampler's key)
    source: str | None = None  # its row's data.source_column value (per-source metrics)
    images: PromptImages | None = None  # its images and the processor's tensors (data.image_column)


@dataclass
class Timer:
    """Seconds spent per named phase, summed over the phase's uses."""

    phases: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class Scores:
    """Rewards of ``B`` completions.

    ``total``: ``float (B,)`` weighted sum, NaN where every function said None.
    ``per_function``: ``float (B, F)``, NaN where a function said None.
    ``failed``: completions whose reward function raised and were scored None.
    ``step_scores``: ``float (B, K)`` weighted step scores when steps were given, else None.
    ``weights``: ``float (F,)`` each function's weight (``total`` is the weighted sum of the
    non-NaN entries of ``per_function``), or None where they are not known (evaluation).
    """

    total: torch.Tensor
    per_function: torch.Tensor
    names: list[str]
    failed: int = 0
    step_scores: torch.Tensor | None = None  # float (B, K), NaN where no function scored
    weights: torch.Tensor | None = None  # float (F,)


@dataclass
class Scored:
    """``P`` prompts, their rollout (``B = P*G`` rows), its scores and, when cut, its steps."""

    prompts: list[Prompt]
    rollout: RolloutBatch
    scores: Scores
    layout: StepLayout | None = None


@dataclass
class Experience:
    """What passes from the actor to the learner: one step's scored groups.

    ``scored`` holds this process's ``P`` prompts and their ``B = P*G`` rows (the rollout
    with its sampler log-probs when the backend gives them, the rewards, the reasoning steps
    when cut); ``version`` is the policy version the rows were sampled with (the number of
    learner updates the actor's weights had seen), with partial rollouts that of their oldest
    tokens (the rollout's ``token_versions`` holds each token's); ``temperature`` the sampling temperature
    they were drawn at, which the learner's log-probs use (``rollout.temperature``: the actor
    owns it); ``metrics`` what collecting measured (dynamic sampling's counts); ``times`` its
    phases in seconds (``generate``, ``score``, ``baseline``, ``sampler_logprobs``);
    ``baseline_scores`` the ``(B,)`` scores of one greedy completion of each row's prompt when
    the estimator asks for them (ReMax), else None.
    """

    step: int
    scored: Scored
    version: int
    temperature: float = 1.0
    metrics: dict[str, float] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    baseline_scores: torch.Tensor | None = None
