"""What the reward tests share (imported as ``from .conftest import ...``)."""

from __future__ import annotations


def chat(text: str) -> list[dict[str, str]]:
    """A completion in TRL's conversational form."""
    return [{"role": "assistant", "content": text}]
