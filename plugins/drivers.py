"""The built-in episode drivers (:class:`~grpo_core.contracts.EpisodeDriver`): ``single-turn``,
``environment``, ``agent`` and ``routing``, the engine's own
(:mod:`grpo_core.train.actor.drivers`), registered here as a third party's driver would be.
Each takes no options of its own: what it runs is the spec's episode source
(``rollout.environment``, ``rollout.agent``, ``rollout.routing``). Each is imported when a run
builds it (the agent driver brings the HTTP server with it)."""

from __future__ import annotations

import grpo_core.train.actor.drivers as drivers
from grpo_core import hookimpl
from grpo_core.options import Options


class NoOptions(Options):
    """A built-in driver's options: none (the slot's ``name`` only)."""


def single_turn(options: NoOptions):
    """One completion per episode, G of each prompt from one generate call (the default)."""
    return drivers.SingleTurn(options)


def environment(options: NoOptions):
    """Model turns answered by an in-process environment (rollout.environment)."""
    return drivers.EnvironmentDriver(options)


def agent(options: NoOptions):
    """Agent programs run against the OpenAI-compatible endpoint the run serves (rollout.agent)."""
    return drivers.AgentDriver(options)


def routing(options: NoOptions):
    """Each row's episodes by the driver of the route its column names (rollout.routing)."""
    return drivers.RoutedDriver(options)


@hookimpl
def register_episode_drivers(register):
    register.add("single-turn", single_turn, options=NoOptions)
    register.add("environment", environment, options=NoOptions)
    register.add("agent", agent, options=NoOptions)
    register.add("routing", routing, options=NoOptions)
