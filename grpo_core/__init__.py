"""grpo-core: Group Relative Policy Optimization as a small engine plus plugins."""

from grpo_core.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]
