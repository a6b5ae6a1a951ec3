"""Agents that run environments of other libraries through the agent endpoint:
:mod:`~grpo_plugins.agents.openenv`, an OpenEnv environment's episode as a chat with the policy
(``openenv_agent``).
"""

from grpo_plugins.agents.openenv import openenv_agent

__all__ = ["openenv_agent"]
