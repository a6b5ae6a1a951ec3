"""``python -m grpo_core.cli``: the same as ``grpo-run``."""

from grpo_core.cli.app import _entry

_entry()
