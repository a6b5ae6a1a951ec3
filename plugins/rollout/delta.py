"""Delta weight pushes: only the elements that changed since the engine's copy, checksummed.

At reinforcement-learning learning rates most elements of a bfloat16 weight do not change in
a step (the issue that asked for this measured 1-3%); verl (``delta_sharded``), SkyRL, AReaL and
slime send only the changed ones. Here each tensor of a push is one :class:`TensorDelta`:

- ``full``: the whole tensor (the first push of a name, a new shape or dtype, or when the
  changed elements with their positions would take at least as many bytes as the tensor);
- else ``indices`` (flat positions, ``int32`` below 2**31 elements, else ``int64``) and
  ``values`` (the new elements there, in the tensor's dtype).

"Changed" is bitwise (:func:`bits`: the tensor's bytes viewed as integers), so ``-0.0``,
``+0.0`` and NaN payloads travel exactly and the receiver's copy becomes bitwise the sender's.
Every delta carries the :func:`checksum` of the whole new tensor; the receiver applies the
delta to its own copy (:func:`apply_delta`) and refuses the result when its checksum differs
(:class:`DeltaMismatch`, naming the tensor): a copy that drifted from the sender's belief (a
lost push, a corrupted element) is caught, never silently kept.

Pure torch, no vLLM: the learner's side (:class:`DeltaEncoder`) and the engine's side
(:class:`DeltaDecoder`) are the same few functions, unit-tested without an engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["DeltaDecoder", "DeltaEncoder", "DeltaMismatch", "PushTally", "TensorDelta", "apply_delta", "bits",
           "checksum", "make_delta", "push_stats"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = (1 << 63) - 1


class DeltaMismatch(RuntimeError):
    """A delta applied to the receiver's copy did not give the tensor the sender checksummed."""


def bits(t: Tensor) -> Tensor:
    """``t``'s elements as integers of the same width (flat): equal exactly when bitwise equal."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT[t.element_size()])


def checksum(t: Tensor) -> int:
    """A position-weighted sum of ``t``'s bit patterns (Fletcher-like, exact integer
    arithmetic in ``int64``, wrapping): ``sum(b_i) + sum((i + 1) * b_i)`` mixed, so that a
    changed element, or two elements swapped, changes it. Cheap on any device; not
    cryptographic (it guards against drift and corruption, not an adversary)."""
    b = bits(t).to(torch.int64)
    weights = torch.arange(1, b.numel() + 1, dtype=torch.int64, device=b.device)
    first = int(b.sum())
    second = int((b * weights).sum())
    return (first * 1_000_033 + second + b.numel()) & _MASK  # a prime that train/seeds.py's derivation does not use


@dataclasses.dataclass
class TensorDelta:
    """One tensor of a push: ``full`` (``values`` is the whole tensor), or the flat
    ``indices`` of the changed elements and their new ``values``; ``checksum`` is the whole
    new tensor's (:func:`checksum`)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    checksum: int
    values: Tensor
    indices: Tensor | None = None

    @property
    def full(self) -> bool:
        return self.indices is None

    @property
    def nbytes(self) -> int:
        """Bytes this entry sends (values and indices)."""
        sent = self.values.numel() * self.values.element_size()
        return sent + (0 if self.indices is None else self.indices.numel() * self.indices.element_size())


def make_delta(name: str, old: Tensor | None, new: Tensor) -> TensorDelta:
    """``new`` against the receiver's ``old`` (None: it has none): the changed elements, or
    the whole tensor when there is no comparable ``old`` or the delta would not be smaller."""
    new = new.detach()
    whole = TensorDelta(name, tuple(new.shape), new.dtype, checksum(new), new.contiguous())
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return whole
    changed = torch.nonzero(bits(old) != bits(new.to(old.device))).reshape(-1)
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    delta_bytes = changed.numel() * (new.element_size() + torch.empty((), dtype=index_dtype).element_size())
    if delta_bytes >= new.numel() * new.element_size():
        return whole
    changed = changed.to(new.device)
    values = new.contiguous().reshape(-1)[changed]
    return dataclasses.replace(whole, values=values, indices=changed.to(index_dtype))


def apply_delta(old: Tensor | None, delta: TensorDelta) -> Tensor:
    """The receiver's new tensor: ``delta.values`` when full, else a copy of ``old`` with the
    changed elements written; a :class:`DeltaMismatch` when its checksum is not the sender's."""
    if delta.full:
        new = delta.values.reshape(delta.shape)
    else:
        if old is None or tuple(old.shape) != delta.shape or old.dtype != delta.dtype:
            raise DeltaMismatch(f"weight delta for {delta.name}: the receiver holds no {delta.dtype} tensor of "
                                f"shape {list(delta.shape)} to apply it to (it needs a full push)")
        new = old.detach().clone()
        new.reshape(-1)[delta.indices.to(device=new.device, dtype=torch.int64)] = delta.values.to(new.device)
    got = checksum(new)
    if got != delta.checksum:
        raise DeltaMismatch(f"weight delta for {delta.name}: the receiver's tensor after the push has checksum "
                            f"{got}, the sender's {delta.checksum}: its copy had drifted from what the sender "
                            "believed it held; a full push is needed")
    return new


class DeltaEncoder:
    """The sender's belief of what the receiver holds (a copy of every tensor last sent)
    and the deltas of the next push against it. ``reset()`` forgets it: the next push is
    full (at start, after a resume, or after a failed push)."""

    def __init__(self) -> None:
        self.held: dict[str, Tensor] = {}

    def reset(self) -> None:
        self.held = {}

    def encode(self, weights: Iterable[tuple[str, Tensor]], full: bool = False) -> list[TensorDelta]:
        """The push of ``weights`` (``full``: every tensor whole); the copy is updated as if
        the receiver applied it, so call :meth:`reset` when a push does not arrive."""
        out = []
        for name, tensor in weights:
            delta = make_delta(name, None if full else self.held.get(name), tensor)
            out.append(delta)
            self.held[name] = tensor.detach().clone()
        return out


class DeltaDecoder:
    """The receiver's copy of every tensor in the sender's names and layout (what it applies
    deltas to), and the whole tensors of a push."""

    def __init__(self) -> None:
        self.held: dict[str, Tensor] = {}

    def decode(self, delta: TensorDelta) -> Tensor:
        """The whole new tensor of ``delta`` (checked), kept as this receiver's copy."""
        new = apply_delta(self.held.get(delta.name), delta)
        self.held[delta.name] = new.clone()  # the caller's tensor goes into the engine: never aliased
        return new


class PushTally:
    """:func:`push_stats` of a push sent in buckets, added bucket by bucket (it keeps counts,
    not the deltas)."""

    def __init__(self) -> None:
        self.sent = self.whole = self.tensors_whole = self.elements = self.changed = 0

    def add(self, deltas: Iterable[TensorDelta]) -> PushTally:
        for d in deltas:
            numel = int(torch.Size(d.shape).numel())
            self.sent += d.nbytes
            self.whole += numel * d.values.element_size()
            self.elements += numel
            self.changed += d.values.numel()
            self.tensors_whole += d.full
        return self

    def stats(self) -> dict[str, float]:
        return {"bytes": self.sent, "full_bytes": self.whole, "tensors_whole": self.tensors_whole,
                "elements_sent": self.changed / self.elements if self.elements else 0.0}


def push_stats(deltas: list[TensorDelta]) -> dict[str, float]:
    """Bytes sent by a push, bytes a full push would send, tensors sent whole, and the
    fraction of elements sent: what the backends log for each push."""
    return PushTally().add(deltas).stats()
