"""Built-in plugins of grpo-core, installed as the ``grpo_plugins`` package.

Each module is one plugin registered on the same plugin manager as third-party ones
(see ``grpo_core.plugin_manager.DEFAULT_PLUGINS``).
"""
