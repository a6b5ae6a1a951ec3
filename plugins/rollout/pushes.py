"""The weight pushes of a server backend (``vllm-server``: :mod:`~grpo_plugins.vllm.server`): the
policy's weights from the learner to every live server, over the weight channel each server
joined at setup (:mod:`~grpo_plugins.rollout.channel`), as a new weight version. Nothing here
knows the server's engine: each server is a :class:`PushTarget` (vLLM's:
:class:`grpo_plugins.vllm.client.ServerClient`).

Three kinds, chosen at setup:

- **merged** (:meth:`ServerPushes._push`): the whole policy (LoRA merged, FSDP2 gathered), cast
  to each server's dtype once per dtype; with ``delta_push`` only the elements that changed
  since the last push (:mod:`~grpo_plugins.rollout.delta`), whole at setup and after a resume;
- **adapter** (:meth:`ServerPushes._push_adapter`): a LoRA policy's adapter alone, loaded by the
  server as the next LoRA version, the base pushed whole once (:meth:`ServerPushes._push_base`);
  ``max_staleness + 1`` versions stay loaded;

- which of the two a LoRA policy gets (:meth:`ServerPushes._choose_push`,
  ``rollout.lora_push``).

Each is streamed (:meth:`ServerPushes._send`): every tensor is made as it is reached
(:func:`~grpo_plugins.rollout.weights.pending_weights`: gathered, dequantized, merged), cast, and
sent in buckets of at most ``push_bucket_mb`` (:func:`~grpo_plugins.rollout.weights.weight_buckets`):
one ``/update_weights`` per bucket between one start and one finish, so the pushing process
holds one bucket beyond its own weights (``sync/push_buffer_bytes``: the largest).

The first process of the launch pushes; the others take part in the gathers and wait until
their servers report the version. A server that fails during a push is dropped (the backend's
``_each``, through its :class:`~grpo_plugins.rollout.servers.Failover`).

:class:`ServerPushes` is the backend's base class, beside
:class:`~grpo_plugins.rollout.servers.ServerPool` (whose ``_each`` and ``_guard`` it calls): it
reads the backend's ``name``, ``options`` (``lora_push``, ``timeout_s``, ``delta_push``,
``push_bucket_mb``, ``weight_port``, ``weight_host``), ``clients``, ``failover``, ``tag``, ``pusher``,
``backend``, ``syncs`` and ``max_staleness``, and keeps ``version``, ``push``, ``loaded``, ``serving`` and
``encoders``. Every push returns its :class:`~grpo_core.contracts.WeightPush` (bytes to one
server, seconds, a delta push's figures) on the process that pushes, None on the others.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Protocol
from urllib.parse import urlsplit

import torch
from grpo_plugins.rollout.adapter import (
    adapter_config,
    adapter_obstacle,
    adapter_rank,
    choose_push,
    pending_adapter,
    server_obstacle,
)
from grpo_plugins.rollout.channel import local_address
from grpo_plugins.rollout.delta import DeltaEncoder, PushTally
from grpo_plugins.rollout.weights import PendingWeight, bucket_sizes, pending_weights, take_part, weight_buckets
from torch import Tensor

from grpo_core.contracts import WeightPush
from grpo_core.errors import RunError

__all__ = ["PushTarget", "ServerPushes"]

log = logging.getLogger("grpo.rollout.vllm-server")


class PushTarget(Protocol):
    """One rollout server as the pushes see it: its URL, its weights' dtype, its LoRA settings
    (None without LoRA), its end of the weight channel and the pushes it takes: a push is one
    start, its buckets, one finish; an adapter push is its parts (buckets), then a load."""

    url: str
    dtype: str  # the torch dtype name the server computes in
    lora: dict[str, Any] | None  # max_lora_rank, max_loras, runtime_updates; None: no LoRA

    def open_channel(self, host: str, port: int, backend: str, timeout_s: float) -> None: ...

    def start_push(self) -> None: ...

    def push_bucket(self, weights: list[tuple[str, Tensor]], timeout_s: float) -> None: ...

    def push_delta_bucket(self, deltas: list, timeout_s: float) -> None: ...

    def finish_push(self, version: str) -> None: ...

    def push_adapter_part(self, tensors: list[tuple[str, Tensor]], config: dict[str, Any], version: int,
                          drop: dict[int, str], last: bool, timeout_s: float) -> str | None: ...

    def load_adapter(self, name: str, folder: str, drop: dict[int, str]) -> None: ...

    def wait_for_version(self, version: str, timeout_s: float) -> None: ...

    def wait_for_adapter(self, name: str, timeout_s: float) -> None: ...

    def adapters(self) -> list[str]: ...

    def unload_adapter(self, name: str) -> None: ...


class ServerPushes:
    """The pushes of :class:`~grpo_plugins.vllm.server.VLLMServerRollout` (its base class)."""

    def _choose_push(self, model: Any) -> None:
        """``lora_push`` for a LoRA policy: the adapter alone where the adapter and every live
        server allow it (:func:`~grpo_plugins.rollout.adapter.choose_push`), said in the log."""
        keep = self.max_staleness + 1
        servers = []
        if adapter_obstacle(model) is None:
            rank = adapter_rank(model)
            servers = [server_obstacle(u, self.clients[u].lora, rank, keep) for u in self.failover.live()]
        self.push, reason = choose_push(self.options.lora_push, model, servers, backend=self.name)
        # a warning when auto falls back to the heavier push: the user sees why
        say = log.warning if self.push == "merged" and self.options.lora_push == "auto" else log.info
        say("vllm-server rollout: LoRA weight pushes send the %s (%s)",
            "adapter alone" if self.push == "adapter" else "full merged weights", reason)

    # ----------------------------------------------------------------- streaming
    def _bound(self) -> int:
        """The most bytes one bucket holds (``push_bucket_mb``)."""
        return max(1, int(self.options.push_bucket_mb * 2**20))

    def _dtypes(self) -> dict[str, torch.dtype]:
        """The live servers' dtypes (their names to torch's), the first live server's first;
        float32 when none is live (the gathers still run, every process in step)."""
        names = [self.clients[u].dtype for u in self.failover.live()] or ["float32"]
        return {n: getattr(torch, n) for n in dict.fromkeys(names)}

    def _buckets(self, pending: list[PendingWeight], dtypes: dict[str, torch.dtype]):
        """:func:`~grpo_plugins.rollout.weights.weight_buckets` of ``pending`` for these dtypes,
        on the CPU for gloo, each bucket keyed by dtype name."""
        device = "cpu" if self.backend == "gloo" else None
        by_torch = {t: n for n, t in dtypes.items()}
        for bucket in weight_buckets(pending, self._bound(), list(dtypes.values()), device):
            yield {by_torch[t]: tensors for t, tensors in bucket.items()}

    def _send(self, pending: list[PendingWeight], version: str, what: str, *, required: bool,
              delta: bool = False) -> tuple[float, dict[str, float]]:
        """One push of ``pending`` to every live server as weight version ``version``: a start,
        one bucket at a time (cast to each server's dtype; with ``delta`` only the changed
        elements, :mod:`~grpo_plugins.rollout.delta`), a finish. A server that fails is dropped
        (``what`` says where) and the next buckets go to the others. Returns the bytes sent to
        one server (the first live one's dtype) and the figures: the largest bucket
        (``buffer_bytes``, what the push held beyond the model) and a delta push's."""
        dtypes = self._dtypes()
        first = next(iter(dtypes))
        self._each(lambda c: c.start_push(), what, required=required)
        full = self.syncs <= 1  # whole at setup and at the first sync (after a resume, the checkpoint's)
        sent, buffer, tallies = 0.0, 0, {d: PushTally() for d in dtypes}
        for bucket in self._buckets(pending, dtypes):
            buffer = max(buffer, sum(t.numel() * t.element_size() for ts in bucket.values() for _, t in ts))
            if delta:
                bucket = {d: self.encoders.setdefault(d, DeltaEncoder()).encode(ts, full=full)
                          for d, ts in bucket.items()}
                for d, deltas in bucket.items():
                    tallies[d].add(deltas)
                self._each(lambda c, b=bucket: c.push_delta_bucket(b[c.dtype], self.options.timeout_s), what,
                           required=required)
            else:
                sent += sum(t.numel() * t.element_size() for _, t in bucket[first])
                self._each(lambda c, b=bucket: c.push_bucket(b[c.dtype], self.options.timeout_s), what,
                           required=required)
            for tensors in bucket.values():
                tensors.clear()  # sent: nothing of this bucket outlives it
            del bucket
        self._each(lambda c: c.finish_push(version), what, required=required)
        if not delta:
            return sent, {"buffer_bytes": float(buffer)}
        for dtype, tally in tallies.items():
            stats = tally.stats()
            log.info("%s rollout: push %s (%s): %d bytes sent of %d for a full push (%.2f%% of the elements, "
                     "%d tensors whole)", self.name, version, dtype, stats["bytes"], stats["full_bytes"],
                     100 * stats["elements_sent"], stats["tensors_whole"])
        stats = tallies[first].stats()
        return float(stats.pop("bytes")), {**stats, "buffer_bytes": float(buffer)}

    # ----------------------------------------------------------------- the pushes
    def _push_base(self, model: Any) -> None:
        """The base weights, without the adapter (what the servers' LoRA layers add each
        adapter version to), pushed whole at setup: after a resume too, as a new run's.
        Streamed in buckets like a merged push."""
        self.version += 1
        version = f"{self.tag}{self.version}"
        with torch.no_grad():
            pending = pending_weights(model, base_only=True)
            if not self.pusher:
                take_part(pending)
                self._each(lambda c: c.wait_for_version(version, self.options.timeout_s),
                           "did not receive the first process's push")
                return
            self._send(pending, version, "failed during the push of the base weights", required=True)
            # a previous run's versions (its learner gone) hold no slot of ours
            self._each(self._unload_strangers, "did not unload a previous run's adapters", required=False)

    def _unload_strangers(self, client: PushTarget) -> None:
        for name in client.adapters():
            if name.startswith("grpo-policy-") and name not in self.loaded.values():
                client.unload_adapter(name)

    def _push_adapter(self, model: Any) -> WeightPush | None:
        """The adapter alone, as the next version, to every live server, in buckets (each
        server's workers hold the parts and write the adapter at the last); the versions
        beyond ``max_staleness + 1`` unloaded. Every process makes the adapter's tensors
        (FSDP2's gathers are collectives); the first sends them, the others wait until their
        servers list it. Requests sample with it from then on."""
        start = time.perf_counter()
        pushed = None
        self.version += 1
        name = f"grpo-policy-{self.tag.rstrip('/').replace('/', '-').replace(':', '-')}-v{self.version}"
        pending = pending_adapter(model)
        keep = self.max_staleness + 1
        drop = {v: self.loaded[v] for v in sorted([*self.loaded, self.version])[:-keep]}
        with torch.no_grad():
            if not self.pusher:
                take_part(pending)
                self._each(lambda c: c.wait_for_adapter(name, self.options.timeout_s),
                           "did not receive the first process's adapter push", required=False)
            else:
                sent, buffer = self._send_adapter(pending, adapter_config(model), name, drop)
                pushed = WeightPush(bytes=sent, seconds=time.perf_counter() - start, figures={"buffer_bytes": buffer})
                log.info("%s rollout: adapter push %s: %d bytes in %.2f s", self.name, name, pushed.bytes,
                         pushed.seconds)
        for v in drop:
            self.loaded.pop(v)
        self.loaded[self.version] = name
        self.serving = name
        return pushed

    def _send_adapter(self, pending: list[PendingWeight], config: dict[str, Any], name: str,
                      drop: dict[int, str]) -> tuple[float, float]:
        """The adapter's buckets to every live server, then its load there: the bytes sent to
        one server and the largest bucket."""
        what = "failed during an adapter push"
        dtypes = self._dtypes()
        first = next(iter(dtypes))
        count = len(bucket_sizes(pending, self._bound(), list(dtypes.values())))
        folders: dict[str, str | None] = {}
        sent, buffer = 0.0, 0
        for k, bucket in enumerate(self._buckets(pending, dtypes)):
            last = k == count - 1
            buffer = max(buffer, sum(t.numel() * t.element_size() for ts in bucket.values() for _, t in ts))
            sent += sum(t.numel() * t.element_size() for _, t in bucket[first])

            def part(c: PushTarget, b=bucket, last=last) -> None:
                folders[c.url] = c.push_adapter_part(b[c.dtype], config, self.version, drop, last,
                                                     self.options.timeout_s)

            self._each(part, what, required=False)
            for tensors in bucket.values():
                tensors.clear()
            del bucket
        self._each(lambda c: c.load_adapter(name, folders[c.url], drop), what, required=False)
        return sent, float(buffer)

    def _open_channels(self) -> None:
        port = self.options.weight_port
        for k, url in enumerate(self.failover.live()):
            host = self.options.weight_host or local_address(urlsplit(url).hostname or "127.0.0.1")
            chosen = port + k if port else _free_port(host)
            self._guard(url, lambda c, h=host, p=chosen: c.open_channel(h, p, self.backend, self.options.timeout_s),
                        "did not join the weight channel")
        if not self.failover.live():
            raise RunError(self.failover.failure())

    def _push(self, model: Any) -> WeightPush | None:
        """Push the policy's weights from rank 0 to every live server at once, as weight
        version ``<launch tag><n>``, streamed: each tensor is made (gathered by every process
        under FSDP2: a collective; LoRA merged; dequantized) as it is reached, cast to each
        server's dtype and sent in buckets of at most ``push_bucket_mb``, so rank 0 holds one
        bucket beyond its own weights, never the whole model. The other processes take part
        in the gathers, keep nothing and wait until their live servers report that version
        (``/weight_info``), so none generates before the push or on a server that missed it.
        No collective of the learner's process group is used beyond the gathers: in
        asynchronous training this runs in the actor's thread while the learner's runs its
        own. Rank 0 returns the push (whole or, with ``delta_push``, its delta's figures,
        and its largest bucket), the others None."""
        start = time.perf_counter()
        self.version += 1
        version = f"{self.tag}{self.version}"
        with torch.no_grad():
            pending = pending_weights(model)
            if not self.pusher:
                take_part(pending)  # take part in the gathers, keep nothing
                self._each(lambda c: c.wait_for_version(version, self.options.timeout_s),
                           "did not receive the first process's push", required=False)
                return None
            sent, figures = self._send(pending, version, "failed during a weight push", required=False,
                                       delta=self.options.delta_push)
        pushed = WeightPush(bytes=sent, seconds=time.perf_counter() - start, figures=figures)
        if not self.options.delta_push:
            log.info("%s rollout: push %s: %d bytes in %.2f s (largest bucket %d bytes)", self.name, version,
                     pushed.bytes, pushed.seconds, figures["buffer_bytes"])
        return pushed


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
