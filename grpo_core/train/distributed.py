"""Data-parallel runs: one process per device, each holding the whole model (ddp) or a
shard of it (fsdp2, :mod:`grpo_core.train.learner.sharding`).

:class:`Dist` is the process group as the engine uses it (sharding of a step's groups,
sums of normalizers, gathers, combined metrics); the README's "Several processes" section
says what ``N`` processes do together. How the learner's gradients are summed is its
parallel strategy's (:mod:`grpo_core.train.learner.parallel`: ``DistributedDataParallel`` during
backward; ``bench/ddp_overlap.py`` measures the gain over :meth:`Dist.sum_grads` after it).
:func:`parallel_from_launcher` reads an accelerate FSDP config.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from grpo_core.errors import RunError, SpecError

T = TypeVar("T")

#: How :meth:`Dist.combine_metrics` combines a metric over processes, by exact name.
#: A name not listed is a maximum if it ends in ``/max``, a minimum if it ends in ``/min``,
#: a maximum if it starts with ``time/`` (the slowest process sets the pace), a sum if it ends
#: in ``/rows`` or starts with ``data/source/`` (counts), else a mean.
REDUCTIONS: dict[str, str] = {
    "reward/failed": "sum",
    "perf/tokens_per_second": "sum",
    "completions/max_length": "max",
    "completions/min_length": "min",
    "advantage/abs_max": "max",
    # dynamic sampling: each process counts its own groups
    "dynamic_sampling/groups_kept": "sum",
    "dynamic_sampling/groups_filled": "sum",
    "dynamic_sampling/groups_dropped": "sum",
    "dynamic_sampling/prompts_consumed": "sum",
}

_REDUCE = {"sum": sum, "max": max, "min": min, "mean": lambda values: sum(values) / len(values)}


def reduction(name: str) -> str:
    """The reduction of metric ``name`` over processes: ``sum``, ``max``, ``min`` or ``mean``."""
    if name in REDUCTIONS:
        return REDUCTIONS[name]
    if name.endswith("/rows") or name.startswith("data/source/"):  # counts of this process's rows, prompts
        return "sum"
    if name.endswith("/max") or name.startswith("time/"):
        return "max"
    if name.endswith("/min"):
        return "min"
    return "mean"


def combine_metrics(every: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from each process's ``every``: each metric reduced as :func:`reduction`
    says, except that a mean with a ``<name>/rows`` count beside it on every process is weighted
    by those counts (a per-source reward mean over processes holding other numbers of its rows)."""
    out = {}
    for key in sorted({k for m in every for k in m}):
        found = [m for m in every if key in m]
        weights = [float(m[key + "/rows"]) for m in found if key + "/rows" in m]
        if reduction(key) == "mean" and len(weights) == len(found) and sum(weights) > 0:
            out[key] = sum(float(m[key]) * w for m, w in zip(found, weights)) / sum(weights)
        else:
            out[key] = float(_REDUCE[reduction(key)]([float(m[key]) for m in found]))
    return out


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


@dataclass
class Dist:
    """The process group as the engine uses it; ``Dist()`` is the single-process case."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None  # the process group of the collectives (None: the default one)
    timeout_s: float = 1800.0  # the longest wait of one collective (train.parallel.timeout_s)

    @classmethod
    def from_env(cls, device: str = "auto", timeout_s: float = 1800.0) -> Dist:
        """Join the process group set up by the launcher, if any, and pick the device:
        ``auto`` is this process's GPU when CUDA is available, else the CPU. Joining, and
        every collective after it, waits at most ``timeout_s`` for the other processes."""
        cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        if device == "cuda" and not torch.cuda.is_available():
            raise RunError("train.device is 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
        if world_size_from_env() <= 1:
            return cls(0, 1, torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device()),
                       timeout_s=timeout_s)
        from accelerate import PartialState

        try:
            state = PartialState(cpu=cpu, timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            if not lost_contact(exc):
                raise
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise RunError(
                f"could not join the process group at {where} (MASTER_ADDR:MASTER_PORT) within "
                f"train.parallel.timeout_s = {timeout_s:g} s: {' '.join(str(exc).split())[:300]}"
            ) from exc
        global _JOINED
        _JOINED = True
        return cls(state.process_index, state.num_processes, torch.device(state.device), timeout_s=timeout_s)

    # ----------------------------------------------------------------- queries
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def shard_bounds(self, count: int, what: str = "train.prompts_per_step") -> tuple[int, int]:
        """``[start, stop)`` of this process's contiguous share of ``count`` items."""
        if count % self.world:
            raise RunError(
                f"{what} = {count} is not a multiple of the {self.world} processes; groups "
                f"are not split between processes, so use a multiple of {self.world}"
            )
        per = count // self.world
        return self.rank * per, (self.rank + 1) * per

    # ----------------------------------------------------------------- collectives
    def _dist(self):
        import torch.distributed as dist

        return dist

    def barrier(self) -> None:
        if self.active:
            self._dist().barrier(group=self.group)

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over processes (float64, so token counts stay exact)."""
        if not self.active:
            return [float(v) for v in values]
        buf = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device())
        self._dist().all_reduce(buf, group=self.group)
        return buf.tolist()

    def any(self, flag: bool) -> bool:
        return self.sum_floats([1.0 if flag else 0.0])[0] > 0

    def gather(self, obj: T) -> list[T]:
        """``obj`` of every process, in rank order (pickled; for small objects)."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        self._dist().all_gather_object(out, obj, group=self.group)
        return out

    def sum_grads(self, params: Sequence[Tensor]) -> None:
        """Sum ``.grad`` over processes, in place, with one flat all-reduce per dtype."""
        if not self.active:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._dist().all_reduce(flat, group=self.group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()

    def _comm_device(self) -> torch.device:
        # NCCL reduces CUDA tensors only; gloo CPU ones.
        if self.group is not None and self._dist().get_backend(self.group) == "gloo":
            return torch.device("cpu")
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def side_group(self) -> Dist:
        """This process group's processes in a group of their own (gloo), for collectives made
        from another thread while the default group's run in this one (an asynchronous actor's
        beside the learner's). Every process must call it, in the same order."""
        if not self.active:
            return self
        group = self._dist().new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return Dist(self.rank, self.world, self.device, group=group, timeout_s=self.timeout_s)

    def combine_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """One metrics dict from every process's, each metric reduced as :func:`reduction` says."""
        if not self.active:
            return metrics
        return combine_metrics(self.gather(metrics))


#: Whether this process joined the launcher's process group (:meth:`Dist.from_env`): the only
#: default group :func:`close_process_group` destroys. A one-process run's colocated vLLM
#: engine makes a default group of its own, which its shutdown destroys after its subgroups.
_JOINED = False


def close_process_group() -> None:
    """Destroy the default process group, if this process joined one (:meth:`Dist.from_env`),
    once every process is done with it (the barrier: no process leaves while another still
    talks to it). A group made by someone else (a colocated vLLM engine's) is left to its
    owner. A gloo group wrapped by ``DistributedDataParallel`` keeps its threads past this, so
    a finished process of a multi-process run then leaves without interpreter finalization
    (:func:`grpo_core.cli.exit_process`)."""
    import torch.distributed as dist

    if _JOINED and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


#: Words of the errors gloo and NCCL raise when a collective fails (plain RuntimeErrors in
#: PyTorch 2.13 for gloo: ``.../gloo/transport/tcp/unbound_buffer.cc: Timed out waiting ...``,
#: ``Connection closed by peer``); torch's own are :class:`torch.distributed.DistError`.
_COLLECTIVE_ERRORS = ("gloo/transport", "Gloo ", "NCCL", "ProcessGroup")


def lost_contact(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective of the process group that failed: another process of
    the run gone, or unreachable (a node down, a cut link), or not answering within
    ``train.parallel.timeout_s``."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc) for word in _COLLECTIVE_ERRORS)


def lost_contact_message(exc: BaseException, timeout_s: float) -> str:
    """What a process says when :func:`lost_contact` is true of ``exc``."""
    detail = " ".join(str(exc).split())
    if len(detail) > 300:
        detail = detail[:300] + "..."
    return (
        f"lost contact with another process of the run: a collective of the process group failed ({detail}). "
        f"A process died, or its node is down or unreachable; each wait is bounded by "
        f"train.parallel.timeout_s = {timeout_s:g} s. Once every node is back, resume with --resume"
    )


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    return {"true": True, "false": False}.get(value)


def parallel_from_launcher(parallel):
    """The spec's ``train.parallel`` as the launcher's accelerate config, if any, sets it.

    ``accelerate launch`` passes its config to the processes in environment variables:
    ``distributed_type: FSDP`` with ``fsdp_version: 2`` selects ``strategy: fsdp2``, and its
    ``fsdp_reshard_after_forward`` / ``fsdp_offload_params`` override the spec's
    ``reshard_after_forward`` / ``offload``. FSDP version 1 and DeepSpeed are refused."""
    how = ("grpo-core shards with PyTorch FSDP2: set train.parallel.strategy: fsdp2 in the spec "
           "(with distributed_type MULTI_GPU), or distributed_type FSDP with fsdp_version: 2")
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        raise RunError(f"accelerate is configured for DeepSpeed, which grpo-core does not run; {how}")
    if not _env_flag("ACCELERATE_USE_FSDP"):
        return parallel
    version = os.environ.get("FSDP_VERSION", "1").strip()
    if version != "2":
        raise RunError(f"accelerate is configured for FSDP version {version}; {how}")
    update: dict[str, Any] = {"strategy": "fsdp2"}
    for key, variable in (("reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD"), ("offload", "FSDP_OFFLOAD_PARAMS")):
        if _env_flag(variable) is not None:
            update[key] = _env_flag(variable)
    return parallel.model_copy(update=update)


def check_layout(spec, world: int) -> None:
    """Refuse, before anything loads, a spec that cannot run on ``world`` processes."""
    if world <= 1:
        return
    from grpo_core.spec.resolved import world_problems

    problems = world_problems(spec, world)
    if problems:  # the spec asks what this many processes cannot do: a spec error, before anything starts
        raise SpecError(problems)
    Dist(0, world).shard_bounds(spec.train.prompts_per_step)
    if spec.iterative is not None:
        raise RunError(
            f"iterative: iterative GRPO runs in one process for now ({world} were asked for); "
            "run it without accelerate launch / --nproc"
        )
    local = spec.train.prompts_per_step // world
    if local % spec.train.mini_batches:
        raise RunError(
            f"train.mini_batches = {spec.train.mini_batches} must divide the {local} prompts each of the "
            f"{world} processes holds (train.prompts_per_step / processes)"
        )


def pad_cat(tensors: Sequence[Tensor], value: float | bool | int = 0) -> Tensor:
    """Concatenate along dim 0, padding dim 1 (if any) on the right to the widest."""
    if tensors[0].dim() < 2:
        return torch.cat(list(tensors))
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        if t.shape[1] < width:
            pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype, device=t.device)
            t = torch.cat([t, pad], dim=1)
        padded.append(t)
    return torch.cat(padded)
