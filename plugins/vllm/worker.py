"""The server half of the weight push, loaded inside a vLLM rollout server started by
``grpo-run serve`` (never imported by the learner; it imports vLLM).

vLLM 0.32 has an API for trainers that update a server's weights: the routes
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights`` and
``/finish_weight_update`` (``vllm/entrypoints/rl/online/api_router.py``, served with
``VLLM_SERVER_DEV_MODE=1``) drive a *weight transfer engine* in every worker, chosen by
``--weight-transfer-config '{"backend": NAME}'`` from a registry that accepts new engines.
Its built-in engines are CUDA-only (``nccl`` builds vLLM's PyNccl communicator; ``ipc``
shares CUDA memory), so this module registers one more, ``grpo_torch``
(:class:`TorchWeightTransferEngine`), that receives over a plain ``torch.distributed``
group (:mod:`grpo_plugins.rollout.channel`: gloo on the CPU, NCCL on GPUs), which the
learner can join with PyTorch alone. Loading follows vLLM's own NCCL engine: checkpoint-
format weights through the model's ``load_weights`` between vLLM's layerwise-reload
``initialize`` and ``finalize``, so the post-processing vLLM applies after loading (its CPU
kernels repack every linear weight) is redone.

A push comes in buckets: one ``/update_weights`` per bucket between one start and one finish,
each tensor loaded as it arrives. Adapter-only LoRA pushes (``lora_push``) take the same
channel: the learner calls :meth:`WeightChannelExtension.grpo_receive_adapter` through
``/collective_rpc`` once per bucket and broadcasts its tensors; each worker holds the parts
and, at the last, writes them in peft's format to a folder of its machine
(:func:`grpo_plugins.rollout.adapter.write_adapter`), which the learner loads with vLLM's own
``/v1/load_lora_adapter``. The adapter goes through the channel rather than a path the
learner writes because a server on another machine cannot read the learner's disk.

The registration happens when vLLM imports this module as the worker extension
(``--worker-extension-cls grpo_plugins.vllm.worker.WeightChannelExtension``), in each
worker process, before the worker builds its transfer engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import torch
from grpo_plugins.rollout.adapter import adapter_root, write_adapter
from grpo_plugins.rollout.channel import BACKENDS, open_group, receive_deltas, receive_tensors
from grpo_plugins.rollout.delta import DeltaDecoder
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

__all__ = ["ENGINE_NAME", "TorchInitInfo", "TorchUpdateInfo", "TorchWeightTransferEngine", "WeightChannelExtension"]

#: The name of the engine in vLLM's ``WeightTransferEngineFactory``.
ENGINE_NAME = "grpo_torch"


@dataclasses.dataclass
class TorchInitInfo(WeightTransferInitInfo):
    """Where the learner's channel is: its store's ``host:port``, the group's size (1 +
    the server's workers), the rank of this server's first worker (1), the
    ``torch.distributed`` backend, the group's timeout in seconds and its token (the
    channel's prefix of keys in the store)."""

    host: str
    port: int
    world_size: int
    rank_offset: int = 1
    backend: str = "gloo"
    timeout_s: float = 300.0
    token: str = ""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"grpo_torch weight transfer: backend must be one of {BACKENDS}, got {self.backend!r}")


@dataclasses.dataclass
class TorchUpdateInfo(WeightTransferUpdateInfo):
    """One push: the names, dtype names and shapes of the tensors broadcast, in order; for a
    delta push (:func:`grpo_plugins.rollout.channel.delta_info`) also each tensor's count of
    changed elements sent (-1: whole), index dtype and checksum."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    counts: list[int] | None = None
    index_dtypes: list[str] | None = None
    checksums: list[int] | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("grpo_torch weight transfer: names, dtype_names and shapes differ in length")


class TorchWeightTransferEngine(WeightTransferEngine[TorchInitInfo, TorchUpdateInfo]):
    """Receives the learner's weights over a ``torch.distributed`` group (rank 0 the
    learner) and loads them with vLLM's layerwise reload, as its NCCL engine does."""

    init_info_cls = TorchInitInfo
    update_info_cls = TorchUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.decoder: DeltaDecoder | None = None  # the pushed weights as last received, for delta pushes
        self.adapters = ""  # the folder of the adapter versions pushed (lora_push), by channel
        self.adapter_parts: dict[str, torch.Tensor] = {}  # the parts received of an adapter version
        self.adapter_version: int | None = None  # ... of this version

    def init_transfer_engine(self, init_info: TorchInitInfo) -> None:
        """Join the learner's group as rank ``rank_offset + worker rank`` (tensor/pipeline
        parallel workers of one engine). A server with vLLM's internal data parallelism is
        refused: start one server per replica (the learner splits prompts over servers)."""
        if self.parallel_config.data_parallel_size > 1:
            raise ValueError(
                "grpo_torch weight transfer: --data-parallel-size > 1 is not supported; start one "
                "grpo-run serve per replica and list every URL in rollout.urls"
            )
        rank = init_info.rank_offset + self.parallel_config.rank
        self.adapters = adapter_root(init_info.token)
        self.group = open_group(
            init_info.host, init_info.port, rank, init_info.world_size, init_info.backend, init_info.timeout_s,
            init_info.token,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one push; waits for the device only where there is one (the
        base class's ``torch.accelerator.synchronize`` fails on a CPU-only host)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: TorchUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("grpo_torch weight transfer: /init_weight_transfer_engine was not called")
        info = dataclasses.asdict(update_info)
        if update_info.counts is None:
            for name, tensor in receive_tensors(self.group, info, self.device):
                self.model.load_weights([(name, tensor)])
            return
        # A delta push: each tensor rebuilt from this worker's copy of the last push (kept in the
        # checkpoint's names and layout, which the engine's repacked weights no longer are),
        # checked against the learner's checksum, then loaded whole. On a mismatch the rest of
        # the push is still received (the learner's broadcasts must all be matched) and nothing
        # more loaded; the copy is dropped, so only a full push can follow.
        if self.decoder is None:
            self.decoder = DeltaDecoder()
        failure: Exception | None = None
        for delta in receive_deltas(self.group, info, self.device):
            if failure is not None:
                continue
            try:
                tensor = self.decoder.decode(delta)
            except Exception as exc:  # DeltaMismatch: reported after the broadcasts end
                failure = exc
                continue
            self.model.load_weights([(delta.name, tensor)])
        if failure is not None:
            self.decoder = None
            raise failure

    def receive_adapter(self, info: dict[str, Any]) -> str | None:
        """Receive one part (bucket) of an adapter version (``info``:
        :func:`~grpo_plugins.rollout.channel.update_info`'s payload plus ``version``, ``config``,
        the adapter's ``adapter_config.json``, ``drop``, the versions the learner no longer
        keeps, and ``last``). The parts of a version are held until its last; then the whole
        adapter is written to ``<adapters>/v<version>`` and the dropped versions' folders
        removed: the folder written (None before the last part)."""
        if self.group is None:
            raise RuntimeError("grpo_torch weight transfer: /init_weight_transfer_engine was not called")
        version = int(info["version"])
        if self.adapter_version != version:  # a new version: an unfinished one's parts are dropped
            self.adapter_parts, self.adapter_version = {}, version
        self.adapter_parts.update((name, t.cpu()) for name, t in receive_tensors(self.group, info, self.device))
        if not info.get("last", True):
            return None
        tensors, self.adapter_parts, self.adapter_version = self.adapter_parts, {}, None
        folder = write_adapter(os.path.join(self.adapters, f"v{version}"), tensors, info["config"])
        for old in info.get("drop", []):
            shutil.rmtree(os.path.join(self.adapters, f"v{int(old)}"), ignore_errors=True)
        return folder

    def shutdown(self) -> None:
        self.group = None
        self.decoder = None
        self.adapter_parts = {}
        if self.adapters:
            shutil.rmtree(self.adapters, ignore_errors=True)


class WeightChannelExtension:
    """vLLM worker extension of a ``grpo-run serve`` server: importing it registers the
    ``grpo_torch`` weight transfer engine; :meth:`grpo_server_info` tells the learner
    (through vLLM's ``/collective_rpc``, one answer per worker) what it needs to push."""

    def grpo_server_info(self) -> dict[str, Any]:
        """This worker's weight transfer engine, model dtype (what pushes are cast to), rank and
        LoRA settings (None without ``--enable-lora``; else ``max_lora_rank``, ``max_loras`` and
        whether the server loads adapters at run time, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""
        from vllm import envs

        config = self.vllm_config  # type: ignore[attr-defined]  (the worker's)
        lora = config.lora_config
        return {
            "engine": type(getattr(self, "weight_transfer_engine", None)).__name__,
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "rank": int(config.parallel_config.rank),
            "lora": None if lora is None else {
                "max_lora_rank": int(lora.max_lora_rank), "max_loras": int(lora.max_loras),
                "runtime_updates": bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING),
            },
        }

    def grpo_receive_adapter(self, info: str) -> str | None:
        """Through ``/collective_rpc`` (whose arguments are strings): receive one part of an
        adapter version over the weight channel (``info``: its JSON payload) and, at its last
        part, write it to this machine's disk; the folder, which the learner hands to
        ``/v1/load_lora_adapter`` (None before the last part)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, TorchWeightTransferEngine):
            raise RuntimeError("grpo_receive_adapter: the server's weight transfer engine is not grpo_torch")
        return engine.receive_adapter(json.loads(info))


try:
    WeightTransferEngineFactory.register_engine(ENGINE_NAME, TorchWeightTransferEngine)
except ValueError:  # this process imported it before (the registry refuses a second entry)
    pass
