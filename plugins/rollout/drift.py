"""A rollout server whose generation slows down as the run goes on, named in the log (issue 60,
item 5: one long-lived ``grpo-run serve`` server went from about 6 to 20 s a batch over three runs,
while the run said nothing).

What is measured, per server and per rollout call (one ``generate``: a step's batch, an
evaluation's, or one round of a partial rollout's continuations): the seconds that server spent
answering, over the decode steps it needed. The seconds are the union of its requests' intervals
(from sending one until its checked answer is in), so the requests a server runs at once count
once, and a weight push during which none of its requests was in flight counts not at all. The
decode steps: a server decodes the sequences it runs at once in parallel, one token each per
step, so requests that overlap in time take as many steps as their longest completion, and
requests one after the other the sum (:func:`decode_steps`).

Seconds per decode step is a server's speed whatever the lengths of the completions, as long as
its batch is of a similar size (a failover that hands a server a dead one's prompts changes that,
and so does an evaluation batch of another size: the medians below let a few such calls pass).
Seconds per generated token is not: as a policy learns to answer shorter, a batch's total tokens
fall while its longest completion, and so its time, stays; a soak on an idle machine (issue 60)
saw that figure rise 4x over a run whose batches took the same 13-15 s throughout.

A server's **early** figure is the median of its first ``window`` calls, its **recent** one the
median of its last ``window`` calls (once it has ``2 * window``). When recent exceeds ``bound``
times early, a warning names the server, both figures and the setting that controls it; it is
not repeated while the server stays past the bound, and once the server is back within it an
info line says so, so that a new crossing warns again. Standard library only.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import threading

__all__ = ["GenerationDrift", "busy_seconds", "decode_steps"]


def decode_steps(requests: list[tuple[float, float, int]]) -> int:
    """The decode steps ``(start, end, longest)`` requests took: the largest ``longest`` of
    each run of requests that overlap in time, summed over the runs."""
    total, reach, group = 0, float("-inf"), 0
    for start, end, longest in sorted(requests):
        if start >= reach:  # a new run of overlapping requests
            total, group = total + group, 0
        group, reach = max(group, longest), max(reach, end)
    return total + group


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: the time at least one was open."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def machine_load() -> str:
    """This machine's load average over one minute against its cores, as a phrase."""
    try:
        one = os.getloadavg()[0]
    except OSError:
        return "load average unknown"
    return f"load average {one:.1f} on {os.cpu_count()} cores"


class GenerationDrift:
    """The seconds per decode step of each server of a backend (``backend``, for the log),
    call by call, and the warning when a server's recent figure passes ``bound`` times its early one
    (``bound`` 0: never; ``window`` calls make each figure). :meth:`record` is called from the
    request threads, :meth:`close_call` by the caller once a rollout call's answers are all in."""

    def __init__(self, backend: str, bound: float, window: int):
        self.backend, self.bound, self.window = backend, bound, window
        self.early: dict[str, list[float]] = {}
        self.recent: dict[str, collections.deque[float]] = {}
        self.past: set[str] = set()  # servers past the bound, warned once
        self._call: dict[str, list[tuple[float, float, int]]] = {}
        self._lock = threading.Lock()
        self.log = logging.getLogger(f"grpo.rollout.{backend}")

    def record(self, url: str, start: float, end: float, longest: int) -> None:
        """One answered request of the current call: sent at ``start``, its answer in at ``end``
        (``time.monotonic()``), ``longest`` the tokens its longest completion generated."""
        with self._lock:
            self._call.setdefault(url, []).append((start, end, longest))

    def close_call(self) -> dict[str, float]:
        """End the current call: each server's seconds per decode step in it (servers that
        generated no token are left out), added to its figures and checked against the bound."""
        with self._lock:
            call, self._call = self._call, {}
        figures = {}
        for url, requests in call.items():
            steps = decode_steps(requests)
            if steps:
                figures[url] = busy_seconds([(s, e) for s, e, _ in requests]) / steps
                self._add(url, figures[url])
        return figures

    def _add(self, url: str, seconds_per_step: float) -> None:
        early = self.early.setdefault(url, [])
        if len(early) < self.window:
            early.append(seconds_per_step)
            return
        recent = self.recent.setdefault(url, collections.deque(maxlen=self.window))
        recent.append(seconds_per_step)
        if self.bound and len(recent) == self.window:
            self._check(url, statistics.median(early), statistics.median(recent))

    def _check(self, url: str, early: float, recent: float) -> None:
        past = recent > self.bound * early
        if past and url not in self.past:
            self.past.add(url)
            self.log.warning(
                "%s rollout: %s generates %.1fx slower than at the start of the run: %.3g s per decode step "
                "over its last %d rollout calls (median) against %.3g s over its first %d, past the bound of %gx "
                "(rollout.drift_bound; 0 turns this warning off). First check its machine's load (this "
                "process's machine: %s): a server whose machine became busy slows with it and recovers when the "
                "load goes, and a restart does not help. A server that slows down on an idle machine: restart it "
                "(grpo-run serve) between runs; see the vLLM guide, 'A server that slows down'",
                self.backend, url, recent / early, recent, self.window, early, self.window, self.bound, machine_load())
        elif not past and url in self.past:
            self.past.discard(url)
            self.log.info("%s rollout: %s is back within %gx its early generation time (%.3g s per decode step "
                          "against %.3g; rollout.drift_bound)", self.backend, url, self.bound, recent, early)
