"""The data that flows between the engine and its plugins, and the shape of each component.

Shape vocabulary, used in every docstring of the project:

- ``P``: prompts per step, ``G``: group size (completions per prompt), ``B = P * G`` rows,
- ``T``: completion tokens (padded), ``L``: prompt tokens (left padded), ``V``: vocabulary,
- ``K``: steps per completion (padded), for process supervision.

Masks are ``bool``; padded positions of every per-token output are exactly zero.
Rows are ordered prompt-major: rows ``p*G .. p*G+G-1`` are the group of prompt ``p``.

One module per part of the flow (:mod:`~grpo_core.contracts.algorithms`,
:mod:`~grpo_core.contracts.rollout`, :mod:`~grpo_core.contracts.episodes`,
:mod:`~grpo_core.contracts.drivers`,
:mod:`~grpo_core.contracts.rewards`, :mod:`~grpo_core.contracts.components`,
:mod:`~grpo_core.contracts.images`, :mod:`~grpo_core.contracts.launch`,
:mod:`~grpo_core.contracts.routes`); import every name from here.
"""

from __future__ import annotations

from grpo_core.contracts.algorithms import (
    AdvantageEstimator,
    AdvantageInputs,
    BatchStats,
    KLPenalty,
    LossAggregator,
    PolicyLoss,
    PolicyLossInputs,
    PolicyLossOutput,
    Teacher,
    masked_fill_zero,
)
from grpo_core.contracts.components import Dataset, PromptSampler, RowStream, Stateful, Tracker
from grpo_core.contracts.drivers import DriverSetup, EpisodeDriver
from grpo_core.contracts.episodes import Agent, AgentEpisode, Environment, Episodes, Observation
from grpo_core.contracts.images import PromptImages, image_inputs, repeat_rows
from grpo_core.contracts.launch import Launcher, RunArguments
from grpo_core.contracts.rewards import (
    RewardExample,
    RewardFunction,
    StepSplitter,
    TrainableReward,
    completion_text,
    reward_value,
)
from grpo_core.contracts.rollout import (
    RolloutBackend,
    RolloutBatch,
    RolloutCapabilities,
    RolloutSetup,
    SamplingParams,
    WeightPush,
    WeightSwitch,
    check_request,
    check_sampling,
    cut_after_stop,
    left_pad,
    oldest_versions,
    policy_copy,
    special_ids,
    token_staleness,
)
from grpo_core.contracts.routes import ExpertRoutes, RouteRecorder, moe_routers

__all__ = [
    "ExpertRoutes",
    "RouteRecorder",
    "moe_routers",
    "PromptImages",
    "image_inputs",
    "repeat_rows",
    "AdvantageInputs",
    "AdvantageEstimator",
    "Teacher",
    "KLPenalty",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "PolicyLoss",
    "BatchStats",
    "LossAggregator",
    "SamplingParams",
    "RolloutBatch",
    "RolloutBackend",
    "RolloutCapabilities",
    "RolloutSetup",
    "WeightPush",
    "RewardFunction",
    "reward_value",
    "StepSplitter",
    "RewardExample",
    "TrainableReward",
    "Dataset",
    "PromptSampler",
    "RowStream",
    "Tracker",
    "Launcher",
    "RunArguments",
    "Stateful",
    "Observation",
    "Environment",
    "Episodes",
    "Agent",
    "AgentEpisode",
    "EpisodeDriver",
    "DriverSetup",
    "completion_text",
    "masked_fill_zero",
    "check_request",
    "check_sampling",
    "left_pad",
    "special_ids",
    "WeightSwitch",
    "oldest_versions",
    "token_staleness",
    "cut_after_stop",
    "policy_copy",
]
