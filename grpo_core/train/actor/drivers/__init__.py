"""The episode drivers: how a prompt's ``G`` episodes run, each behind the one
:class:`~grpo_core.contracts.EpisodeDriver` contract, chosen by name from the registry
(``rollout.driver``; the built-in ``drivers`` plugin module, plugins/drivers.py, registers these).

- ``single_turn``: ``single-turn``, one completion per episode (the default).
- ``environment``: ``environment``, model turns answered by an in-process environment.
- ``agents``: ``agent``, episodes driven by agent programs over the endpoint
  (:mod:`grpo_core.endpoint`).
- ``routes``: ``routing``, each row's episodes by its route's driver (``rollout.routing``).
- ``episodes``: what the multi-turn drivers share: an episode's record, observations rendered as
  tokens, tools in prompts, the batch of a rollout's episodes and their ``env/`` metrics.
- ``histories``: agent histories that are not append-only, split into training samples.
- ``agent_tasks``: the agent programs run in an event loop of their own, each failure its episode's.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The built-in drivers' classes, by the module that holds each (imported on first use: the
#: agent driver brings the HTTP server with it). The public surface a plugin registers them
#: from (the built-in ``drivers`` plugin module), or wraps one of them with.
BUILT_IN = {"SingleTurn": "single_turn", "EnvironmentDriver": "environment", "AgentDriver": "agents",
            "RoutedDriver": "routes"}

__all__ = list(BUILT_IN)


def __getattr__(name: str) -> Any:
    if name not in BUILT_IN:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{BUILT_IN[name]}"), name)
