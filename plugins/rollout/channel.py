"""The channel that carries the policy's weights from the learner to a rollout server: a
``torch.distributed`` process group of its own (gloo on the CPU, NCCL on GPUs), made from
PyTorch's ``TCPStore`` without touching the default process group, so a data-parallel or
FSDP2 learner keeps its own group and one learner can hold one channel per server.

Both ends call :func:`open_group` with the same arguments except ``rank``: the learner is
rank 0 and hosts the store; the server's vLLM workers are ranks ``1 .. world_size - 1``
(one per tensor-parallel worker). The group's keys in the store are prefixed with a random
``token`` the learner makes for each channel and hands the server through its (secret-guarded)
``/init_weight_transfer_engine`` route: a process that reaches the store's port without it
cannot take a member's place in the group. What is sent each push is described by
:func:`update_info` (names, dtypes, shapes: the payload of vLLM's ``/update_weights``),
then every tensor is broadcast from rank 0 in that order (:func:`send_tensors`,
:func:`receive_tensors`). Plain PyTorch only: the learner needs no vLLM for it.

Off one machine, each member binds gloo to the address of its interface on the route to the
store's host (:func:`local_address`), not to whatever its hostname resolves to (often
``127.0.0.1`` or ``127.0.1.1``, which a member on another machine cannot reach);
``GLOO_SOCKET_IFNAME`` names the interface instead, as for PyTorch's own groups. The store
listens on ``port`` on every interface of rank 0's machine; the gloo connections between
members use ephemeral ports (a firewall between the machines must let both through).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from grpo_plugins.rollout.delta import TensorDelta
from torch import Tensor

__all__ = ["BACKENDS", "delta_info", "gloo_devices", "local_address", "open_group", "receive_deltas", "receive_tensors",
           "send_deltas", "send_tensors", "update_info"]

#: torch.distributed backends the channel can use: gloo (CPU tensors), nccl (CUDA tensors).
BACKENDS = ("gloo", "nccl")
_PREFIX = "grpo-weights"


def open_group(
    host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300.0,
    token: str = "",
) -> Any:
    """A process group of ``world_size`` members over a ``TCPStore`` at ``host:port``
    (rank 0 hosts the store and blocks until every member has joined, at most
    ``timeout_s``; every later collective waits at most ``timeout_s`` too). Not registered
    as the default group: collectives go through the returned object. ``backend``: ``gloo``
    (CPU tensors, on :func:`gloo_devices`) or ``nccl`` (CUDA tensors, on the current CUDA
    device; ``NCCL_SOCKET_IFNAME`` picks its interface; written for GPUs and not run on this
    project's CPU test machine). ``token``: the channel's own prefix of keys in the store
    (the same on every member)."""
    if backend not in BACKENDS:
        raise ValueError(f"weight channel: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
    store = dist.PrefixStore(f"{_PREFIX}/{token}" if token else _PREFIX, store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = gloo_devices(host)
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def local_address(peer: str) -> str:
    """This machine's address on the route to ``peer`` (a host name or address): what a
    process there can reach this one at. No packet is sent; ``127.0.0.1`` when there is no
    route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((peer, 9))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def gloo_devices(peer: str) -> list:
    """The gloo devices (interfaces) of a group whose store is at ``peer``: those named by
    ``GLOO_SOCKET_IFNAME`` (comma-separated) when it is set, else the one holding this
    machine's address on the route to ``peer``. PyTorch's default device is the address
    the hostname resolves to, which on many machines is a loopback address."""
    import torch.distributed as dist

    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()]
    if names:
        return [dist.ProcessGroupGloo.create_device(interface=n.strip()) for n in names]
    return [dist.ProcessGroupGloo.create_device(hostname=local_address(peer))]


def update_info(weights: Iterable[tuple[str, Tensor]]) -> dict[str, list]:
    """vLLM's weight-update payload for ``weights``: ``{"names", "dtype_names", "shapes"}``
    (dtype names as ``torch`` spells them, e.g. ``float32``), in the order they are sent."""
    names, dtypes, shapes = [], [], []
    for name, tensor in weights:
        names.append(name)
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        shapes.append(list(tensor.shape))
    return {"names": names, "dtype_names": dtypes, "shapes": shapes}


def send_tensors(group: Any, tensors: Iterable[Tensor]) -> None:
    """Broadcast each of ``tensors`` from rank 0 (this process) to the group, in order."""
    for tensor in tensors:
        group.broadcast(tensor.contiguous(), 0).wait()


def receive_tensors(group: Any, info: dict[str, list], device: torch.device | str) -> Iterator[tuple[str, Tensor]]:
    """The tensors rank 0 broadcasts for the payload ``info``, as ``(name, tensor)`` on
    ``device``, received one at a time (a receiver holds one tensor beyond its model)."""
    for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        group.broadcast(tensor, 0).wait()
        yield name, tensor


# --------------------------------------------------------------------------- delta pushes
def delta_info(deltas: Iterable[TensorDelta]) -> dict[str, list]:
    """The payload of a delta push (:mod:`grpo_plugins.rollout.delta`): :func:`update_info`'s
    ``names``, ``dtype_names`` and ``shapes`` (of the whole tensors), plus per tensor its
    ``counts`` (changed elements sent; -1: sent whole), ``index_dtypes`` and ``checksums``."""
    deltas = list(deltas)
    info = update_info((d.name, torch.empty(d.shape, dtype=d.dtype, device="meta")) for d in deltas)
    info["counts"] = [-1 if d.full else int(d.values.numel()) for d in deltas]
    info["index_dtypes"] = ["" if d.full else str(d.indices.dtype).removeprefix("torch.") for d in deltas]
    info["checksums"] = [int(d.checksum) for d in deltas]
    return info


def send_deltas(group: Any, deltas: Iterable[TensorDelta]) -> None:
    """Broadcast each delta from rank 0: the whole tensor, or its indices then its values;
    nothing for a tensor with no element to send (both sides know it from the payload)."""
    for d in deltas:
        if d.values.numel() == 0:
            continue
        if not d.full:
            group.broadcast(d.indices.contiguous(), 0).wait()
        group.broadcast(d.values.contiguous(), 0).wait()


def receive_deltas(group: Any, info: dict[str, list], device: torch.device | str) -> Iterator[TensorDelta]:
    """The deltas rank 0 broadcasts for the payload ``info`` (:func:`delta_info`), one at a time."""
    rows = zip(info["names"], info["dtype_names"], info["shapes"], info["counts"], info["index_dtypes"],
               info["checksums"], strict=True)
    for name, dtype, shape, count, index_dtype, check in rows:
        indices = None
        if count >= 0:
            indices = torch.empty(count, dtype=getattr(torch, index_dtype), device=device)
        values = torch.empty(shape if indices is None else [count], dtype=getattr(torch, dtype), device=device)
        if values.numel():
            if indices is not None:
                group.broadcast(indices, 0).wait()
            group.broadcast(values, 0).wait()
        yield TensorDelta(name, tuple(shape), getattr(torch, dtype), int(check), values, indices)
