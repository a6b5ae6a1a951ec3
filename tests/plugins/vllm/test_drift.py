"""A rollout server whose generation slows down as the run goes on is named in the log (issue 60,
item 5), and a steady one is not: the real ``vllm-server`` backend against two imitation
``grpo-run serve`` servers on 127.0.0.1 (``FakeServe``), one of which starts taking eight times as
long per request after its fourth. The figures themselves: tests/plugins/rollout/test_drift.py."""

from __future__ import annotations

import logging
import time

import pytest
from grpo_plugins.vllm.server import VLLMServerOptions
from pydantic import ValidationError

from grpo_core.contracts import SamplingParams

from .conftest import good_answer
from .test_answers import rollout_on

SAMPLING = SamplingParams(max_new_tokens=4, seed=5)


def sleeping(seconds):
    """A handler answering :func:`good_answer` after ``seconds(n)`` seconds, ``n`` counting its requests."""
    asked = [0]

    def handle(handler, body):
        asked[0] += 1
        time.sleep(seconds(asked[0]))
        handler.reply(200, good_answer(body))

    return handle


def test_a_slowed_server_is_named_once_and_a_steady_one_never(serve, model, tokenizer, caplog):
    steady = serve(sleeping(lambda n: 0.1))
    slowed = serve(sleeping(lambda n: 0.1 if n <= 4 else 0.8))
    rollout = rollout_on([steady.url, slowed.url], model, tokenizer, drift_bound=3, drift_window=3)
    caplog.set_level(logging.WARNING, logger="grpo.rollout.vllm-server")
    for _ in range(8):  # one prompt to each server a call; the slowed one's 5th request on is 8x slower
        batch = rollout.generate([[5, 6, 7], [8, 9]], 2, SAMPLING)
        assert batch.completion_ids.shape == (4, 4)
    warned = [r.getMessage() for r in caplog.records if "slower than at the start of the run" in r.getMessage()]
    assert len(warned) == 1, warned
    assert slowed.url in warned[0] and steady.url not in warned[0]
    assert "rollout.drift_bound" in warned[0] and "past the bound of 3x" in warned[0]
    assert steady.completions_asked() == slowed.completions_asked() == 8  # warned, not dropped


def test_drift_bound_is_zero_or_a_factor_above_one():
    assert VLLMServerOptions(urls=["http://a:1"]).drift_bound == 2.0
    assert VLLMServerOptions(urls=["http://a:1"], drift_bound=0).drift_bound == 0
    with pytest.raises(ValidationError) as info:
        VLLMServerOptions(urls=["http://a:1"], drift_bound=0.5)
    (error,) = info.value.errors()
    assert error["loc"] == ("drift_bound",)
    assert "a factor above 1" in error["msg"] and "or 0 for no check; got 0.5" in error["msg"]
