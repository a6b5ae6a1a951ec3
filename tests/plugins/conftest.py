"""Fixtures shared by the rollout backends' tests: one torch thread, the tiny tokenizer and
three prompts of different lengths (so a batch of them is left-padded unevenly)."""

from __future__ import annotations

import pytest
import torch

from grpo_core.testing import build_tokenizer

RAGGED_TEXTS = ["What is 3 + 4?", "Hi", "Think step by step. What is 12 * 7? Answer:"]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: intra-op threads only add synchronisation; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer(text)["input_ids"] for text in RAGGED_TEXTS]
    assert len({len(p) for p in ids}) == 3  # ragged: different left pads
    return ids
