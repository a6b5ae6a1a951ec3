"""The engines tinker-serve samples with (``--rollout``).

- ``hf`` (the default): grpo-core's ``hf`` rollout backend generates with the served model
  itself, a sampler snapshot loaded as a PEFT adapter of its own
  (:mod:`~grpo_plugins.tinker.sampling`); the sampled tokens' log-probs come from one forward
  pass after.
- ``vllm`` (a vLLM engine in the server's process) and ``vllm-server`` (``grpo-run serve``
  servers addressed by URL): grpo-core's backends of those names, started with the server. They
  get the base weights once, whole; each sampler snapshot goes to them as a LoRA adapter of its
  own (the backend's adapter push, about ``2 r / hidden`` of the weights' bytes) the first time
  it is sampled, and stays loaded: up to ``--max-loras`` at once, the least recently pushed
  dropped first (pushed again if sampled again). The sampled tokens' log-probs are the
  engine's, at the sampling temperature, as Tinker's sampler returns them; prompt log-probs
  (``compute_logprobs``) stay one forward pass of the served model, the snapshot loaded.

So that the engine starts in adapter mode before any training client exists, the served model
gets one reserved adapter (:data:`RESERVED`, rank 1, attention only, never trained: its zero
``B`` makes it the base model), pushed at start.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grpo_core.contracts import RolloutBatch, RolloutSetup, SamplingParams
from grpo_core.errors import UsageError

__all__ = ["DEFAULT_MAX_LORAS", "DEFAULT_MAX_LORA_RANK", "ENGINES", "RESERVED", "EnginePlan", "EngineSampler",
           "engine_plan"]

#: What ``--rollout`` takes.
ENGINES = ("hf", "vllm", "vllm-server")
#: The adapter that puts an engine in adapter mode at start (see the module docstring).
RESERVED = "tinker-base"
#: ``--max-lora-rank`` and ``--max-loras`` when not given.
DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS = 32, 4


def _option(pair: str) -> tuple[str, Any]:
    key, sep, value = pair.partition("=")
    if not sep or not key:
        raise UsageError(f"--rollout-option {pair!r}: write KEY=VALUE (e.g. max_model_len=4096)")
    return key.strip(), yaml.safe_load(value)


@dataclass(frozen=True)
class EnginePlan:
    """What :class:`EngineSampler` starts: the backend's name and options and its LoRA slots."""

    name: str
    options: BaseModel
    max_loras: int
    max_lora_rank: int


def engine_plan(args: argparse.Namespace) -> EnginePlan | None:
    """The ``vllm`` or ``vllm-server`` engine for tinker-serve's ``args`` (None for ``hf``),
    checked before the model loads: ``--rollout-option KEY=VALUE`` pairs checked by the
    backend's own schema, with what tinker-serve needs set over them (adapter pushes, a push at
    every call, the servers of ``--server``, the engine's LoRA slots from ``--max-lora-rank``
    and ``--max-loras``)."""
    defaults = {"rollout": "hf", "rollout_options": [], "servers": [], "max_lora_rank": DEFAULT_MAX_LORA_RANK,
                "max_loras": DEFAULT_MAX_LORAS}  # for a Namespace made without configure's parser
    args = argparse.Namespace(**{**defaults, **vars(args)})
    pairs = dict(_option(p) for p in args.rollout_options)
    if args.rollout == "hf":
        if pairs or args.servers:
            raise UsageError("--rollout-option and --server are for --rollout vllm or vllm-server; "
                             "the hf backend takes none")
        return None
    from grpo_plugins.rollout.adapter import VLLM_LORA_RANKS

    if args.max_lora_rank not in VLLM_LORA_RANKS:
        raise UsageError(f"--max-lora-rank {args.max_lora_rank}: vLLM takes one of {list(VLLM_LORA_RANKS)}")
    if args.max_loras < 2:
        raise UsageError(f"--max-loras {args.max_loras}: at least 2 (the reserved base adapter and one snapshot)")
    for fixed in ("lora_push", "push_every", "urls"):
        if fixed in pairs:
            raise UsageError(f"--rollout-option {fixed} is set by tinker-serve (it pushes every sampler snapshot as "
                             f"an adapter{'; name servers with --server' if fixed == 'urls' else ''})")
    if args.rollout == "vllm":
        from grpo_plugins.vllm.colocated import VLLMRolloutOptions as Options

        if args.servers:
            raise UsageError("--server is for --rollout vllm-server; --rollout vllm runs its engine in this process")
        kwargs = dict(pairs.pop("engine_kwargs", None) or {})
        pairs["engine_kwargs"] = {**kwargs, "max_lora_rank": args.max_lora_rank, "max_loras": args.max_loras}
        pairs["lora_push"] = "adapter"
    else:
        from grpo_plugins.vllm.server import VLLMServerOptions as Options

        if not args.servers:
            raise UsageError("--rollout vllm-server needs the servers: --server http://HOST:PORT (repeatable), each "
                             "started with grpo-run serve MODEL -- --enable-lora")
        pairs.update(urls=list(args.servers), lora_push="adapter", push_every=1)
    try:
        return EnginePlan(args.rollout, Options(**pairs), args.max_loras, args.max_lora_rank)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(options)'}: {e['msg']}" for e in exc.errors())
        raise UsageError(f"--rollout {args.rollout}: {problems} (--rollout-option KEY=VALUE takes the keys of the "
                         f"spec's rollout section for backend {args.rollout!r})") from None


class EngineSampler:
    """A ``vllm`` or ``vllm-server`` backend serving tinker-serve's samples (module docstring)."""

    def __init__(self, service: Any, plan: EnginePlan):
        self.service, self.name, self.options = service, plan.name, plan.options
        self.max_loras, self.max_lora_rank = plan.max_loras, plan.max_lora_rank
        self.backend: Any = None
        self.versions: dict[str, int] = {}  # sampler path -> the adapter version it was pushed as

    def start(self) -> None:
        """Give the served model its reserved adapter, start the backend, push the base weights."""
        if self.name == "vllm":
            from grpo_plugins.vllm.colocated import VLLMRollout

            self.backend = VLLMRollout(self.options)
        else:
            from grpo_plugins.vllm.server import VLLMServerRollout

            self.backend = VLLMServerRollout(self.options)
            self._check_servers()
        service = self.service
        service._add_adapter(RESERVED, {"rank": 1, "train_attn": True, "train_mlp": False, "train_unembed": False})
        service._use(RESERVED)
        self.backend.setup(RolloutSetup(model=service.model, tokenizer=service.tokenizer,
                                        max_staleness=self.max_loras - 1))
        self.backend.sample_with(None)

    def _check_servers(self) -> None:
        """Each server takes adapters at run time, of ``--max-lora-rank``, ``--max-loras`` at once."""
        from grpo_plugins.rollout.adapter import server_obstacle

        self.backend._each(lambda c: c.connect(), "did not answer as a grpo-run serve server")
        for url in self.backend.failover.live():
            lora = self.backend.clients[url].lora
            obstacle = server_obstacle(url, lora, 0, 0)
            if obstacle is None and int(lora.get("max_lora_rank", 0)) < self.max_lora_rank:
                obstacle = (f"the server {url} has --max-lora-rank {lora.get('max_lora_rank')}, below tinker-serve's "
                            f"--max-lora-rank {self.max_lora_rank}")
            if obstacle is None and int(lora.get("max_loras", 0)) < self.max_loras:
                obstacle = (f"the server {url} has --max-loras {lora.get('max_loras')}, fewer than tinker-serve's "
                            f"--max-loras {self.max_loras}")
            if obstacle is not None:
                raise UsageError(f"tinker-serve --rollout vllm-server: {obstacle}")

    def check_rank(self, rank: int) -> None:
        """Refuse a training client whose adapter the engine could not load."""
        from grpo_plugins.tinker.wire import Refused

        if rank > self.max_lora_rank:
            raise Refused(f"LoRA rank {rank} is above the sampling engine's --max-lora-rank {self.max_lora_rank} "
                          f"(tinker-serve --rollout {self.name})")

    def select(self, path: str | None, activate) -> None:
        """Sample with the snapshot at ``path`` (None: the base model), pushed as an adapter
        when the engine does not hold it: ``activate()`` makes it the served model's active
        adapter first. The push is logged for its training client."""
        if path is None:
            self.backend.sample_with(None)
            return
        version = self.versions.get(path)
        if version is None or version not in self.backend.loaded_versions():
            activate()
            start = time.perf_counter()
            pushed = self.backend.sync_weights(self.service.model)
            version = self.backend.loaded_versions()[-1]
            self.versions[path] = version
            self.service.track_push(path, float(pushed.bytes) if pushed is not None else 0.0,
                                    time.perf_counter() - start)
        self.backend.sample_with(version)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                 stop_ids: list[int] | None) -> RolloutBatch:
        """``n`` completions of each prompt with the selected weights, ``stop_ids`` (when given)
        in place of the model's end-of-sequence tokens."""
        eos = self.backend.eos_ids
        if stop_ids is not None:
            self.backend.eos_ids = stop_ids
        try:
            return self.backend.generate(prompts, n, sampling)
        finally:
            self.backend.eos_ids = eos
