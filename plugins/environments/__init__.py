"""Built-in environments for multi-turn rollouts: ``tools``, function calling with plain Python
functions (:mod:`~grpo_plugins.environments.tools`, which also registers the ``env_reward`` and
``tool_success`` rewards), and its built-in ``calculator`` tool
(:mod:`~grpo_plugins.environments.calculator`).

What a plugin needs to ship tools of its own is exported here:
``from grpo_plugins.environments import ToolsOptions, tools_environment``.
"""

from grpo_plugins.environments.tools import ToolsOptions, tools_environment

__all__ = ["ToolsOptions", "tools_environment"]
