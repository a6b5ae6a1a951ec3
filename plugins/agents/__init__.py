"""Agents that run environments of other libraries through the agent endpoint:
:mod:`~grpo_plugins.agents.openenv`, an OpenEnv environment's episode as a chat with the policy
(``openenv_agent``), and :mod:`~grpo_plugins.agents.verifiers`, a verifiers environment's rollout
(``verifiers_agent``; registered as the ``verifiers`` agent and dataset, by environment id).
"""

from grpo_plugins.agents.openenv import openenv_agent
from grpo_plugins.agents.verifiers import verifiers_agent

__all__ = ["openenv_agent", "verifiers_agent"]
