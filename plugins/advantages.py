"""Built-in plugin (placeholder until implemented)."""

from grpo_core import hookimpl  # noqa: F401
