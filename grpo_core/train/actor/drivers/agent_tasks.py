"""Running the agent programs of one rollout (:class:`AgentTasks`): an event loop in a thread of
its own, at most ``concurrency`` episodes at once, each bounded by its timeout on its agent's own
time (:class:`EpisodeClock`: the time its requests wait for the policy's answers is not the
agent's), and each agent's failure (an exception, a timeout, a reward that is not a finite float32, ``sys.exit``,
a ``KeyboardInterrupt`` raised in its code, a stopped loop) failing its own episode only. The
runner that serves their requests and records their tokens is
:class:`~grpo_core.train.actor.drivers.agents.AgentRunner`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from grpo_core.contracts import AgentEpisode
from grpo_core.contracts.rewards import REWARD_MAX
from grpo_core.errors import fault_text

log = logging.getLogger("grpo.agents")


class AgentTasks:
    """The agents of one rollout, at most ``concurrency`` at once, in an event loop of their
    own thread; a synchronous agent runs in a daemon thread per episode. ``episodes`` are the
    runner's live episodes (``key``, ``row``, ``index``, ``record``, ``clock`` (an
    :class:`EpisodeClock`), ``closed`` and ``fail(why)``); ``on_change()`` is called each time
    one ends. ``timeout`` bounds each episode's own time (``clock.own()``)."""

    def __init__(self, agent, episodes: list[Any], base_url: str, concurrency: int, timeout: float,
                 on_change) -> None:
        self.agent, self.episodes, self.base_url = agent, episodes, base_url
        self.concurrency, self.timeout, self.on_change = concurrency, timeout, on_change
        self.running = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name="grpo-agents", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        everything = self.loop.create_task(self._all())
        try:
            while not everything.done():
                try:
                    self.loop.run_until_complete(everything)
                except asyncio.CancelledError:  # the rollout ended with agents still running
                    break
                except BaseException as exc:  # noqa: BLE001 - an agent's, never the other agents'
                    # A task or callback an agent started exited (SystemExit, KeyboardInterrupt) outside
                    # its episode's own code, or the agent stopped the loop: the loop goes on for the others.
                    if not everything.done():
                        log.warning("an agent stopped the agents' event loop (%s); it goes on for the other "
                                    "episodes", fault_text(exc))
        finally:
            self.loop.close()

    async def _all(self) -> None:
        gate = asyncio.Semaphore(self.concurrency)
        self.tasks = [asyncio.ensure_future(self._one(e, gate)) for e in self.episodes]
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.sleep(0)  # what the agents' closing clients scheduled runs before the loop closes

    async def _one(self, e: Any, gate: asyncio.Semaphore) -> None:
        async with gate:
            self.running += 1
            e.clock.start()
            try:
                value = await self._bounded(e, asyncio.ensure_future(_contained(self._call(e))))
                if value is not None and not isinstance(value, (int, float)):
                    e.fail(f"returned {type(value).__name__}, not a float reward or None")
                elif value is not None and not abs(value) <= REWARD_MAX:  # NaN, an infinity, 1e300
                    e.fail(f"returned the reward {value!r:.40}; rewards are finite numbers within float32's range "
                           f"(|r| <= {REWARD_MAX:.4g}), or None")
                else:
                    e.record.reward = None if value is None else float(value)
            except asyncio.TimeoutError:
                e.fail(timed_out(self.timeout))
            except asyncio.CancelledError:
                e.fail("cancelled")
            except _AgentExit as exc:
                e.fail(f"raised {exc}")
            except BaseException as exc:  # noqa: BLE001 - an agent's failure is its episode's, never the run's
                e.fail(f"raised {fault_text(exc)}")
            finally:
                e.clock.stop()
                e.closed = True
                self.running -= 1
                self.on_change()

    async def _bounded(self, e: Any, task: asyncio.Future) -> Any:
        """``task``'s result, or :class:`asyncio.TimeoutError` (``task`` cancelled) once the
        episode's own time reaches ``timeout``: the deadline moves on by each wait for the policy."""
        try:
            while True:
                left = self.timeout - e.clock.own()
                if left <= 0:
                    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # what it raises: retrieved
                    task.cancel()
                    await asyncio.wait({task}, timeout=1.0)  # its cancellation runs; a task that ignores it is left
                    raise asyncio.TimeoutError
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    return task.result()
        except asyncio.CancelledError:  # the rollout ended: the agent's task goes with it
            task.cancel()
            raise

    async def _call(self, e: Any) -> Any:
        info = AgentEpisode(self.base_url, e.key, "policy", dict(e.row), e.index, self.timeout)
        if any(inspect.iscoroutinefunction(c) for c in (self.agent, inspect.unwrap(self.agent),
                                                         type(self.agent).__call__)):
            return await self.agent(info)
        future = self.loop.create_future()

        def work() -> None:
            try:
                outcome = (self.agent(info), None)
            except BaseException as exc:  # noqa: BLE001 - the episode's failure, reported below
                outcome = (None, exc)
            try:
                self.loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the rollout ended long ago (the agent ran past its deadline): nobody waits
                pass

        threading.Thread(target=work, name=f"grpo-agent-{e.index}", daemon=True).start()
        return await future

    def cancel(self) -> None:
        """Cancel what still runs (a stuck agent's thread is left to end on its own)."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in getattr(self, "tasks", []) if not t.done()])
        except RuntimeError:  # the loop closed meanwhile
            pass


class _AgentExit(Exception):
    """An agent's ``SystemExit`` (``sys.exit``, ``_thread.exit``) or ``KeyboardInterrupt`` as an
    ordinary exception: raised as is in the agents' event loop, it would stop the loop and every
    other episode of the step with it."""

    def __init__(self, original: BaseException):
        super().__init__("KeyboardInterrupt (in the agent's code: not a Ctrl-C, which the run's main thread "
                         "receives)" if isinstance(original, KeyboardInterrupt) else fault_text(original))


async def _contained(call: Any) -> Any:
    """Await an agent's episode, its ``SystemExit`` or ``KeyboardInterrupt`` an :class:`_AgentExit`."""
    try:
        return await call
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, GeneratorExit: the agent's
        raise _AgentExit(exc) from exc


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(value)


def timed_out(timeout: float) -> str:
    """Why an episode whose agent's own time ran past ``timeout`` failed."""
    return (f"timed out after {timeout:g} s of its own time (rollout.agent.timeout_s; the time its requests waited "
            "for the policy's answers does not count)")


@dataclass
class EpisodeClock:
    """One episode's time: its agent's own, and the time its requests waited at the endpoint for
    the policy's answers (queued behind other episodes' ``generate`` calls, then their own),
    which ``rollout.agent.timeout_s`` does not count. One endpoint thread at a time writes the
    waits (an episode has one request at a time); the agents' loop and the runner read them. A
    wait is added to ``waited`` before the running one is cleared, and read the other way
    round, so a reader never takes a wait for the agent's own time."""

    started: float | None = None
    ended: float | None = None
    waited: float = 0.0  # seconds of the finished waits
    waiting_since: float | None = None  # when the request waiting now was queued

    def start(self) -> None:
        self.started = time.monotonic()

    def stop(self) -> None:
        if self.ended is None:
            self.ended = time.monotonic()

    def wait_begins(self) -> None:
        self.waiting_since = time.monotonic()

    def wait_ends(self) -> None:
        since = self.waiting_since
        if since is not None:
            self.waited += time.monotonic() - since
            self.waiting_since = None

    def wait(self, now: float | None = None) -> float:
        """Seconds its requests waited for the policy so far (the one waiting now included)."""
        since = self.waiting_since
        now = self._now(now)
        return self.waited + (max(0.0, now - since) if since is not None else 0.0)

    def own(self, now: float | None = None) -> float:
        """Seconds of the agent's own since it started: wall time less :meth:`wait`."""
        if self.started is None:
            return 0.0
        now = self._now(now)
        return max(0.0, now - self.started - self.wait(now))

    def _now(self, now: float | None) -> float:
        now = time.monotonic() if now is None else now
        return now if self.ended is None else min(now, self.ended)


@dataclass
class Job:
    """A request waiting for the policy: the context ids, the tokens it may take, its stop
    strings and choices; filled with the choices by the runner."""

    episode: Any  # the runner's live episode
    prompt: list[int]
    want: int
    stop: tuple[str, ...]
    n: int
    choices: list[dict[str, Any]] | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class JobQueue:
    """Requests from the endpoint's threads to the runner's, with the wait for more."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.jobs: list[Job] = []

    def submit(self, job: Job) -> None:
        with self.cond:
            self.jobs.append(job)
            self.cond.notify_all()

    def poke(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def take(self, window: float, running, over) -> list[Job]:
        """The waiting requests, once every running episode waits or ``window`` seconds after
        the first; empty when ``over()`` (nothing will come) or after a second of quiet."""
        with self.cond:
            self.cond.wait_for(lambda: self.jobs or over(), timeout=1.0)
            if not self.jobs:
                return []
            first = time.monotonic()
            self.cond.wait_for(lambda: len(self.jobs) >= running(), timeout=max(0.0, first + window - time.monotonic()))
            jobs, self.jobs = self.jobs, []
            return jobs
