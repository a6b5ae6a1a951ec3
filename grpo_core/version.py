"""The version of grpo-core, in a module of its own so that the engine reads it without
importing the package's front (which makes ``Trainer`` reachable)."""

__version__ = "0.1.0"
