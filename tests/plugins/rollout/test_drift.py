"""A server's generation time followed call by call (``grpo_plugins.rollout.drift``): the figure
of a call, and the warning once per crossing of the bound. The same under real HTTP servers, one
slowed: tests/plugins/vllm/test_drift.py."""

from __future__ import annotations

import logging
import os
import re

import pytest
from grpo_plugins.rollout.drift import GenerationDrift, busy_seconds, decode_steps

URL = "http://127.0.0.1:8001"


def test_busy_seconds_counts_overlapping_requests_once():
    assert busy_seconds([]) == 0
    assert busy_seconds([(0.0, 2.0), (1.0, 3.0), (1.5, 2.5)]) == pytest.approx(3.0)
    assert busy_seconds([(5.0, 6.0), (0.0, 1.0), (0.5, 0.75)]) == pytest.approx(2.0)  # a gap (a push) is not counted


def test_decode_steps_are_the_longest_of_overlapping_requests_summed_over_sequential_ones():
    assert decode_steps([]) == 0
    assert decode_steps([(0.0, 2.0, 30), (1.0, 3.0, 50), (1.5, 2.5, 10)]) == 50  # all at once: the longest
    assert decode_steps([(0.0, 1.0, 30), (1.0, 2.0, 20)]) == 50  # one after the other: both
    assert decode_steps([(4.0, 5.0, 7), (0.0, 2.0, 30), (1.0, 3.0, 40)]) == 47  # two runs, in any order


def calls(drift: GenerationDrift, seconds: list[float], tokens: int = 100, url: str = URL) -> list[dict]:
    """One rollout call per entry: two concurrent requests to ``url`` lasting ``seconds`` in all,
    their longest completions ``tokens // 2`` and the rest (``tokens // 2`` decode steps for an
    even ``tokens``)."""
    out = []
    for i, s in enumerate(seconds):
        start = 10.0 * i
        drift.record(url, start, start + s, tokens // 2)
        drift.record(url, start + s / 4, start + s, tokens - tokens // 2)
        out.append(drift.close_call())
    return out


def test_a_call_figure_is_busy_seconds_over_decode_steps():
    drift = GenerationDrift("vllm-server", 2.0, 3)
    assert calls(drift, [1.5], tokens=300) == [{URL: pytest.approx(0.01)}]  # 1.5 s over 150 steps
    drift.record(URL, 0.0, 1.0, 0)  # no token generated (an aborted request at once): no figure
    assert drift.close_call() == {}


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_slowed_server_is_named_once_per_crossing(caplog):
    caplog.set_level(logging.INFO, logger="grpo.rollout.vllm-server")
    drift = GenerationDrift("vllm-server", 2.0, 3)
    calls(drift, [1.0, 1.1, 0.9, 1.0, 1.2, 1.9])  # early 1.0; recent 1.2: within 2x
    assert warnings_of(caplog) == []
    calls(drift, [2.6, 2.8])  # recent median 2.6 > 2 x 1.0
    (message,) = warnings_of(caplog)
    assert URL in message and "2.6x slower" in message
    assert "0.052 s per decode step over its last 3 rollout calls (median) against 0.02 s over its first 3" \
        in message
    assert "past the bound of 2x (rollout.drift_bound; 0 turns this warning off)" in message
    assert "restart it (grpo-run serve)" in message and "A server that slows down" in message
    assert re.search(rf"this process's machine: load average \d+\.\d on {os.cpu_count()} cores\)", message), message
    calls(drift, [3.0, 4.0, 5.0])  # still past: no second warning
    assert len(warnings_of(caplog)) == 1
    calls(drift, [1.0, 1.0])  # back within: said once, at info
    assert [r.getMessage() for r in caplog.records if "back within 2x" in r.getMessage()]
    calls(drift, [3.0, 3.0])  # a new crossing warns again
    assert len(warnings_of(caplog)) == 2


def test_servers_are_followed_apart_and_bound_zero_never_warns(caplog):
    drift = GenerationDrift("vllm-server", 2.0, 2)
    for slow in (1.0, 1.0, 5.0, 5.0):
        drift.record(URL, 0.0, slow, 100)
        drift.record("http://127.0.0.1:8002", 0.0, 1.0, 100)
        drift.close_call()
    assert len(warnings_of(caplog)) == 1 and URL in warnings_of(caplog)[0]
    off = GenerationDrift("vllm-server", 0.0, 2)
    calls(off, [1.0, 1.0, 50.0, 50.0, 50.0])
    assert len(warnings_of(caplog)) == 1


def test_completions_growing_shorter_at_the_same_speed_do_not_warn(caplog):
    """A policy learning to answer shorter: each batch takes as long as its longest completion,
    which stays, while the batch's total tokens fall 4x (what a soak on an idle machine saw, and a
    per-token figure called a 4x slowdown)."""
    drift = GenerationDrift("vllm-server", 2.0, 3)
    for call in range(12):
        short = 40 - 3 * call  # the other completions shrink from 40 to 7 tokens
        drift.record(URL, 0.0, 6.4, 64)  # the longest hits max_new_tokens in every batch
        for k in range(7):
            drift.record(URL, 0.0 + 0.01 * k, 6.4, short)
        assert drift.close_call() == {URL: pytest.approx(0.1)}
    assert warnings_of(caplog) == []
