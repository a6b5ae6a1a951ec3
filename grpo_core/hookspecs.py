"""Hook specifications: one hook per component kind, each named ``register_<kind>s``.

A plugin implements any of them with ``@grpo_core.hookimpl`` and calls
``register.add(name, impl, options=OptionsModel)`` for every component it provides.
How ``impl`` is used is the same for every kind:

- registered **without** an options model, ``impl`` *is* the component;
- registered **with** one, ``impl`` is a factory: the engine validates the spec slot's
  keys with the options model and calls ``impl(options)`` once per run to build it.

The component's own contract (arguments, tensor shapes) is in :mod:`grpo_core.contracts`.
Hooks gain arguments over time; they never lose or rename one (added since 0.1 unless
stated otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from grpo_core.registry import Registrar

PROJECT = "grpo"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_advantage_estimators(register: "Registrar") -> None:
    """Register advantage estimators; called once when the registry is built.

    A component is a :class:`~grpo_core.contracts.AdvantageEstimator`: it takes
    :class:`~grpo_core.contracts.AdvantageInputs` (scores ``(B,)`` or step scores
    ``(B, K)``, group ids ``(B,)``, mask ``(B, T)``) and returns advantages ``(B, T)``,
    exactly zero on padding. Selected by ``algorithm.advantage.name``.
    """


@hookspec
def register_kl_penalties(register: "Registrar") -> None:
    """Register KL penalty estimators; called once when the registry is built.

    A component is a :class:`~grpo_core.contracts.KLPenalty`:
    ``kl(logp (B, T), ref_logp (B, T), mask (B, T)) -> (B, T)``, zero on padding.
    Selected by ``algorithm.kl.name``.
    """


@hookspec
def register_policy_losses(register: "Registrar") -> None:
    """Register policy losses; called once when the registry is built.

    A component is a :class:`~grpo_core.contracts.PolicyLoss`: it takes
    :class:`~grpo_core.contracts.PolicyLossInputs` (new and old log-probs, advantages and
    mask, all ``(B, T)``) and returns the per-token loss ``(B, T)`` to minimise plus
    metrics. Selected by ``algorithm.policy_loss.name``.
    """


@hookspec
def register_loss_aggregators(register: "Registrar") -> None:
    """Register loss aggregators; called once when the registry is built.

    A component is a :class:`~grpo_core.contracts.LossAggregator`:
    ``aggregate(loss (b, T), mask (b, T), stats: BatchStats) -> scalar``, where ``stats``
    holds the normalizers of the whole optimizer mini-batch. Selected by
    ``algorithm.aggregation.name``.
    """


@hookspec
def register_rollout_backends(register: "Registrar") -> None:
    """Register rollout backends; called once when the registry is built.

    A component is a :class:`~grpo_core.contracts.RolloutBackend` with ``setup``,
    ``generate`` (token ids of ``P`` prompts, group size ``G``, sampling settings ->
    :class:`~grpo_core.contracts.RolloutBatch` of ``B = P * G`` rows) and
    ``sync_weights``. Selected by ``rollout.name``.
    """


@hookspec
def register_reward_functions(register: "Registrar") -> None:
    """Register reward functions; called once when the registry is built.

    A component has TRL's signature ``reward(prompts, completions, **columns) ->
    list[float | None]`` (see :data:`~grpo_core.contracts.RewardFunction`), so a reward
    function written for TRL registers unchanged. A process reward names a ``steps``
    parameter and returns one list of per-step scores per completion. A reward function
    with ``fit``/``evaluate``/``state_dict``/``load_state_dict``
    (:class:`~grpo_core.contracts.TrainableReward`) can be the reward model that
    iterative GRPO trains. Selected by ``rewards[i].name``.
    """


@hookspec
def register_datasets(register: "Registrar") -> None:
    """Register datasets (tasks); called once when the registry is built.

    A component is a :class:`~grpo_core.contracts.Dataset`: ``load(split)`` returns rows
    (dicts with a prompt column and any other columns). Selected by ``data.name``.
    """


@hookspec
def register_step_splitters(register: "Registrar") -> None:
    """Register step splitters for process supervision; called once when the registry is
    built.

    A component is a :class:`~grpo_core.contracts.StepSplitter`: ``split(text) ->
    [(start, end), ...]``, the character spans of the steps of one completion's text, in
    order. The engine gives the steps' texts to reward functions that take ``steps`` and
    maps each step's end to a completion token index for the advantage estimator.
    Selected by ``algorithm.step_splitter.name``.
    """


@hookspec
def register_trackers(register: "Registrar") -> None:
    """Register experiment trackers; called once when the registry is built.

    A component is a :class:`~grpo_core.contracts.Tracker`. Selected by
    ``tracking[i].name``.
    """


@hookspec
def register_environments(register: "Registrar") -> None:
    """Register environments for multi-turn rollouts; called once when the registry is
    built (since 0.2).

    A component is a :class:`~grpo_core.contracts.Environment`: ``reset(row)`` opens an
    episode for a dataset row, ``step(state, text)`` answers each model turn with an
    :class:`~grpo_core.contracts.Observation` (messages such as a tool result, done, an
    optional reward); ``tools`` lists the JSON schemas the chat template shows the model.
    Selected by ``rollout.environment.name``.
    """


#: The component kinds, in the order the registry lists them: ``kind -> hook name``.
KINDS: dict[str, str] = {
    "advantage_estimator": "register_advantage_estimators",
    "kl_penalty": "register_kl_penalties",
    "policy_loss": "register_policy_losses",
    "loss_aggregator": "register_loss_aggregators",
    "rollout_backend": "register_rollout_backends",
    "reward_function": "register_reward_functions",
    "dataset": "register_datasets",
    "step_splitter": "register_step_splitters",
    "tracker": "register_trackers",
    "environment": "register_environments",
}

#: Words used in messages, per kind.
KIND_LABELS: dict[str, str] = {
    "advantage_estimator": "advantage estimator",
    "kl_penalty": "KL penalty",
    "policy_loss": "policy loss",
    "loss_aggregator": "loss aggregator",
    "rollout_backend": "rollout backend",
    "reward_function": "reward function",
    "dataset": "dataset",
    "step_splitter": "step splitter",
    "tracker": "tracker",
    "environment": "environment",
}
