"""The built-in episode drivers (:class:`~grpo_core.contracts.EpisodeDriver`): ``single-turn``,
``environment``, ``agent`` and ``routing``, the engine's own
(:mod:`grpo_core.train.actor.drivers`), registered here as a third party's driver would be.
Each takes no options of its own: what it runs is the spec's episode source
(``rollout.environment``, ``rollout.agent``, ``rollout.routing``)."""

from __future__ import annotations

from grpo_core import hookimpl
from grpo_core.options import Options
from grpo_core.train.actor.drivers import AgentDriver, EnvironmentDriver, RoutedDriver, SingleTurn


class NoOptions(Options):
    """A built-in driver's options: none (the slot's ``name`` only)."""


@hookimpl
def register_episode_drivers(register):
    register.add("single-turn", SingleTurn, options=NoOptions)
    register.add("environment", EnvironmentDriver, options=NoOptions)
    register.add("agent", AgentDriver, options=NoOptions)
    register.add("routing", RoutedDriver, options=NoOptions)
