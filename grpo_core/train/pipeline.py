"""Asynchronous rollouts with a staleness bound: the actor generates the batches of the next
``k`` steps while the learner trains on the current one (``rollout.max_staleness: k``).

The schedule is fixed, so a run is reproducible whatever the timing: after the pipeline
(re)starts at step ``r`` (the learner's version then is ``r``), the batch of step ``t`` is
sampled with the policy after exactly ``max(r, t - k)`` updates and trained at version ``t``,
so its staleness ``t - max(r, t - k)`` never exceeds ``k``. With ``k = 1`` this is the
one-step-off-policy schedule of verl: batch ``t + 1`` is generated with the weights of
version ``t`` while the learner turns batch ``t`` into version ``t + 1``. (A schedule where
the actor takes whatever weights are newest, as AReaL and PipelineRL do, is fresher on
average but depends on timing; this one trades that for exact reruns and resumes.)

Two threads: the actor's (this module's, :meth:`Pipeline._run`) collects batch after batch
into a queue; the learner's (the caller's) takes batch ``t``, learns, and publishes the new
weights with :meth:`Pipeline.publish`. Weights cross in one slot: the learner copies its
parameters into a snapshot (one more copy of the policy) and waits only if the actor has not
yet taken the previous version, which in steady state it has; the actor moves the snapshot
into the weights it generates with just before the batch that needs that version. A backend
that generates with the policy module itself (``hf``) gets a sampler copy of its own (a
second copy), so the learner's optimizer steps never touch the weights being sampled from,
and since the trainer's log-probs at update time are those of a newer policy, the actor
computes the sampler's log-probs (``sampling_logp``) with that copy: the importance weight
``pi_prox / pi_behav`` of ``algorithm.rollout_correction`` then corrects for the lag (TIS by
default; ``mode: mask`` is AReaL's decoupled PPO objective).

It is the asynchronous :mod:`feed <grpo_core.train.feed>`: evaluation, checkpoints and the
start of an iterative-GRPO iteration need the actor at rest with the current weights, and the
loop asks for that with :meth:`Pipeline.at_rest`; generation resumes from the current weights
at the first untrained batch, on the next :meth:`Pipeline.take`. A checkpoint is such a point,
so a run resumed from one trains on exactly what the uninterrupted run trained on. The loop
tells the pipeline where its next rest is (``next_rest``, the step after the last one
included) and whether it will stop after the current step (``stopping``: a signal, a hook),
and the actor starts no batch of those steps: nothing is generated and scored that would be
dropped at the rest or never trained, and the schedule is the one the rests give anyway. A
rest it was not told of (a checkpoint by time, a failure) drops the batches generated ahead
(``async/dropped_batches`` counts them) and rewinds the prompt stream to the first untrained
batch.

Partial rollouts (``rollout.partial_rollouts``): the backend is handed a
:class:`~grpo_core.contracts.WeightSwitch` (:class:`_Switch`) and asks it between engine
steps whether the slot holds newer weights than it generates with; if so its unfinished
completions stop, the weights move in (the learner may then publish the next version), and
they continue from their prefix. A batch's start still follows the schedule above, so its
oldest token is at most ``k`` versions old; its later tokens are fresher, by an amount that
depends on timing (the rerun is then no longer bit-identical). AReaL's interruptible
generation does the same (Fu et al., 2025, section 4); the counting of a completion's
staleness from its oldest token is AReaL's too.

The pipeline's one job is the thread, the queue and the weight slot. What it is handed when
the run is built: the actor (with a process group of its own for its collectives, which run
in its thread while the learner's run in the caller's), the snapshot and sampler copies
(:func:`~grpo_core.contracts.policy_copy`), and the function that computes the sampler's
log-probs (the learner's, :meth:`~grpo_core.train.learner.learner.Learner.sampler_logprobs`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_core.contracts import WeightSwitch, oldest_versions, token_staleness
from grpo_core.train.experience import Experience
from grpo_core.train.feed import Collector, kept_position
from grpo_core.train.signals import leave_running

__all__ = ["Pipeline", "batch_staleness", "copy_weights", "sampled_version"]


def sampled_version(step: int, start: int, max_staleness: int) -> int:
    """The policy version the batch of ``step`` is sampled with, for a pipeline (re)started at
    ``start`` with staleness bound ``max_staleness``: ``max(start, step - max_staleness)``."""
    return max(start, step - max_staleness)


def _plain(model: Any) -> Any:
    """The module itself, without a ``DistributedDataParallel`` or ``torch.compile`` wrapper."""
    return getattr(model, "module", getattr(model, "_orig_mod", model))


def copy_weights(into: Any, model: Any) -> None:
    """``model``'s parameters into the plain copy ``into``; a sharded (FSDP2) parameter is
    gathered whole first (a collective: every process calls this)."""
    with torch.no_grad():
        for mine, theirs in zip(into.parameters(), _plain(model).parameters(), strict=True):
            mine.copy_(theirs.full_tensor() if hasattr(theirs, "full_tensor") else theirs)


@dataclass
class _Stats:
    """What the step's metrics report about the pipeline (reset by :meth:`Pipeline.take`)."""

    actor_wait: float = 0.0  # seconds the actor waited for weights
    dropped: int = 0  # batches dropped by a restart


@dataclass
class Pipeline:
    """The actor's thread and the queue and weight slot between it and the learner, an
    asynchronous :mod:`feed <grpo_core.train.feed>`; see the module doc. ``behaviour``:
    experience -> its sampler log-probs ``(B, T)``, computed in the actor's thread when the
    backend gives none and there is a ``sampler`` copy."""

    actor: Collector
    max_staleness: int
    snapshot: Any  # a whole, unsharded copy of the policy: the weights that cross from the learner
    sampler: Any = None  # the actor's own copy of the policy, for a backend that generates with the policy
    behaviour: Callable[[Any, Experience], torch.Tensor] | None = None  # (sampler, experience) -> log-probs
    interruptible: bool = False  # partial rollouts: the backend polls :attr:`switch` while it generates
    next_rest: Callable[[int], int] | None = None  # the loop's next rest from a (re)start's step; see start
    stopping: Callable[[], bool] | None = None  # whether the loop will stop after the step it is on
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _queue: deque = field(default_factory=deque)
    _data_before: dict[int, Any] = field(default_factory=dict)  # step -> prompt position before its batch
    _slot: tuple[int, Any] | None = None  # (version, snapshot) published, not yet taken by the actor
    _thread: threading.Thread | None = None
    _done: threading.Event = field(default_factory=threading.Event)  # set when _thread's _run returns
    _start = 0  # the step (and version) of the last (re)start
    _next = 0  # the next step the actor collects
    _stop = False
    _limit: int | None = None  # the step of the loop's next rest: no batch of it or later before the rest
    _asked = -1  # the last step whose batch the learner asked for
    _pending = False  # paused by at_rest: the thread starts again at the next take
    _error: BaseException | None = None
    _stats: _Stats = field(default_factory=_Stats)
    _switches = 0  # weight updates the batch being collected took mid-generation

    def __post_init__(self) -> None:
        if self.max_staleness < 1:
            raise ValueError(f"a pipeline needs max_staleness >= 1 (0: the synchronous loop), got {self.max_staleness}")

    @property
    def switch(self) -> WeightSwitch | None:
        """With partial rollouts, the :class:`~grpo_core.contracts.WeightSwitch` the backend is
        set up with (:class:`~grpo_core.contracts.RolloutSetup`); else None."""
        return _Switch(self) if self.interruptible else None

    # ----------------------------------------------------------------- lifecycle
    def start(self, model: Any, version: int, next_rest: Callable[[int], int] | None = None,
              stopping: Callable[[], bool] | None = None) -> None:
        """Take the learner's weights (``version`` updates) and start collecting at step
        ``version``. ``next_rest(step)``: the step of the loop's next rest after a (re)start at
        ``step`` (``step`` itself if one is still due before its batch), the last step's
        successor included; the actor generates no batch of that step or later before it.
        ``stopping()``: True once the loop will stop after the step it is on (a signal, a
        hook's request); the actor then starts no batch of a later step."""
        if next_rest is not None:
            self.next_rest = next_rest
        if stopping is not None:
            self.stopping = stopping
        self.pause(model, version)
        self.resume()

    def pause(self, model: Any, version: int) -> None:
        """Bring the actor to rest with the learner's current weights (``version`` updates):
        stop its thread after its current batch, drop the batches it generated ahead and
        rewind the prompt stream to the batch of step ``version``. An actor at rest serves
        evaluation and checkpoints; :meth:`resume` starts it again at step ``version``."""
        self.close()
        self._pending = False
        with self._cond:
            self._stats.dropped += len(self._queue)
            self._queue.clear()
            first = self._data_before.get(version)
            self._data_before.clear()
            self._slot = None
            self._start = self._next = version
            self._asked = version - 1
            self._stop, self._error = False, None
        if first is not None:
            self.actor.source.load_state_dict(first)
        self._apply_now(model, version)

    @contextmanager
    def at_rest(self, model: Any, version: int):
        """The actor paused with the learner's weights (``version`` updates) for the duration,
        then started again at step ``version`` by the next :meth:`take` (so that rests in a
        row, an evaluation then a checkpoint, restart it once, with the next rest known);
        free when it is not running. After an exception inside, the actor stays stopped and
        the prompt stream is put back."""
        again = self.running or self._pending
        if self.running:
            self.pause(model, version)
        self._pending = False
        with kept_position(self.actor):
            yield
        self._pending = again  # not after an exception: a failing run leaves with the actor stopped

    def stop(self, model: Any, version: int) -> None:
        """Stop the actor at rest (the batches it generated ahead dropped, the prompts rewound
        to the batch of step ``version``), if it runs."""
        self._pending = False
        if self.running:
            self.pause(model, version)

    def resume(self) -> None:
        """Start the actor's thread at the step of the last :meth:`pause`, up to the loop's
        next rest from there."""
        self._pending = False
        if self._thread is None:
            self._limit = None if self.next_rest is None else self.next_rest(self._start)
            self._done = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._done,), name="grpo-actor", daemon=True)
            self._thread.start()

    def close(self, wait: bool = True) -> None:
        """Stop the actor's thread after its current batch (an idle actor stops at once);
        ``wait=False`` does not wait for that batch (a failed or twice-interrupted run leaves
        at once, the thread being a daemon): a thread still busy is recorded
        (:func:`~grpo_core.train.signals.leave_running`), so that the process leaves without
        finalizing the interpreter under it.

        The wait is on the pipeline's own event, never ``Thread.join``: a ``join`` that a
        signal interrupts (a second Ctrl-C while the actor finishes its batch) marks the thread
        stopped though it still runs (python/cpython#90882), so a later ``join`` or
        ``is_alive`` would say it ended, and the run would finalize the interpreter, or start
        a second actor, beside it."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            if wait:
                self._done.wait()
            elif not self._done.is_set():
                leave_running(self._thread)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    # ----------------------------------------------------------------- the learner's side
    def take(self, step: int) -> tuple[Experience, dict[str, float]]:
        """The batch of ``step`` (waiting for it), with the pipeline's metrics: its staleness,
        the queue depth when it was taken, the seconds the learner waited for it and the
        actor waited for weights since the last take, and the batches dropped by restarts."""
        if self._pending:
            self.resume()
        if self._limit is not None and step >= self._limit:
            raise RuntimeError(f"pipeline: the batch of step {step} was asked for before the rest due at step "
                               f"{self._limit}")
        t0 = time.perf_counter()
        with self._cond:
            self._asked = step
            self._cond.notify_all()
            while not self._queue and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            experience = self._queue.popleft()
            depth = len(self._queue)
            stats, self._stats = self._stats, _Stats()
            self._data_before.pop(step - 1, None)
        if experience.step != step:
            raise RuntimeError(f"pipeline: expected the batch of step {step}, got step {experience.step}")
        staleness, partial = batch_staleness(experience, step)
        if not 0 <= staleness <= self.max_staleness:
            raise RuntimeError(f"pipeline: the batch of step {step} is {staleness} versions old "
                               f"(bound {self.max_staleness})")
        metrics = {
            "async/staleness": float(staleness),
            "async/queue_depth": float(depth),
            "async/dropped_batches": float(stats.dropped),
            "time/learner_wait": time.perf_counter() - t0,
            "time/actor_wait": stats.actor_wait,
        }
        if self.interruptible:
            metrics.update(partial)  # and the batch's own async/switches, in its metrics
        return experience, metrics

    def publish(self, model: Any, version: int) -> None:
        """The learner's weights after ``version`` updates, for the batch of step
        ``version + max_staleness``: copied into the snapshot once the actor has taken the
        previous one. Weights no batch before the loop's next rest will take are not copied
        (the rest gives the actor the learner's own); whether they are is the same on every
        process, since under FSDP2 the copy is a collective."""
        if self._limit is not None and (version >= self._limit or (
                not self.interruptible and version + self.max_staleness >= self._limit)):
            return
        with self._cond:
            # with partial rollouts, an actor done with the batches before the rest takes no
            # more weights: the slot's may be overwritten
            while self._slot is not None and self._error is None and not self._idle():
                self._cond.wait()
            if self._error is not None:
                return  # the actor failed: the next take raises it, before that step's update
        copy_weights(self.snapshot, model)
        with self._cond:
            self._slot = (version, self.snapshot)
            self._cond.notify_all()

    # ----------------------------------------------------------------- the actor's side
    def _idle(self) -> bool:
        """The actor has collected every batch before the loop's next rest (call under the lock)."""
        return self._limit is not None and self._next >= self._limit

    def _held(self, step: int) -> bool:
        """Whether the actor may not start the batch of ``step`` now (call under the lock): it
        is at or past the loop's next rest, or the loop will stop before asking for it."""
        if self._limit is not None and step >= self._limit:
            return True
        return step > self._asked and self.stopping is not None and bool(self.stopping())

    def _apply_now(self, weights: Any, version: int) -> None:
        """Make the actor generate with ``weights`` (the learner's model or a snapshot)."""
        if self.sampler is not None:
            copy_weights(self.sampler, weights)
            self.actor.receive(self.sampler, version)
        else:
            self.actor.receive(weights, version)

    def _take_mid_batch(self) -> None:
        """Partial rollouts: move the slot's weights into the actor now (the backend has
        stopped its unfinished completions), freeing the slot for the learner."""
        with self._cond:
            slot = self._slot
        if slot is None or slot[0] <= self.actor.version:
            return
        self._apply_now(slot[1], slot[0])
        with self._cond:
            self._slot = None
            self._switches += 1
            self._cond.notify_all()

    def _wait_for(self, step: int, need: int) -> None:
        """Wait (under the lock) until the batch of ``step`` may start with weights of version
        ``need`` at hand, or the pipeline stops: a wait while the actor is held (woken by a
        take or a pause) is not one for weights."""
        while not self._stop:
            while not self._stop and self._held(step):
                self._cond.wait()
            waited = time.perf_counter()
            while (not self._stop and not self._held(step) and self.actor.version < need
                   and (self._slot is None or self._slot[0] < need)):
                self._cond.wait()
            self._stats.actor_wait += time.perf_counter() - waited
            if not self._held(step):
                return

    def _run(self, done: threading.Event) -> None:
        try:
            while True:
                with self._cond:
                    step = self._next
                    need = sampled_version(step, self._start, self.max_staleness)
                    self._wait_for(step, need)
                    stopping = self._stop
                # every process's actor starts this batch or none does: their collectives must pair up
                if self.actor.dist.any(stopping):
                    return
                with self._cond:
                    slot = self._slot if self.actor.version < need else None
                    self._data_before[step] = self.actor.source.state_dict()
                if slot is not None:
                    if slot[0] != need:
                        raise RuntimeError(f"pipeline: step {step} needs version {need}, the slot holds {slot[0]}")
                    self._apply_now(slot[1], slot[0])
                    with self._cond:  # only now may the learner write the next version into the snapshot
                        self._slot = None
                        self._cond.notify_all()
                self._switches = 0
                experience = self.actor.collect(step)
                if self.interruptible:  # weight updates this batch took mid-generation
                    experience.metrics["async/switches"] = float(self._switches)
                self._behaviour_logprobs(experience)
                with self._cond:
                    self._queue.append(experience)
                    self._next = step + 1
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the learner's thread, which raises it
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            done.set()

    def _behaviour_logprobs(self, experience: Experience) -> None:
        """The sampler copy's log-probs of the batch, when the backend gave none: the
        behaviour policy of the rollout correction."""
        rollout = experience.scored.rollout
        if self.sampler is None or self.behaviour is None or rollout.sampling_logp is not None:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            rollout.sampling_logp = self.behaviour(self.sampler, experience)
        experience.times["sampler_logprobs"] = time.perf_counter() - t0


def batch_staleness(experience: Experience, step: int) -> tuple[int, dict[str, float]]:
    """The staleness of ``experience`` trained at ``step``: versions since its oldest token
    was sampled (``experience.version``, or with per-token versions the oldest of them), and
    with per-token versions the mean and largest token staleness
    (``async/token_staleness``, ``async/token_staleness/max``)."""
    rollout = experience.scored.rollout
    if rollout.token_versions is None:
        return step - experience.version, {"async/token_staleness": float(step - experience.version),
                                           "async/token_staleness/max": float(step - experience.version)}
    mask = rollout.completion_mask.bool()
    versions = rollout.token_versions.to(mask.device)
    oldest = min(experience.version, int(oldest_versions(versions, mask, experience.version).min()))
    per_token = token_staleness(versions, mask, step)[mask].double()
    mean = float(per_token.mean()) if per_token.numel() else 0.0
    top = float(per_token.max()) if per_token.numel() else 0.0
    return step - oldest, {"async/token_staleness": mean, "async/token_staleness/max": top}


@dataclass
class _Switch:
    """The :class:`~grpo_core.contracts.WeightSwitch` of a pipeline with partial rollouts:
    the backend polls it from the actor's thread while it generates."""

    pipeline: Pipeline

    @property
    def version(self) -> int:
        return self.pipeline.actor.version

    def pending(self) -> bool:
        p = self.pipeline
        with p._cond:
            return not p._stop and p._slot is not None and p._slot[0] > p.actor.version

    @property
    def coming(self) -> bool:
        """Whether newer weights are due while this batch runs: it is not the first since a
        (re)start (so the learner is training on an earlier one), the actor holds an older
        version than the batch's step and the pipeline is not stopping. A backend may wait
        for them (a test's does, to cut at a fixed token)."""
        p = self.pipeline
        with p._cond:
            return not p._stop and p._next > p._start and p.actor.version < p._next

    def take(self) -> int:
        self.pipeline._take_mid_batch()
        return self.pipeline.actor.version
