"""What a backend of rollout servers addressed by URL shares, whatever their engine (``vllm-server``:
:mod:`grpo_plugins.vllm.server`): a server's URL checked (:func:`check_url`), a step's prompts
split over the servers (:func:`assign_prompts`), which servers are live and where a dropped
one's prompts go (:class:`Failover`), what a failing server raises (:class:`ServerFault`), this
process's rank (:func:`process_rank`) and the launch's prefix of weight versions
(:func:`launch_tag`), and the base class of such a backend (:class:`ServerPool`): requests
spread over the live servers, an action on every server at once, a failing one dropped.
Standard library only.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from grpo_core.errors import RunError

__all__ = ["Failover", "ServerFault", "ServerPool", "assign_prompts", "check_url", "launch_tag", "process_rank"]


class ServerFault(Exception):
    """A server did not answer (refused, timed out, an HTTP error, a broken weight channel) or
    answered what the request cannot have produced."""


def check_url(url: str) -> str:
    """``url`` without a trailing slash, if it is ``http(s)://host:port`` (a path prefix is
    kept, as behind a proxy); else a ``ValueError`` saying what is valid."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.query:
        raise ValueError(
            f"{url!r} is not a server URL: write http://HOST:PORT (e.g. http://127.0.0.1:8000, "
            "the address grpo-run serve prints)"
        )
    return url.rstrip("/")


def assign_prompts(n_prompts: int, n_servers: int) -> list[int]:
    """The server index of each of ``n_prompts`` prompts: contiguous parts whose sizes differ
    by at most one, the larger ones first (prompt ``i`` goes to ``floor(i * S / P)`` with
    the remainder spread)."""
    if n_servers < 1:
        raise ValueError("assign_prompts: needs at least one server")
    base, extra = divmod(n_prompts, n_servers)
    owners: list[int] = []
    for s in range(n_servers):
        owners += [s] * (base + (s < extra))
    return owners


class Failover:
    """Which servers are live, why the others were dropped, and where a dropped server's
    prompts go: to the live servers in turn, in URL order."""

    def __init__(self, urls: list[str], backend: str):
        self.urls, self.backend = list(urls), backend
        self.dropped: dict[str, str] = {}

    def live(self) -> list[str]:
        return [u for u in self.urls if u not in self.dropped]

    def drop(self, url: str, why: str) -> None:
        if url not in self.dropped:
            self.dropped[url] = why
            logging.getLogger(f"grpo.rollout.{self.backend}").warning(
                "%s rollout: dropping %s for the rest of the run: %s", self.backend, url, why)

    def reassign(self, prompts: list[int]) -> dict[int, str]:
        """``prompts`` (indices) spread over the live servers, or a :class:`RunError` when
        none is left, naming every server and what failed."""
        live = self.live()
        if not live:
            raise RunError(self.failure())
        return {p: live[k % len(live)] for k, p in enumerate(prompts)}

    def failure(self) -> str:
        lines = "; ".join(f"{u}: {self.dropped.get(u, 'live')}" for u in self.urls)
        return f"{self.backend} rollout: no rollout server is left ({lines})"


def process_rank() -> int:
    """This process's rank in the launch (0 without a process group): rank 0 pushes."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def launch_tag() -> str:
    """A prefix of the weight versions pushed, the same in every process of one launch and
    new at the next (a server may still hold the previous run's versions): the launcher's
    rendezvous address and run id, or a random one for a single process."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        keys = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
        return ":".join(os.environ.get(k, "") for k in keys) + "/"
    return uuid.uuid4().hex[:12] + "/"


class ServerPool:
    """The servers of a backend addressed by URL (its base class): it reads the backend's
    ``clients`` (URL -> client, whose ``complete(body, expected)`` answers one request or raises
    :class:`ServerFault`, and whose ``model`` is the server's model name), ``failover`` and
    ``serving`` (the model name requests sample with; "" for the server's own) and ``drift`` (a
    :class:`~grpo_plugins.rollout.drift.GenerationDrift`: each answer's seconds and tokens are
    recorded there, and each rollout call closed, so that a server whose generation slows down
    is named in the log)."""

    def _complete(self, requests: list[tuple[dict[str, Any], Any]]) -> list[Any]:
        """Each request's checked answer, in order; the requests of a server that fails (no
        answer, or an answer the request cannot have produced, after its retries) move to
        the live ones."""
        live = self.failover.live()
        if not live:
            raise RunError(self.failover.failure())
        todo = {i: live[s] for i, s in enumerate(assign_prompts(len(requests), len(live)))}
        results: list[Any] = [None] * len(requests)
        while todo:
            failed: list[int] = []
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(todo), 64)) as pool:
                futures = {pool.submit(self._ask, url, *requests[i]): (i, url) for i, url in todo.items()}
                for future in concurrent.futures.as_completed(futures):
                    i, url = futures[future]
                    try:
                        results[i] = future.result()
                    except ServerFault as exc:
                        self.failover.drop(url, str(exc))
                        failed.append(i)
            todo = self.failover.reassign(sorted(failed)) if failed else {}
        self.drift.close_call()
        return results

    def _ask(self, url: str, body: dict[str, Any], expected: Any, serving: str | None = None) -> Any:
        """``body`` to the server at ``url``, naming ``serving`` (an adapter version), else the
        one requests name now, else the server's model."""
        if url in self.failover.dropped:  # dropped while this request waited
            raise ServerFault(self.failover.dropped[url])
        client = self.clients[url]
        start = time.monotonic()
        answer = client.complete({**body, "model": serving or self.serving or client.model}, expected)
        self.drift.record(url, start, time.monotonic(), max((len(c.token_ids) for c in answer.outputs), default=0))
        return answer

    def _each(self, action, what: str, *, required: bool = True) -> None:
        """Run ``action(client)`` on every live server at once; drop those that fail. With
        none left, a :class:`RunError` if ``required``, else a warning (the error comes
        with the next rollout)."""
        live = self.failover.live()
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
            for future in [pool.submit(self._guard, u, action, what) for u in live]:
                future.result()
        if not self.failover.live():
            if required:
                raise RunError(self.failover.failure())
            logging.getLogger(f"grpo.rollout.{self.failover.backend}").warning(
                "%s; the next rollout will fail", self.failover.failure())

    def _guard(self, url: str, action, what: str) -> None:
        try:
            action(self.clients[url])
        except ServerFault as exc:
            self.failover.drop(url, f"{what}: {exc}")
