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
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["BACKENDS", "open_group", "receive_tensors", "send_tensors", "update_info"]

#: torch.distributed backends the channel can use: gloo (CPU tensors), nccl (CUDA tensors).
BACKENDS = ("gloo", "nccl")
_PREFIX = "grpo-weights"


def open_group(
    host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300.0,
    token: str = "",
) -> Any:
    """A process group of ``world_size`` members over a ``TCPStore`` at ``host:port``
    (rank 0 hosts the store and blocks until every member has joined, at most
    ``timeout_s``). Not registered as the default group: collectives go through the
    returned object. ``backend``: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors, on the
    current CUDA device; written for GPUs and not run on this project's CPU test machine).
    ``token``: the channel's own prefix of keys in the store (the same on every member)."""
    if backend not in BACKENDS:
        raise ValueError(f"weight channel: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
    store = dist.PrefixStore(f"{_PREFIX}/{token}" if token else _PREFIX, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


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
