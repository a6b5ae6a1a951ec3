"""The weight channel: a real gloo group of two members carries every tensor exactly; a process
without the channel's token cannot join it; an unknown backend is refused."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from grpo_plugins.vllm.channel import open_group, receive_tensors, send_tensors, update_info

from .conftest import free_port


def test_the_channel_carries_every_tensor_exactly():
    """A real gloo group of two members (the learner, rank 0, and one receiver), as a server's
    worker joins it: the payload describes the tensors, the receiver gets them bit for bit."""
    weights = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.arange(5, dtype=torch.float64)),
               ("c.idx", torch.tensor([1, 2], dtype=torch.int64)), ("d", torch.randn(2, 3).T)]
    info = update_info(weights)
    assert info == {"names": ["a.weight", "b.bias", "c.idx", "d"],
                    "dtype_names": ["float32", "float64", "int64", "float32"],
                    "shapes": [[3, 4], [5], [2], [3, 2]]}
    port, got, errors = free_port(), [], []

    def receiver():
        try:
            group = open_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=30, token="t0")
            got.extend(receive_tensors(group, json.loads(json.dumps(info)), "cpu"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=receiver)
    thread.start()
    group = open_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=30, token="t0")
    send_tensors(group, (t for _, t in weights))
    thread.join(30)
    assert not errors and not thread.is_alive()
    assert [n for n, _ in got] == info["names"]
    for (_, sent), (_, received) in zip(weights, got, strict=True):
        assert received.dtype == sent.dtype and torch.equal(received, sent)


def test_the_channel_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of gloo, nccl, got 'mpi'"):
        open_group("127.0.0.1", 1, 0, 2, "mpi")


def test_a_member_without_the_channels_token_cannot_take_a_place_in_it():
    """The learner's store is reachable by anyone who reaches its port; the group's keys carry
    the token the server got through its guarded route. A process with another token (or none)
    does not complete the group: both sides time out, nothing is sent to it."""
    port, errors = free_port(), []

    def intruder():
        try:
            open_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=3, token="guess")
        except BaseException as exc:  # expected: it never meets rank 0
            errors.append(exc)

    thread = threading.Thread(target=intruder)
    thread.start()
    with pytest.raises(Exception, match="(?i)timeout|timed out"):
        open_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=3, token="0f3a")
    thread.join(30)
    assert not thread.is_alive() and errors
