"""How the learner's processes share a step: one strategy object per run.

The update (:mod:`grpo_core.train.learner.update`) is written as single-process math; everything
that several processes change about it is a method of the run's strategy:

- ``setup``: wrap or shard the policy (and the KL reference copy) before the optimizer
  is made, so that the optimizer holds what the strategy trains;
- ``forward(model)``: the log-prob function of a model (the policy, the reference): the
  module that carries the strategy's collectives, or the plain computation;
- ``total`` / ``gather``: sums and gathers of small values over processes (normalizers,
  losses, metrics);
- ``lockstep``: how many zero-gradient passes a process adds so that every process takes
  part in each collective of a mini-batch, and whether they encode prompts once;
- ``no_grad_passes``: how many unused no-grad forwards a process adds so that every process
  makes as many calls to a sharded model (old, reference log-probs) as the one with most;
- ``interleave``: where a process's passes fall among those its sequence-parallel group
  makes together (None: a pass of another member's that it joins);
- ``grad_sync``: the context of one micro-batch's backward (DDP sums only on the last);
- ``rollout_weights``: the context of a rollout phase (FSDP2 gathers the policy for a
  backend that generates with it);
- ``model_state`` / ``optimizer_state``: what a gathered checkpoint writes, and
  ``load_model_state`` / ``load_optimizer_state``: how a resumed run reads it back (a sharded
  checkpoint is the same under every strategy: :func:`grpo_core.train.learner.sharding.save_shards`).

Strategies: :class:`OneProcess` (one process), :class:`DDP` (every process holds the whole
model; gradients summed by ``DistributedDataParallel`` during backward) and :class:`FSDP2`
(each process holds ``1/N`` of every unit, :mod:`grpo_core.train.learner.sharding`). The
one-process strategy is the base: ``DDP`` and ``FSDP2`` override what several processes
change, so :data:`Strategy` (any of them) is its type. With ``train.parallel.sequence: N > 1``
either one also splits each sequence over groups of ``N`` processes
(:class:`SequenceDDP`, :class:`SequenceFSDP2`: :mod:`grpo_core.train.learner.sequence_parallel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import torch
from torch import nn

from grpo_core.train.distributed import Dist
from grpo_core.train.learner import sharding
from grpo_core.train.learner.logprobs import completion_logprobs
from grpo_core.train.learner.sequence_parallel import SplitSequences

T = TypeVar("T")

#: ``forward(prompt_ids, prompt_mask, completion_ids, completion_mask, *, with_entropy,
#: temperature, share_prompt, packed=False, prompt_index=None) -> (logp, entropy)``: the
#: log-prob function of one model.
Forward = Callable[..., Any]


def forward_of(model: Any) -> Forward:
    """The log-prob function of ``model`` in one process:
    :func:`~grpo_core.train.learner.logprobs.completion_logprobs` of it."""
    return partial(completion_logprobs, model)


class OneProcess:
    """One process: the model itself, nothing to sum, gather or pad."""

    name = "single"
    #: Whether weights and optimizer state are DTensor shards (checkpoints gather them).
    sharded = False

    def __init__(self, dist: Dist | None = None, parallel: Any = None):
        self.dist = dist or Dist()
        self._roots: dict[int, tuple[Any, nn.Module]] = {}  # id(model) -> (model, the module that runs it)
        self._policy: Any = None  # the model setup() wrapped or sharded
        # the log-prob function, completion_logprobs's signature: (model, prompt_ids, ...) -> (logp, entropy)
        self.logprobs: Callable[..., Any] = completion_logprobs

    # ----------------------------------------------------------------- before training
    def setup(self, model: nn.Module, reference: nn.Module | None = None) -> None:
        """Wrap or shard ``model`` (and ``reference``) in place; before the optimizer is made."""

    def _register(self, model: Any, root: nn.Module) -> None:
        self._roots[id(model)] = (model, root)

    # ----------------------------------------------------------------- the update
    def forward(self, model: Any) -> Forward:
        """The log-prob function of ``model`` (the policy, or the KL's reference)."""
        entry = self._roots.get(id(model))
        return entry[1] if entry is not None and entry[0] is model else partial(self.logprobs, model)

    def total(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over processes (float64: token counts stay exact)."""
        return self.dist.sum_floats(values)

    def gather(self, obj: T) -> list[T]:
        """``obj`` of every process, in rank order."""
        return self.dist.gather(obj)

    def lockstep(self, passes: int, shareable: bool, idle: Callable[[int, bool], None]) -> bool:
        """Before a mini-batch's ``passes`` forward/backward passes (``shareable``: each of
        them can encode its prompts once): run ``idle(count, share)`` zero-gradient passes
        if this process must join collectives it has no rows for; return whether the
        passes encode prompts once. One process: nothing to join, prompts shared."""
        return True

    def no_grad_passes(self, passes: int) -> int:
        """Unused forwards to add after ``passes`` no-grad forwards of a model, so that every
        process calls it as often (each call of a sharded model is a collective). Whole
        copies: none."""
        return 0

    def interleave(self, items: list[T]) -> list[T | None]:
        """This process's passes (``items``, its micro-batches) in the order its processes make
        passes together, None where it joins a pass of another's; without sequence parallelism
        its own passes only."""
        return list(items)

    def grad_sync(self, last: bool):
        """The context of one micro-batch's forward and backward (``last`` of its mini-batch)."""
        return contextlib.nullcontext()

    # ----------------------------------------------------------------- around the update
    def rollout_weights(self, backend: Any):
        """The context of a rollout phase (a step's generation and scoring, an evaluation)."""
        return contextlib.nullcontext()

    def model_state(self, model: Any) -> dict[str, torch.Tensor] | None:
        """The weights a checkpoint writes, or None: ``save_pretrained`` reads the model's own."""
        return None

    def optimizer_state(self, model: Any, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], str]:
        """``(state, format)`` of the optimizer for a checkpoint: PyTorch's own numbered form
        (``native``) or keyed by parameter name (``named``, gathered from shards)."""
        return optimizer.state_dict(), "native"

    def load_model_state(self, model: Any, state: dict[str, torch.Tensor]) -> None:
        """Load whole weights (what :meth:`model_state` or ``save_pretrained`` wrote) into
        ``model``; ValueError naming what does not fit."""
        from grpo_core.checkpoint import load_whole_state

        load_whole_state(model, state)

    def load_optimizer_state(self, model: Any, optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                             fmt: str) -> None:
        """Load a checkpoint's optimizer state in format ``fmt`` (:meth:`optimizer_state`),
        whichever strategy and process count wrote it."""
        if fmt == "named":
            sharding.load_optimizer_state(model, optimizer, saved)
        else:
            optimizer.load_state_dict(saved)


class DDP(OneProcess):
    """Every process holds the whole model; ``DistributedDataParallel`` sums gradient buckets
    over processes while backward still runs (``bench/ddp_overlap.py`` measures the gain over
    a sum after backward). Every trainable parameter takes part in each forward (the case of
    causal LMs)."""

    name = "ddp"

    def setup(self, model: nn.Module, reference: nn.Module | None = None) -> None:
        from torch.nn.parallel import DistributedDataParallel

        device = self.dist.device
        root = DistributedDataParallel(
            sharding.LogprobModel(model, logprobs=None if self.logprobs is completion_logprobs else self.logprobs),
            device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,
        )
        root.register_comm_hook(None, _sum_hook)
        self._register(model, root)
        self._policy = model

    def lockstep(self, passes: int, shareable: bool, idle: Callable[[int, bool], None]) -> bool:
        """A process whose rows all have advantage 0 still joins the gradient sum of the
        mini-batch's last backward: one zero-gradient pass."""
        if passes == 0:
            idle(1, False)
        return True

    def grad_sync(self, last: bool):
        """``no_sync()`` but on the last micro-batch of a mini-batch, which sums the
        accumulated gradients."""
        return contextlib.nullcontext() if last else self._roots[id(self._policy)][1].no_sync()


class FSDP2(OneProcess):
    """Each process holds ``1/N`` of every unit of the policy and of the reference copy
    (:func:`grpo_core.train.learner.sharding.shard`); every process makes the same calls to each
    sharded unit, since each call is a collective."""

    name = "fsdp2"
    sharded = True

    def __init__(self, dist: Dist, parallel: Any):
        super().__init__(dist, parallel)
        self.parallel = parallel  # the spec's train.parallel
        self._gathered = False

    def setup(self, model: nn.Module, reference: nn.Module | None = None) -> None:
        logprobs = None if self.logprobs is completion_logprobs else self.logprobs
        self._register(model, sharding.shard(model, self.parallel, self.dist.device, logprobs))
        self._policy = model
        if reference is not None:
            reference.requires_grad_(False)
            self._register(reference, sharding.shard(reference, self.parallel, self.dist.device, logprobs))

    def lockstep(self, passes: int, shareable: bool, idle: Callable[[int, bool], None]) -> bool:
        """Encoding a prompt once for its rows takes two decoder calls, each completion with
        its prompt one: the processes share prompts only if all of them can; one with fewer
        passes runs zero-gradient ones (on one whole group when sharing) up to the largest
        count."""
        every = self.gather((passes, shareable))
        share = all(can for _, can in every)
        idle(max(n for n, _ in every) - passes, share)
        return share

    def no_grad_passes(self, passes: int) -> int:
        """Micro-batches are counted in each process's own tokens, so their number differs
        between processes (packed, or padded to another width): up to the largest count."""
        return max(self.gather(passes)) - passes

    @contextlib.contextmanager
    def rollout_weights(self, backend: Any):
        """The whole policy gathered for the phase when the backend generates with the policy
        itself (``generates_with_policy``, the ``hf`` backend), entered once by every process
        however many ``generate`` calls each then makes (multi-turn episodes differ). Nested
        uses are free."""
        if self._gathered or not backend.capabilities.generates_with_policy:
            yield
            return
        self._gathered = True
        try:
            with sharding.full_weights(self._roots[id(self._policy)][1]):
                yield
        finally:
            self._gathered = False

    def model_state(self, model: Any) -> dict[str, torch.Tensor] | None:
        return sharding.full_state_dict(model)

    def optimizer_state(self, model: Any, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], str]:
        return sharding.optimizer_state(model, optimizer), "named"

    def load_model_state(self, model: Any, state: dict[str, torch.Tensor]) -> None:
        """Each process keeps its shard of the whole weights."""
        unexpected = sorted(set(state) - set(model.state_dict()))
        if unexpected:
            raise ValueError(f"unexpected {unexpected[:5]}")
        sharding.load_full_state_dict(model, state)

    def load_optimizer_state(self, model: Any, optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                             fmt: str) -> None:
        """A numbered state (from a ddp or one-process run) is re-keyed by name first."""
        sharding.load_optimizer_state(model, optimizer, saved if fmt == "named" else
                                      sharding.named_optimizer_state(model, saved))


def _sum_hook(process_group, bucket):
    """DDP communication hook: sum a gradient bucket over processes (DDP's own hook averages;
    the engine's losses are already normalized over the global batch)."""
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class SequenceDDP(SplitSequences, DDP):
    """:class:`DDP` over every process, each sequence split over groups of
    ``train.parallel.sequence`` of them (:class:`~grpo_core.train.learner.sequence_parallel.SplitSequences`)."""

    name = "ddp+sequence"


class SequenceFSDP2(SplitSequences, FSDP2):
    """:class:`FSDP2` over every process, each sequence split over groups of
    ``train.parallel.sequence`` of them."""

    name = "fsdp2+sequence"


def strategy_for(dist: Dist, parallel: Any) -> Strategy:
    """The strategy of a run on ``dist``'s processes with the spec's ``train.parallel``:
    one process is :class:`OneProcess` whatever the spec says (nothing to shard)."""
    if not dist.active:
        return OneProcess(dist)
    if getattr(parallel, "sequence", 1) > 1:
        return SEQUENCE_STRATEGIES[parallel.strategy](dist, parallel)
    return STRATEGIES[parallel.strategy](dist, parallel)


#: The type of every parallel strategy (each is a :class:`OneProcess` that overrides some steps).
Strategy = OneProcess

#: The strategies of several processes, by ``train.parallel.strategy``.
STRATEGIES: dict[str, Callable[[Dist, Any], Strategy]] = {
    "ddp": DDP,
    "fsdp2": FSDP2,
}

#: The same, each sequence split over ``train.parallel.sequence`` processes.
SEQUENCE_STRATEGIES: dict[str, Callable[[Dist, Any], Strategy]] = {
    "ddp": SequenceDDP,
    "fsdp2": SequenceFSDP2,
}
