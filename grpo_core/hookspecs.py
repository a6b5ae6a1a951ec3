"""Hook specifications: one hook per component kind, each named ``register_<kind>s``.

A plugin implements any of them with ``@grpo_core.hookimpl`` and calls
``register.add(name, impl, options=OptionsModel)`` for every component it provides.
How ``impl`` is used is the same for every kind:

- registered **without** an options model, ``impl`` *is* the component;
- registered **with** one, ``impl`` is a factory: the engine validates the spec slot's
  keys with the options model and calls ``impl(options)`` once per run to build it.

The component's own contract (arguments, tensor shapes, optional flags) is in
:mod:`grpo_core.contracts`; every built component is checked against it
(:func:`grpo_core.registry.conform`). :data:`grpo_core.kinds.KINDS` lists the kinds with
their hooks and contracts.

One more hook adds ``grpo-run`` subcommands rather than components:
``register_commands(register)`` (:mod:`grpo_core.commands`).

Hooks gain arguments over time; they never lose or rename one (added since 0.1 unless
stated otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from grpo_core.commands import CommandRegistrar
    from grpo_core.registry import Registrar

PROJECT = "grpo"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_advantage_estimators(register: Registrar) -> None:
    """Register advantage estimators; called once when the registry is built.

    Each component follows :class:`~grpo_core.contracts.AdvantageEstimator`. Selected by
    ``algorithm.advantage.name``.
    """


@hookspec
def register_kl_penalties(register: Registrar) -> None:
    """Register KL penalty estimators; called once when the registry is built.

    Each component follows :class:`~grpo_core.contracts.KLPenalty`. Selected by
    ``algorithm.kl.name``.
    """


@hookspec
def register_policy_losses(register: Registrar) -> None:
    """Register policy losses; called once when the registry is built.

    Each component follows :class:`~grpo_core.contracts.PolicyLoss`. Selected by
    ``algorithm.policy_loss.name``.
    """


@hookspec
def register_loss_aggregators(register: Registrar) -> None:
    """Register loss aggregators; called once when the registry is built.

    Each component follows :class:`~grpo_core.contracts.LossAggregator`. Selected by
    ``algorithm.aggregation.name``.
    """


@hookspec
def register_rollout_backends(register: Registrar) -> None:
    """Register rollout backends; called once when the registry is built.

    Each component follows :class:`~grpo_core.contracts.RolloutBackend`. Selected by
    ``rollout.name``.
    """


@hookspec
def register_reward_functions(register: Registrar) -> None:
    """Register reward functions; called once when the registry is built.

    Each component follows :class:`~grpo_core.contracts.RewardFunction` (TRL's signature,
    so a TRL reward function registers unchanged). Selected by ``rewards[i].name``.

    A reward function that also follows :class:`~grpo_core.contracts.TrainableReward` can be
    the reward model that iterative GRPO trains.
    """


@hookspec
def register_datasets(register: Registrar) -> None:
    """Register datasets (tasks); called once when the registry is built.

    Each component follows :class:`~grpo_core.contracts.Dataset`. Selected by
    ``data.name``.
    """


@hookspec
def register_prompt_samplers(register: Registrar) -> None:
    """Register prompt samplers (which training rows are drawn); called once when the
    registry is built.

    Each component follows :class:`~grpo_core.contracts.PromptSampler`. Selected by
    ``data.sampler.name``.
    """


@hookspec
def register_step_splitters(register: Registrar) -> None:
    """Register step splitters for process supervision; called once when the registry is built.

    Each component follows :class:`~grpo_core.contracts.StepSplitter`. Selected by
    ``algorithm.step_splitter.name``.
    """


@hookspec
def register_trackers(register: Registrar) -> None:
    """Register experiment trackers; called once when the registry is built.

    Each component follows :class:`~grpo_core.contracts.Tracker`. Selected by
    ``tracking[i].name``.
    """


@hookspec
def register_environments(register: Registrar) -> None:
    """Register environments for multi-turn rollouts (tools, simulated users); called once
    when the registry is built.

    Each component follows :class:`~grpo_core.contracts.Environment`. Selected by
    ``rollout.environment.name``.
    """


@hookspec
def register_agents(register: Registrar) -> None:
    """Register agents; called once when the registry is built. An agent is a program that
    runs an episode against the policy through an OpenAI-compatible endpoint the run serves
    (:class:`~grpo_core.contracts.Agent`). Selected by ``rollout.agent.name`` (or a route's
    ``agent.name`` under ``rollout.routing``). Added in 0.2.
    """


@hookspec
def register_launchers(register: Registrar) -> None:
    """Register launchers; called once when the registry is built. A launcher starts and
    supervises the processes of one run (:class:`~grpo_core.contracts.Launcher`): on this host
    (the built-in ``local``), or through Ray, SLURM or a cluster's own scheduler. Selected by
    ``grpo-run run SPEC --launcher NAME`` (``local`` when ``--nproc N`` asks for more than one
    process), its options by ``--launcher-option KEY=VALUE``. Added in 0.2.
    """


@hookspec
def register_episode_drivers(register: Registrar) -> None:
    """Register episode drivers; called once when the registry is built. A driver runs a
    prompt's ``G`` episodes with the rollout backend and returns the group's rollouts
    (:class:`~grpo_core.contracts.EpisodeDriver`); the built-ins are ``single-turn``,
    ``environment``, ``agent`` and ``routing``. Register it with an options model (an empty
    :class:`~grpo_core.options.Options` will do): each spec slot that selects it then builds a
    driver of its own. Selected by ``rollout.driver.name``, which defaults to the driver of
    the spec's episode source; a route's by ``rollout.routing.routes.<route>.driver.name``.
    Added in 0.2.
    """


@hookspec
def register_commands(register: CommandRegistrar) -> None:
    """Register ``grpo-run`` subcommands; called once each time the plugins are loaded
    (:func:`grpo_core.plugin_manager.load_plugins`, which also fills the registry). ``grpo-run``
    loads them before it parses a command line whose first word is not one of its own commands
    (a plugin's command, a spec, ``--help``); ``grpo-run plugins`` and the docs list them.

    ``register`` is a :class:`~grpo_core.commands.CommandRegistrar`:
    ``register.add(name, help=..., configure=fn(parser), run=fn(args) -> int, passthrough=False)``
    adds ``grpo-run NAME``, with the arguments ``configure`` puts on its ``argparse`` parser;
    ``run`` receives the parsed arguments and returns the exit code. A name that is one of
    grpo-run's own commands, or that another plugin registered, is an error naming both.
    Added in 0.2.
    """
