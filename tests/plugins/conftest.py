"""Fixtures shared by the rollout backends' tests: the tiny tokenizer and three prompts of
different lengths (so a batch of them is left-padded unevenly); one torch thread is tests/conftest.py's."""

from __future__ import annotations

import pytest

from grpo_core.testing import build_tokenizer

RAGGED_TEXTS = ["What is 3 + 4?", "Hi", "Think step by step. What is 12 * 7? Answer:"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer(text)["input_ids"] for text in RAGGED_TEXTS]
    assert len({len(p) for p in ids}) == 3  # ragged: different left pads
    return ids
