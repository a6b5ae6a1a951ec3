"""Scoring completions with the spec's reward functions (TRL's calling convention).

Process supervision: a reward function that names a ``steps`` parameter gets the steps of
every completion and returns, per completion, one score per step (a list) instead of a
float. With steps, :func:`score` also returns ``step_scores (B, K)``: the weighted sum
over functions of each step's score, where an outcome (float) score counts on the last
step. A completion's per-function score of a process reward (for metrics and for outcome
estimators) is the mean of its step scores.

Calling the functions (:func:`call_all`): ``async def`` functions (or objects with an
``async def __call__``) are awaited together in one event loop, run in a helper thread,
while the synchronous ones run. A synchronous function runs on the calling thread as it
always did, unless its slot sets ``concurrency > 1`` (the batch is cut into that many
contiguous chunks, called in parallel threads; for an async function, awaited together)
or ``call_timeout`` (it then runs in a worker thread). ``call_timeout`` bounds the whole
call of one function on one step's batch; rows it has not scored by then are unscorable
(``train.reward_errors: none``, counted in ``reward/failed``) or stop the run (``raise``).
An async call past its timeout is cancelled; a thread cannot be killed, so a hung
synchronous call is abandoned: it keeps running in a daemon thread, its result is
discarded, and the step proceeds without it.

A function that raises :class:`~grpo_core.errors.RunError` (a message meant for the
user, such as a missing column or an unreachable server) fails for its whole batch; any
other exception is retried completion by completion to find the one it fails on. Plugin
code is user code: a ``SystemExit`` (or any ``BaseException`` but ``KeyboardInterrupt``)
from a reward function is that function's fault like any exception, never the end of the
process. One rule for every score, whatever its source
(:func:`grpo_core.contracts.reward_value`): a finite real number within float32's range, or
None for an unscorable completion; anything else (NaN, an infinity, a string such as
``"0.5"``, ``1e300``) is an error naming the function and the completion (or, with
``reward_errors: none``, scored None and counted), and so is a weighted sum beyond float32;
a batch that no function could score is logged as a warning naming the functions.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.contracts import masked_fill_zero, reward_value
from grpo_core.errors import RunError, fault_text
from grpo_core.registry import conform
from grpo_core.train.experience import Scores

logger = logging.getLogger("grpo.scoring")


class PluginFault(Exception):
    """A ``BaseException`` that is not an ``Exception`` (``SystemExit`` from argparse or
    ``sys.exit`` in a reward function), carried as an ordinary exception: plugin code is user
    code, and what it raises is its fault, not the end of the run."""

    def __init__(self, original: BaseException):
        super().__init__(fault_text(original))
        self.original = original


async def _guarded(coroutine: Any) -> Any:
    """Await an async reward function's call, turning what it raises beyond ``Exception``
    (except ``KeyboardInterrupt`` and a cancellation) into a :class:`PluginFault`."""
    try:
        return await coroutine
    except (Exception, KeyboardInterrupt, asyncio.CancelledError):
        raise
    except BaseException as exc:
        raise PluginFault(exc) from exc


@dataclass
class RewardFn:
    """A built reward function with its spec name and weight, and how it is called:
    ``concurrency`` chunks of the batch at once, within ``timeout`` seconds (None: no limit)."""

    name: str
    weight: float
    fn: Callable[..., list]
    takes_kwargs: bool
    params: frozenset[str]
    splitter: Callable[[list], Any] | None = None  # completions -> StepLayout
    concurrency: int = 1
    timeout: float | None = None
    only: tuple[str, frozenset[str]] | None = None  # (column, values): it scores those rows only

    @classmethod
    def of(
        cls, name: str, weight: float, fn: Callable[..., list], splitter: Callable[[list], Any] | None = None,
        concurrency: int = 1, timeout: float | None = None, only: tuple[str, frozenset[str]] | None = None,
    ) -> RewardFn:
        fn = conform("reward_function", fn, f"reward function '{name}'")  # declared flags present
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return cls(name, weight, fn, True, frozenset(), splitter, concurrency, timeout, only)
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        return cls(name, weight, fn, takes_kwargs, frozenset(sig.parameters), splitter, concurrency, timeout, only)

    @property
    def is_async(self) -> bool:
        """An ``async def`` function, or an object whose ``__call__`` is one."""
        candidates = (self.fn, inspect.unwrap(self.fn))  # and through the engine's flag-carrying proxy
        return any(inspect.iscoroutinefunction(c) or inspect.iscoroutinefunction(type(c).__call__)
                   for c in candidates)

    @property
    def threaded(self) -> bool:
        """A synchronous function that runs in worker threads rather than the caller's."""
        return not self.is_async and (self.concurrency > 1 or self.timeout is not None)

    @property
    def takes_steps(self) -> bool:
        """A process reward: it names a ``steps`` parameter."""
        return "steps" in self.params

    def call(self, kwargs: dict[str, Any]) -> list:
        """The function's result on ``kwargs`` (for an async function, a coroutine); a
        ``BaseException`` that is not an ``Exception`` (``SystemExit``) comes out as a
        :class:`PluginFault`, so that it is handled as the function's fault."""
        if not self.takes_kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k in self.params}
        if self.is_async:
            return _guarded(self.fn(**kwargs))
        try:
            return self.fn(**kwargs)
        except (Exception, KeyboardInterrupt):
            raise
        except BaseException as exc:
            raise PluginFault(exc) from exc

    @property
    def required_columns(self) -> list[str]:
        return list(self.fn.required_columns)


class BadRewardValue(RunError):
    """A reward function returned something that is not a finite real number or None."""


def _to_float(value: Any, fn: RewardFn, index: int) -> float:
    """``value`` as a table entry (NaN for None), or :class:`BadRewardValue` naming the function."""
    try:
        out = reward_value(value)
    except ValueError as exc:
        raise BadRewardValue(f"reward function '{fn.name}' returned {exc} for completion {index}") from None
    return math.nan if out is None else out


def _prompt_head(prompt: Any, width: int = 60) -> str:
    if isinstance(prompt, list):
        prompt = " ".join(str(m.get("content", "")) for m in prompt if m.get("role") != "system")
    text = " ".join(str(prompt).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _row_failure(fn: RewardFn, exc: Exception, i: int, kwargs: dict[str, Any], on_error: str) -> None:
    """Completion ``i`` made ``fn`` raise: a RunError naming both, or None (scored None)."""
    if on_error == "raise":
        what = str(exc) if isinstance(exc, PluginFault) else f"{type(exc).__name__}: {exc}"
        raise RunError(
            f"reward function '{fn.name}' raised {what} on completion {i} "
            f"(prompt: {_prompt_head(kwargs['prompts'][i])!r}); set train.reward_errors: none "
            "to score such completions None instead"
        ) from exc
    return None


def _batch_failure(exc: RunError, size: int, on_error: str) -> tuple[list, int]:
    """``fn`` raised a RunError (its own message, for the whole batch): raise it, or score
    every completion None."""
    if on_error == "raise":
        raise exc
    logger.warning("%s; its %d completions are scored None (train.reward_errors: none)", exc, size)
    return [None] * size, size


def _rows(kwargs: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {k: v[start:stop] if isinstance(v, list) else v for k, v in kwargs.items()}


def _single(result: Any) -> Any:
    return result[0] if isinstance(result, (list, tuple)) and len(result) == 1 else result


def _call_one(fn: RewardFn, kwargs: dict[str, Any], on_error: str) -> tuple[list, int]:
    """Call ``fn`` on the batch; when it raises, find the completion it fails on."""
    size = len(kwargs["completions"])
    try:
        return fn.call(kwargs), 0
    except RunError as exc:
        return _batch_failure(exc, size, on_error)
    except Exception:
        pass
    out, failed = [], 0
    for i in range(size):
        try:
            out.append(_single(fn.call(_rows(kwargs, i, i + 1))))
        except Exception as exc:
            out.append(_row_failure(fn, exc, i, kwargs, on_error))
            failed += 1
    return out, failed


async def _acall_one(fn: RewardFn, kwargs: dict[str, Any], on_error: str) -> tuple[list, int]:
    """:func:`_call_one` for an ``async def`` function; the per-completion retries are
    awaited together."""
    size = len(kwargs["completions"])
    try:
        return await fn.call(kwargs), 0
    except RunError as exc:
        return _batch_failure(exc, size, on_error)
    except Exception:
        pass
    results = await asyncio.gather(*(fn.call(_rows(kwargs, i, i + 1)) for i in range(size)), return_exceptions=True)
    out, failed = [], 0
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result
            out.append(_row_failure(fn, result, i, kwargs, on_error))
            failed += 1
        else:
            out.append(_single(result))
    return out, failed


def _chunk_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, non-empty ``[start, stop)`` ranges covering ``0..size``."""
    parts = max(1, min(parts, size))
    edges = [round(i * size / parts) for i in range(parts + 1)]
    return list(zip(edges, edges[1:]))


def _checked(values: Any, fn: RewardFn, size: int) -> list:
    if not isinstance(values, (list, tuple)) or len(values) != size:
        got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else repr(values)
        raise RunError(f"reward function '{fn.name}' returned {got}; expected a list of {size} floats or None")
    return list(values)


def _timed_out(fn: RewardFn, rows: int, on_error: str) -> tuple[list, int]:
    """``rows`` completions ``fn`` did not score within its timeout."""
    if on_error == "raise":
        raise RunError(
            f"reward function '{fn.name}' did not return within its call_timeout of {fn.timeout:g} s "
            f"({rows} completion(s) unscored); raise rewards[].call_timeout, or set "
            "train.reward_errors: none to score such completions None instead"
        )
    logger.warning("reward function '%s' timed out after %g s: %d completion(s) scored None",
                   fn.name, fn.timeout, rows)
    return [None] * rows, rows


def _joined(fn: RewardFn, chunks: list[tuple[int, int]], outcomes: list, on_error: str) -> tuple[list, int]:
    """One function's result from its chunks' outcomes: ``(values, failed)``, an
    exception, or None (not finished in time)."""
    values, failed = [], 0
    for (start, stop), outcome in zip(chunks, outcomes):
        if isinstance(outcome, BaseException):
            raise outcome
        part, n_failed = outcome if outcome is not None else _timed_out(fn, stop - start, on_error)
        values.extend(_checked(part, fn, stop - start))
        failed += n_failed
    return values, failed


class _Threads:
    """A synchronous function's chunks, each called in a daemon thread (one that hangs
    past the timeout is abandoned: daemon threads do not hold up the interpreter's exit)."""

    def __init__(self, fn: RewardFn, kwargs: dict[str, Any], on_error: str, size: int):
        self.fn, self.on_error = fn, on_error
        self.chunks = _chunk_bounds(size, fn.concurrency)
        self.outcomes: list = [None] * len(self.chunks)
        self.threads = []
        for c, (start, stop) in enumerate(self.chunks):
            thread = threading.Thread(target=self._work, args=(c, _rows(kwargs, start, stop)),
                                      name=f"reward-{fn.name}-{c}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def _work(self, c: int, kwargs: dict[str, Any]) -> None:
        try:
            self.outcomes[c] = _call_one(self.fn, kwargs, self.on_error)
        except BaseException as exc:  # re-raised on the calling thread
            self.outcomes[c] = exc

    def result(self, started: float) -> tuple[list, int]:
        for thread in self.threads:
            left = None if self.fn.timeout is None else max(0.0, started + self.fn.timeout - time.monotonic())
            thread.join(left)
        return _joined(self.fn, self.chunks, list(self.outcomes), self.on_error)


class _EventLoop:
    """Every async function of the batch, awaited together in one event loop in a helper
    thread; each function's chunks are gathered, within its timeout (then cancelled)."""

    def __init__(self, fns: dict[int, RewardFn], kwargs: dict[str, Any], on_error: str, size: int):
        self.fns, self.kwargs, self.on_error = fns, kwargs, on_error
        self.chunks = {j: _chunk_bounds(size, fn.concurrency) for j, fn in fns.items()}
        self.outcomes: dict[int, list] = {j: [None] * len(c) for j, c in self.chunks.items()}
        self.thread = threading.Thread(target=asyncio.run, args=(self._all(),), name="rewards-async", daemon=True)
        self.thread.start()

    async def _one(self, j: int) -> None:
        fn = self.fns[j]

        async def chunk(c: int, start: int, stop: int) -> None:
            try:
                self.outcomes[j][c] = await _acall_one(fn, _rows(self.kwargs, start, stop), self.on_error)
            except Exception as exc:
                self.outcomes[j][c] = exc

        work = asyncio.gather(*(chunk(c, a, b) for c, (a, b) in enumerate(self.chunks[j])))
        try:
            await asyncio.wait_for(work, fn.timeout)
        except asyncio.TimeoutError:
            pass  # unfinished chunks stay None: timed out

    async def _all(self) -> None:
        await asyncio.gather(*(self._one(j) for j in self.fns))

    def result(self, started: float) -> dict[int, tuple[list, int]]:
        limits = [fn.timeout for fn in self.fns.values()]
        # A coroutine that blocks the loop cannot be cancelled: wait at most a second more.
        self.thread.join(None if None in limits else max(0.0, started + max(limits) + 1.0 - time.monotonic()))
        return {j: _joined(fn, self.chunks[j], list(self.outcomes[j]), self.on_error) for j, fn in self.fns.items()}


def _call_routed(fns: list[RewardFn], kwargs: dict[str, Any], on_error: str) -> list[tuple[list, int]]:
    """:func:`call_all`, but a function with ``only = (column, values)`` is called on the rows
    whose ``column`` holds one of ``values`` (its other rows are None: not counted)."""
    size = len(kwargs["completions"])
    plain = [j for j, fn in enumerate(fns) if fn.only is None]
    results = dict(zip(plain, call_all([fns[j] for j in plain], kwargs, on_error)))
    for j, fn in enumerate(fns):
        if fn.only is None:
            continue
        column, allowed = fn.only
        if column not in kwargs:
            raise RunError(f"reward function '{fn.name}' scores the rows whose column '{column}' (data.source_column) "
                           f"is one of {sorted(allowed)}, but the batch has no such column")
        rows = [i for i, value in enumerate(kwargs[column]) if str(value) in allowed]
        full: list = [None] * size
        n_failed = 0
        if rows:
            sub = {k: [v[i] for i in rows] if isinstance(v, list) and len(v) == size else v for k, v in kwargs.items()}
            ((values, n_failed),) = call_all([fn], sub, on_error)
            for i, value in zip(rows, _checked(values, fn, len(rows))):
                full[i] = value
        results[j] = (full, n_failed)
    return [results[j] for j in range(len(fns))]


def call_all(fns: list[RewardFn], kwargs: dict[str, Any], on_error: str) -> list[tuple[list, int]]:
    """Every function's ``(values, failed)`` on the batch: async functions and threaded
    synchronous ones start first, then the others run on this thread, in order."""
    size = len(kwargs["completions"])
    started = time.monotonic()
    threads = {j: _Threads(fn, kwargs, on_error, size) for j, fn in enumerate(fns) if fn.threaded and size}
    asyncs = {j: fn for j, fn in enumerate(fns) if fn.is_async}
    loop = _EventLoop(asyncs, kwargs, on_error, size) if asyncs and size else None
    results: dict[int, tuple[list, int]] = {}
    for j, fn in enumerate(fns):
        if j not in threads and j not in asyncs:
            results[j] = _call_one(fn, kwargs, on_error)
        elif not size:
            results[j] = ([], 0)
    for j, pending in threads.items():
        results[j] = pending.result(started)
    if loop is not None:
        results.update(loop.result(started))
    return [results[j] for j in range(len(fns))]


def _step_values(value: Any, fn: RewardFn, index: int, steps: list[list[str]] | None) -> list[float]:
    """A process reward's per-step scores for completion ``index``, checked against its steps."""
    values = list(value)
    if steps is None:
        raise RunError(
            f"reward function '{fn.name}' returned a list of {len(values)} scores for completion "
            f"{index}; per-step scores need the completion's steps: name a `steps` parameter "
            "in the function (the engine then passes the steps of every completion)"
        )
    if len(values) != len(steps[index]):
        raise RunError(
            f"reward function '{fn.name}' returned {len(values)} step scores for completion "
            f"{index}, which has {len(steps[index])} steps (algorithm.step_splitter); return one "
            "score (or None) per entry of its `steps`"
        )
    return [_to_float(v, fn, index) for v in values]


def _bad_value(exc: BadRewardValue, prompt: Any, on_error: str) -> int:
    """A value that is not a finite real number or None: the RunError (with the prompt of
    the completion), or with ``on_error == "none"`` a warning; the completion is then scored
    None and counted (returns 1)."""
    if on_error == "raise":
        raise BadRewardValue(
            f"{exc} (prompt: {_prompt_head(prompt)!r}); rewards must be finite real numbers, or None for an "
            "unscorable completion; set train.reward_errors: none to score such completions None instead"
        ) from None
    logger.warning("%s: scored None (rewards must be finite real numbers, or None)", exc)
    return 1


def _check_range(total: torch.Tensor, table: torch.Tensor, fns: list[RewardFn], prompts: list[Any]) -> None:
    """A RunError when a completion's weighted sum of rewards, each within float32's range,
    is not (``3e38`` with weight 2): its rewards and weights, and what to change."""
    beyond = torch.isinf(total).nonzero()
    if len(beyond):
        i = int(beyond[0])
        terms = ", ".join(f"'{fn.name}' {float(table[i, j]):g} x weight {fn.weight:g}" for j, fn in enumerate(fns)
                          if not math.isnan(table[i, j]))
        raise RunError(f"the weighted sum of the rewards of completion {i} (prompt: {_prompt_head(prompts[i])!r}) "
                       f"is beyond float32's range (|r| <= 3.4e38): {terms}; scale the rewards or their weights down")


def _is_per_step(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (getattr(value, "ndim", 0) == 1 and hasattr(value, "tolist"))


def _weighted(table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over the last dim (functions) of the scored entries; NaN where none is."""
    scored = ~torch.isnan(table)
    total = masked_fill_zero(table * weights, scored).sum(dim=-1)
    return torch.where(scored.any(dim=-1), total, torch.full((), math.nan))


def _default_steps(fns: list[RewardFn], completions: list[Any]) -> list[list[str]] | None:
    """The steps for callers that did not cut them (evaluation), when a function takes them."""
    takers = [fn for fn in fns if fn.takes_steps]
    if not takers:
        return None
    if takers[0].splitter is None:
        raise RunError(f"reward function '{takers[0].name}' takes `steps` but no step splitter was given")
    return takers[0].splitter(completions).texts


def score(
    fns: list[RewardFn],
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list],
    completion_ids: list[list[int]],
    on_error: str = "raise",
    steps: list[list[str]] | None = None,
) -> Scores:
    """Call every reward function once on all ``B`` completions and combine them.

    ``steps``: the step texts of each completion (process supervision), passed to the
    functions as ``steps``; cut with the functions' splitter when None and one takes them.
    """
    size = len(completions)
    steps = steps if steps is not None else _default_steps(fns, completions)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    if steps is not None:
        if "steps" in columns:
            raise RunError(
                "the dataset has a column 'steps', which would hide the completions' steps that "
                "process rewards receive as `steps`; rename the column"
            )
        kwargs["steps"] = steps
    table = torch.full((size, len(fns)), math.nan, dtype=torch.float32)
    k = max((len(s) for s in steps), default=0) if steps is not None else 0
    step_table = torch.full((size, k, len(fns)), math.nan, dtype=torch.float32)
    failed = 0
    for j, (fn, (values, n_failed)) in enumerate(zip(fns, _call_routed(fns, kwargs, on_error))):
        failed += n_failed
        values = _checked(values, fn, size)
        for i, v in enumerate(values):
            try:
                if _is_per_step(v):
                    per_step = torch.tensor(_step_values(v, fn, i, steps), dtype=torch.float32)
                    step_table[i, : len(per_step), j] = per_step
                    table[i, j] = per_step.nanmean() if len(per_step) else math.nan
                else:
                    table[i, j] = _to_float(v, fn, i)
                    if steps is not None and steps[i]:  # an outcome score counts on the last step
                        step_table[i, len(steps[i]) - 1, j] = table[i, j]
            except BadRewardValue as exc:
                failed += _bad_value(exc, prompts[i], on_error)
    weights = torch.tensor([fn.weight for fn in fns], dtype=torch.float32)
    step_scores = _weighted(step_table, weights) if steps is not None else None
    total = _weighted(table, weights)
    _check_range(total, table, fns, prompts)
    if size and bool(torch.isnan(total).all()):
        logger.warning(
            "no completion of this batch of %d could be scored: reward function(s) %s returned "
            "None (or failed) for every one; these rows carry no learning signal", size,
            ", ".join(f"'{fn.name}'" for fn in fns),
        )
    return Scores(total, table, [fn.name for fn in fns], failed, step_scores, weights)
