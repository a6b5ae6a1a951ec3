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

The first process of the launch pushes; the others take part in the gathers and wait until
their servers report the version. A server that fails during a push is dropped (the backend's
``_each``, through its :class:`~grpo_plugins.rollout.servers.Failover`).

:class:`ServerPushes` is the backend's base class, beside
:class:`~grpo_plugins.rollout.servers.ServerPool` (whose ``_each`` and ``_guard`` it calls): it
reads the backend's ``name``, ``options`` (``lora_push``, ``timeout_s``, ``delta_push``,
``weight_port``, ``weight_host``), ``clients``, ``failover``, ``tag``, ``pusher``, ``backend``,
``syncs`` and ``max_staleness``, and keeps ``version``, ``push``, ``loaded``, ``serving`` and
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
    adapter_state,
    base_weights,
    choose_push,
    server_obstacle,
)
from grpo_plugins.rollout.channel import local_address
from grpo_plugins.rollout.delta import DeltaEncoder, push_stats
from grpo_plugins.rollout.weights import cast_weights, policy_weights
from torch import Tensor

from grpo_core.contracts import WeightPush
from grpo_core.errors import RunError

__all__ = ["PushTarget", "ServerPushes"]

log = logging.getLogger("grpo.rollout.vllm-server")


class PushTarget(Protocol):
    """One rollout server as the pushes see it: its weights' dtype, its LoRA settings (None
    without LoRA), its end of the weight channel and the pushes it takes."""

    dtype: str  # the torch dtype name the server computes in
    lora: dict[str, Any] | None  # max_lora_rank, max_loras, runtime_updates; None: no LoRA

    def open_channel(self, host: str, port: int, backend: str, timeout_s: float) -> None: ...

    def push(self, weights: list[tuple[str, Tensor]], version: str, timeout_s: float) -> None: ...

    def push_deltas(self, deltas: list, version: str, timeout_s: float) -> None: ...

    def push_adapter(self, name: str, tensors: list[tuple[str, Tensor]], config: dict[str, Any], version: int,
                     drop: dict[int, str], timeout_s: float) -> None: ...

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

    def _push_base(self, model: Any) -> None:
        """The base weights, without the adapter (what the servers' LoRA layers add each
        adapter version to), pushed whole at setup: after a resume too, as a new run's."""
        self.version += 1
        version = f"{self.tag}{self.version}"
        with torch.no_grad():
            weights = [(n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in base_weights(model)]
            if not self.pusher:
                self._each(lambda c: c.wait_for_version(version, self.options.timeout_s),
                           "did not receive the first process's push")
                return
            by_dtype = self._cast(weights)
            self._each(lambda c: c.push(by_dtype[c.dtype], version, self.options.timeout_s),
                       "failed during the push of the base weights")
            # a previous run's versions (its learner gone) hold no slot of ours
            self._each(self._unload_strangers, "did not unload a previous run's adapters", required=False)

    def _unload_strangers(self, client: PushTarget) -> None:
        for name in client.adapters():
            if name.startswith("grpo-policy-") and name not in self.loaded.values():
                client.unload_adapter(name)

    def _push_adapter(self, model: Any) -> WeightPush | None:
        """The adapter alone, as the next version, to every live server; the versions beyond
        ``max_staleness + 1`` unloaded. Every process gathers the adapter (FSDP2's gathers
        are collectives); the first pushes it, the others wait until their servers list it.
        Requests sample with it from then on."""
        start = time.perf_counter()
        pushed = None
        self.version += 1
        name = f"grpo-policy-{self.tag.rstrip('/').replace('/', '-').replace(':', '-')}-v{self.version}"
        with torch.no_grad():
            state = adapter_state(model)
        keep = self.max_staleness + 1
        drop = {v: self.loaded[v] for v in sorted([*self.loaded, self.version])[:-keep]}
        if not self.pusher:
            self._each(lambda c: c.wait_for_adapter(name, self.options.timeout_s),
                       "did not receive the first process's adapter push", required=False)
        else:
            config = adapter_config(model)
            by_dtype = self._cast(list(state.items()))
            self._each(lambda c: c.push_adapter(name, by_dtype[c.dtype], config, self.version, drop,
                                                self.options.timeout_s),
                       "failed during an adapter push", required=False)
            pushed = WeightPush(bytes=self._bytes(by_dtype), seconds=time.perf_counter() - start)
            log.info("%s rollout: adapter push %s: %d bytes in %.2f s", self.name, name, pushed.bytes, pushed.seconds)
        for v in drop:
            self.loaded.pop(v)
        self.loaded[self.version] = name
        self.serving = name
        return pushed

    def _bytes(self, by_dtype: dict[str, list[tuple[str, Tensor]]]) -> float:
        """The bytes of a push to one server (the first live one's dtype)."""
        dtype = self.clients[self.failover.live()[0]].dtype if self.failover.live() else "float32"
        return float(sum(t.numel() * t.element_size() for _, t in by_dtype.get(dtype, [])))

    def _cast(self, weights: list[tuple[str, Tensor]]) -> dict[str, list[tuple[str, Tensor]]]:
        """``weights`` cast to each live server's dtype (on the CPU for gloo), once per dtype."""
        by_dtype: dict[str, list] = {}
        for client in (self.clients[u] for u in self.failover.live()):
            if client.dtype not in by_dtype:
                cast = cast_weights(weights, getattr(torch, client.dtype))
                by_dtype[client.dtype] = [(n, t.cpu() if self.backend == "gloo" else t) for n, t in cast]
        return by_dtype

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
        """Gather the weights once (every process: FSDP2's gathers are collectives), cast
        to each server's dtype, and push them from rank 0 to every live server at once, as
        weight version ``<launch tag><n>``. Rank 0 holds one whole copy during the push
        (none more when the policy is already in the servers' dtype on the CPU); the other
        processes keep nothing and wait until their live servers report that version
        (``/weight_info``), so none generates before the push or on a server that missed it.
        No collective of the learner's process group is used: in asynchronous training this
        runs in the actor's thread while the learner's runs its own. Rank 0 returns the
        push (whole or, with ``delta_push``, its delta's figures), the others None."""
        start = time.perf_counter()
        self.version += 1
        version = f"{self.tag}{self.version}"
        with torch.no_grad():
            if not self.pusher:
                for _ in policy_weights(model):  # take part in the gathers, keep nothing
                    pass
                self._each(lambda c: c.wait_for_version(version, self.options.timeout_s),
                           "did not receive the first process's push", required=False)
                return None
            by_dtype = self._cast(list(policy_weights(model)))
            if not self.options.delta_push:
                self._each(lambda c: c.push(by_dtype[c.dtype], version, self.options.timeout_s),
                           "failed during a weight push", required=False)
                pushed = WeightPush(bytes=self._bytes(by_dtype), seconds=time.perf_counter() - start)
                log.info("%s rollout: push %s: %d bytes in %.2f s", self.name, version, pushed.bytes, pushed.seconds)
                return pushed
            full = self.syncs <= 1  # whole at setup and at the first sync (after a resume, the checkpoint's)
            stats: dict[str, float] = {}
            for dtype, cast in by_dtype.items():
                by_dtype[dtype] = self.encoders.setdefault(dtype, DeltaEncoder()).encode(cast, full=full)
                stats = push_stats(by_dtype[dtype])
                log.info("%s rollout: push %s (%s): %d bytes sent of %d for a full push (%.2f%% of the elements, "
                         "%d tensors whole)", self.name, version, dtype, stats["bytes"], stats["full_bytes"],
                         100 * stats["elements_sent"], stats["tensors_whole"])
            self._each(lambda c: c.push_deltas(by_dtype[c.dtype], version, self.options.timeout_s),
                       "failed during a weight push", required=False)
            sent = float(stats.pop("bytes", 0.0))
            return WeightPush(bytes=sent, seconds=time.perf_counter() - start, figures=stats)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
