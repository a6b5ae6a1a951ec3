"""Adapter-only LoRA pushes (``lora_push``): what the ``vllm`` and ``vllm-server`` backends
send after each optimizer step when the policy is a peft LoRA model that vLLM's LoRA support
can load.

The engine gets the base weights once (:func:`base_weights`, at setup and after a resume)
and each push after that is the adapter alone, written in peft's adapter format to a
folder per version (:class:`AdapterVersions`) and loaded by vLLM as a ``LoRARequest``: about
``2 * r / hidden`` of the merged push's bytes. :func:`adapter_obstacle` says why a policy
cannot go as an adapter (the merged path then stays); :func:`choose_push` makes the choice of
``lora_push: auto|adapter|merged``. vLLM is imported by the caller, never here.

For rollout servers the adapter's tensors travel over the weight channel and each server's
workers write them in peft's format to a folder of their own machine
(:func:`adapter_root`, :func:`write_adapter`), which the server's ``/v1/load_lora_adapter``
then loads; :func:`server_obstacle` says why a server cannot take them (not started with
``--enable-lora``, a smaller ``--max-lora-rank`` or ``--max-loras``). The learner sends the
adapter in buckets (:func:`pending_adapter`, made tensor by tensor); a server's worker holds
the parts until the last and writes the folder then.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from grpo_plugins.rollout.weights import PendingWeight, pending_weights
from torch import Tensor, nn

__all__ = ["VLLM_LORA_RANKS", "AdapterVersions", "adapter_config", "adapter_obstacle", "adapter_rank", "adapter_root",
           "adapter_state", "base_weights", "choose_push", "engine_rank", "pending_adapter", "server_obstacle",
           "write_adapter"]

#: The ranks vLLM 0.32 accepts as ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def adapter_obstacle(model: Any) -> str | None:
    """Why the peft ``model``'s active adapter cannot be loaded by vLLM as a LoRA adapter
    (None when it can): not a LoRA adapter, ``modules_to_save``, DoRA, ``lora_bias``, a
    4-bit (QLoRA) base (the engine holds the dequantized base; the merged push sends what
    the trainer computes with), a rank above vLLM's largest, or a target that is not a
    linear layer (vLLM's LoRA covers linear layers of its models)."""
    if not _is_peft(model):
        return "the policy has no LoRA adapter"
    config = model.peft_config[model.active_adapter]
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        return f"the adapter is {config.peft_type}, not LoRA"
    if config.modules_to_save:
        return f"the adapter has modules_to_save {sorted(config.modules_to_save)}"
    if getattr(config, "use_dora", False):
        return "the adapter uses DoRA"
    if getattr(config, "lora_bias", False):
        return "the adapter has lora_bias"
    if any(getattr(getattr(m, "weight", None), "quant_state", None) is not None for m in model.modules()):
        return "the base is quantized in 4 bits (QLoRA)"
    ranks = [int(config.r), *map(int, (getattr(config, "rank_pattern", None) or {}).values())]
    if max(ranks) > VLLM_LORA_RANKS[-1]:
        return f"rank {max(ranks)} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}"
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if base is not None and hasattr(module, "lora_A") and not isinstance(base, nn.Linear):
            kind = type(base).__name__
            return f"target module {name.removeprefix('base_model.model.')} is a {kind}, not a linear layer"
    return None


def server_obstacle(url: str, lora: dict[str, Any] | None, rank: int, keep: int) -> str | None:
    """Why the server at ``url`` cannot load the adapter of rank ``rank`` with ``keep``
    versions loaded at once (None when it can). ``lora``: what its workers report of its LoRA
    settings (``grpo_server_info``): None when it was not started with ``--enable-lora``,
    else ``max_lora_rank``, ``max_loras`` and ``runtime_updates`` (vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, which ``grpo-run serve`` sets with ``--enable-lora``)."""
    if lora is None:
        return f"the server {url} was not started with LoRA (grpo-run serve MODEL -- --enable-lora)"
    if not lora.get("runtime_updates", False):
        return (f"the server {url} does not load adapters at run time (start it with grpo-run serve, which sets "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING with --enable-lora)")
    if int(lora.get("max_lora_rank", 0)) < rank:
        return f"the server {url} has --max-lora-rank {lora.get('max_lora_rank')}, below the adapter's rank {rank}"
    if int(lora.get("max_loras", 0)) < keep:
        return (f"the server {url} has --max-loras {lora.get('max_loras')}, fewer than the {keep} adapter versions "
                "the staleness bound keeps loaded (rollout.max_staleness + 1)")
    return None


def choose_push(option: str, model: Any, servers: list[str | None] = (), backend: str = "vllm") -> tuple[str, str]:
    """``("adapter" | "merged", reason)`` for ``lora_push`` ``option`` and the policy.

    ``auto`` pushes the adapter when :func:`adapter_obstacle` finds none (nor any of
    ``servers``, each server's :func:`server_obstacle`); ``adapter`` raises where there is
    one, naming it; ``merged`` always merges."""
    obstacle = adapter_obstacle(model)
    if option == "merged":
        return "merged", "lora_push: merged"
    if obstacle is None:
        obstacle = next((o for o in servers if o is not None), None)
    if obstacle is None:
        return "adapter", f"lora_push: {option}"
    if option == "adapter":
        raise ValueError(
            f"{backend} rollout: lora_push: adapter, but {obstacle}, so vLLM cannot load it as a LoRA adapter; "
            "set rollout.lora_push: merged (or auto, which merges then)"
        )
    return "merged", f"lora_push: auto, and {obstacle}"


def engine_rank(model: Any) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds the adapter's rank."""
    rank = adapter_rank(model)
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def adapter_rank(model: Any) -> int:
    """The largest rank of the peft ``model``'s active adapter (``r`` or its ``rank_pattern``)."""
    config = model.peft_config[model.active_adapter]
    return max([int(config.r), *map(int, (getattr(config, "rank_pattern", None) or {}).values())])


def adapter_state(model: Any) -> dict[str, Tensor]:
    """The active adapter's tensors as peft's ``save_pretrained`` writes them, each whole and
    on the CPU: a sharded (fsdp2) adapter is gathered, so every process calls this in step
    (as the merged push gathers its weights). The LoRA tensors only: peft would add the whole
    (frozen) output layer when ``lm_head`` is a target (``save_embedding_layers``), which the
    engine holds already from the base push."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=model.active_adapter, save_embedding_layers=False)
    return {k: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().contiguous().cpu()
            for k, t in state.items()}


def pending_adapter(model: Any) -> list[PendingWeight]:
    """The active adapter's tensors (:func:`adapter_state`'s names), each made whole (a
    sharded one gathered) only when its ``load`` is called: what a streamed adapter push
    sends bucket by bucket."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=model.active_adapter, save_embedding_layers=False)

    def load(t: Tensor) -> Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().contiguous()

    return [PendingWeight(k, tuple(t.shape), t.dtype, hasattr(t, "full_tensor"), lambda t=t: load(t))
            for k, t in state.items()]


def adapter_config(model: Any) -> dict[str, Any]:
    """The active adapter's ``adapter_config.json``, as a JSON-ready dict."""
    config = model.peft_config[model.active_adapter]
    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def adapter_root(token: str) -> str:
    """The folder of a rollout server's adapter versions for the weight channel whose token is
    ``token``: in the machine's temporary folder, named by a hash of the token (the same in
    every worker of the server; the token itself is not shown)."""
    digest = hashlib.sha256(token.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"grpo-adapters-{digest}")


def write_adapter(folder: str, tensors: dict[str, Tensor], config: dict[str, Any]) -> str:
    """``tensors`` and ``config`` in peft's adapter format in ``folder`` (made if needed), each
    file written whole then renamed into place (workers of one machine write the same files);
    ``folder``."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    suffix = f".{os.getpid()}.tmp"
    weights = os.path.join(folder, "adapter_model.safetensors")
    save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, weights + suffix,
              metadata={"format": "pt"})
    os.replace(weights + suffix, weights)
    with open(os.path.join(folder, "adapter_config.json") + suffix, "w", encoding="utf-8") as out:
        json.dump(config, out)
    os.replace(os.path.join(folder, "adapter_config.json") + suffix, os.path.join(folder, "adapter_config.json"))
    return folder


def base_weights(model: Any) -> Iterator[tuple[str, Tensor]]:
    """The peft ``model``'s base weights as the base model names them, without the adapter
    (what the engine's LoRA layers add the adapter to), made one at a time
    (:func:`~grpo_plugins.rollout.weights.pending_weights` with ``base_only``)."""
    return ((w.name, w.load()) for w in pending_weights(model, base_only=True))


class AdapterVersions:
    """The adapter of each push in ``folder/v<n>`` (peft's adapter format: its config and
    ``adapter_model.safetensors``, the adapter only), the last ``keep`` of them on disk: a
    rollout sampled under a staleness bound ``k`` may name any of the last ``k + 1`` versions."""

    def __init__(self, folder: str, keep: int):
        if keep < 1:
            raise ValueError(f"AdapterVersions: keep must be at least 1, got {keep}")
        self.folder, self.keep = folder, keep
        self.version = 0
        self.kept: list[int] = []

    def path(self, version: int) -> str:
        return os.path.join(self.folder, f"v{version}")

    def save(self, model: Any) -> tuple[int, str, int, list[int]]:
        """Write the next version; ``(version, its folder, the adapter file's bytes, the
        versions dropped)``."""
        from safetensors.torch import save_file

        self.version += 1
        path = self.path(self.version)
        os.makedirs(path, exist_ok=True)
        state = adapter_state(model)
        save_file(state, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        model.peft_config[model.active_adapter].save_pretrained(path)
        size = os.path.getsize(os.path.join(path, "adapter_model.safetensors"))
        self.kept.append(self.version)
        dropped = self.kept[: -self.keep]
        self.kept = self.kept[-self.keep :]
        for old in dropped:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return self.version, path, size, dropped
