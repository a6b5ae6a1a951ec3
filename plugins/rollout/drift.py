"""A rollout server whose generation slows down as the run goes on, named in the log (issue 60,
item 5: one long-lived ``grpo-run serve`` server went from about 6 to 20 s a batch over three runs,
while the run said nothing).

What is measured, per server and per rollout call (one ``generate``: a step's batch, an
evaluation's, or one round of a partial rollout's continuations): the seconds that server spent
answering, over the tokens it generated in that call. The seconds are the union of its requests'
intervals (from sending one until its checked answer is in), so the requests a server runs at once
count once, and a weight push during which none of its requests was in flight counts not at all.
Seconds per generated token is a server's throughput whatever the number of prompts it was given
or their lengths, as long as its batch is of a similar size (a failover that hands a server a
dead one's prompts changes that, and so does an evaluation batch of another size: the medians
below let a few such calls pass).

A server's **early** figure is the median of its first ``window`` calls, its **recent** one the
median of its last ``window`` calls (once it has ``2 * window``). When recent exceeds ``bound``
times early, a warning names the server, both figures and the setting that controls it; it is
not repeated while the server stays past the bound, and once the server is back within it an
info line says so, so that a new crossing warns again. Standard library only.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading

__all__ = ["GenerationDrift", "busy_seconds"]


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: the time at least one was open."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class GenerationDrift:
    """The seconds per generated token of each server of a backend (``backend``, for the log),
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

    def record(self, url: str, start: float, end: float, tokens: int) -> None:
        """One answered request of the current call: sent at ``start``, its answer in at ``end``
        (``time.monotonic()``), ``tokens`` generated tokens in it."""
        with self._lock:
            self._call.setdefault(url, []).append((start, end, tokens))

    def close_call(self) -> dict[str, float]:
        """End the current call: each server's seconds per generated token in it (servers that
        generated no token are left out), added to its figures and checked against the bound."""
        with self._lock:
            call, self._call = self._call, {}
        figures = {}
        for url, requests in call.items():
            tokens = sum(t for _, _, t in requests)
            if tokens:
                figures[url] = busy_seconds([(s, e) for s, e, _ in requests]) / tokens
                self._add(url, figures[url])
        return figures

    def _add(self, url: str, seconds_per_token: float) -> None:
        early = self.early.setdefault(url, [])
        if len(early) < self.window:
            early.append(seconds_per_token)
            return
        recent = self.recent.setdefault(url, collections.deque(maxlen=self.window))
        recent.append(seconds_per_token)
        if self.bound and len(recent) == self.window:
            self._check(url, statistics.median(early), statistics.median(recent))

    def _check(self, url: str, early: float, recent: float) -> None:
        past = recent > self.bound * early
        if past and url not in self.past:
            self.past.add(url)
            self.log.warning(
                "%s rollout: %s generates %.1fx slower than at the start of the run: %.3g s per generated token "
                "over its last %d rollout calls (median) against %.3g s over its first %d, past the bound of %gx "
                "(rollout.drift_bound; 0 turns this warning off). A server that slows down as it runs: restart it "
                "(grpo-run serve) between runs; see the vLLM guide, 'A server that slows down'",
                self.backend, url, recent / early, recent, self.window, early, self.window, self.bound)
        elif not past and url in self.past:
            self.past.discard(url)
            self.log.info("%s rollout: %s is back within %gx its early generation time (%.3g s per generated token "
                          "against %.3g; rollout.drift_bound)", self.backend, url, self.bound, recent, early)
