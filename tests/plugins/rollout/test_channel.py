"""The weight channel: a real gloo group of two members carries every tensor exactly, on the
interface of the route to the store or on the one ``GLOO_SOCKET_IFNAME`` names; a process
without the channel's token cannot join it; an unknown backend is refused. Across network
hosts: ``tests/multihost/test_weight_channel.py``."""

from __future__ import annotations

import json
import socket
import threading

import pytest
import torch
from grpo_plugins.rollout.channel import (
    delta_info,
    gloo_devices,
    local_address,
    open_group,
    receive_deltas,
    receive_tensors,
    send_deltas,
    send_tensors,
    update_info,
)
from grpo_plugins.rollout.delta import DeltaDecoder, DeltaEncoder, bits


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("interface", [None, "lo"])
def test_the_channel_carries_every_tensor_exactly(monkeypatch, interface):
    """A real gloo group of two members (the learner, rank 0, and one receiver), as a server's
    worker joins it: the payload describes the tensors, the receiver gets them bit for bit."""
    if interface is not None:  # as a user names the interface of the link between the machines
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)
    else:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
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


def test_delta_pushes_over_the_channel_leave_the_receiver_bitwise_on_the_senders_weights():
    """Three pushes over a real gloo group: the first whole, the next two only the changed
    elements (a JSON round trip of the payload, as vLLM's route carries it); the receiver's
    rebuilt tensors are bitwise the sender's after each."""
    gen = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(40, 30, generator=gen).to(torch.bfloat16), "b.bias": torch.randn(7)}
    pushes = []
    encoder = DeltaEncoder()
    for step in range(3):
        if step:  # new tensors, as each step's cast weights are (the pushes are sent after all three)
            weights = {n: t.clone() for n, t in weights.items()}
            weights["a.weight"].view(-1)[[5, 77, 1100]] += 1.0
        pushes.append(([(n, t.clone()) for n, t in weights.items()], encoder.encode(weights.items())))
    assert [d.full for d in pushes[0][1]] == [True, True] and [d.full for d in pushes[1][1]] == [False, False]
    assert pushes[1][1][0].indices.tolist() == [5, 77, 1100] and pushes[1][1][1].values.numel() == 0
    port, got, errors = free_port(), [], []
    infos = [json.loads(json.dumps(delta_info(deltas))) for _, deltas in pushes]

    def receiver():
        try:
            group, decoder = open_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=30, token="t1"), DeltaDecoder()
            for info in infos:
                got.append({d.name: decoder.decode(d) for d in receive_deltas(group, info, "cpu")})
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=receiver)
    thread.start()
    group = open_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=30, token="t1")
    for _, deltas in pushes:
        send_deltas(group, deltas)
    thread.join(30)
    assert not errors and not thread.is_alive(), errors
    for (sent, _), received in zip(pushes, got, strict=True):
        for name, tensor in sent:
            assert torch.equal(bits(received[name]), bits(tensor)) and received[name].shape == tensor.shape


def test_the_channel_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of gloo, nccl, got 'mpi'"):
        open_group("127.0.0.1", 1, 0, 2, "mpi")


def test_the_address_advertised_is_the_one_on_the_route_to_the_peer(monkeypatch):
    """The route to this machine itself is loopback (tests/multihost checks a peer on another
    host: the address of the interface toward it)."""
    assert local_address("127.0.0.1") == "127.0.0.1"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert len(gloo_devices("127.0.0.1")) == 1
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")
    assert len(gloo_devices("127.0.0.1")) == 2  # one device per interface named, as torch's own groups


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
