"""The policy's weights as an inference engine wants them: the base model's parameter
names, with a LoRA adapter (peft) merged in, ``W + scaling * B @ A`` per layer, computed
from the state dict so that the training model itself is never modified
(:func:`policy_weights`), and cast to the engine's dtype (:func:`cast_weights`).

Used by the ``vllm`` and ``vllm-server`` rollout backends (:mod:`grpo_plugins.vllm`) for their
weight sync; any backend that keeps its own copy of the weights (another engine, a server)
can use it the same way. A helper, not a plugin: it registers nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["cast_weights", "dequantized_state", "vllm_weight_name", "lora_layout", "merge_lora", "policy_weights"]


_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")  # torch.compile, activation checkpointing


def vllm_weight_name(name: str, adapter: str = "default") -> str:
    """The base model's name of a state-dict key of a (peft-wrapped) policy:
    ``base_model.model.`` prefix, ``.base_layer`` and ``.modules_to_save.<adapter>`` removed."""
    name = name.removeprefix("base_model.model.")
    name = name.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def lora_layout(model: Any) -> tuple[str, dict[str, float], frozenset[str]]:
    """``(adapter, scalings, transposed)`` of a peft model's active LoRA adapter.

    ``scalings``: module name (as in ``named_modules``) -> ``lora_alpha / r`` (or its
    rsLoRA / pattern variant), for every LoRA layer not already merged; ``transposed``: the
    modules whose weight is stored ``(in, out)`` (``fan_in_fan_out``, GPT-2's Conv1D).
    """
    adapter = model.active_adapter
    if isinstance(adapter, (list, tuple)):
        if len(adapter) != 1:
            raise NotImplementedError(f"vllm rollout: one active LoRA adapter is supported, got {adapter}")
        adapter = adapter[0]
    scalings: dict[str, float] = {}
    transposed: set[str] = set()
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if not (isinstance(scaling, dict) and adapter in scaling and hasattr(module, "base_layer")):
            continue
        if adapter in (getattr(module, "lora_magnitude_vector", None) or {}):
            raise NotImplementedError("vllm rollout: DoRA adapters (use_dora) are not supported")
        if getattr(module, "lora_bias", {}).get(adapter, False):
            raise NotImplementedError("vllm rollout: LoRA adapters with lora_bias are not supported")
        if getattr(module, "merged", False):
            continue  # already in the base weight
        scalings[name] = float(scaling[adapter])
        if getattr(module, "fan_in_fan_out", False):
            transposed.add(name)
    return adapter, scalings, frozenset(transposed)


def _delta(state: Mapping[str, Tensor], module: str, adapter: str, scaling: float, transposed: bool) -> Tensor:
    """``scaling * B @ A`` of one LoRA layer, float32, in the base weight's layout."""
    linear = (f"{module}.lora_A.{adapter}.weight", f"{module}.lora_B.{adapter}.weight")
    embedding = (f"{module}.lora_embedding_A.{adapter}", f"{module}.lora_embedding_B.{adapter}")
    if linear[0] in state:
        a, b = state[linear[0]], state[linear[1]]
        if a.dim() != 2:
            raise NotImplementedError(f"vllm rollout: LoRA on {module} ({a.dim()}-d weight) is not supported")
        delta = b.float() @ a.float()  # (out, r) @ (r, in)
        return scaling * (delta.T if transposed else delta)
    if embedding[0] in state:
        a, b = state[embedding[0]], state[embedding[1]]  # (r, num_embeddings), (dim, r)
        return scaling * (b.float() @ a.float()).T
    raise KeyError(f"vllm rollout: no LoRA weights for {module} (adapter {adapter!r})")


def merge_lora(
    state: Mapping[str, Tensor],
    scalings: Mapping[str, float],
    adapter: str = "default",
    transposed: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, Tensor]]:
    """``(base model name, tensor)`` for every weight of a peft LoRA model's ``state``, with
    each LoRA layer merged: ``W + scaling * B @ A`` (computed in float32, returned in
    ``W``'s dtype; the transpose for ``transposed`` layers, ``(B @ A).T`` for embeddings).

    ``scalings`` and ``transposed`` come from :func:`lora_layout`. Adapter tensors,
    ``modules_to_save``' original copies and other adapters' tensors are left out; the
    trainable copies of ``modules_to_save`` take the original's name. Tensors are produced
    one at a time: nothing in ``state`` is modified.
    """
    suffix = ".base_layer.weight"
    for name, tensor in state.items():
        if ".lora_" in name or ".original_module." in name:
            continue
        if ".modules_to_save." in name and f".modules_to_save.{adapter}." not in name:
            continue
        module = name[: -len(suffix)] if name.endswith(suffix) else None
        if module is not None and module in scalings:
            delta = _delta(state, module, adapter, scalings[module], module in transposed)
            tensor = (tensor.float() + delta.to(tensor.device)).to(tensor.dtype)
        yield vllm_weight_name(name, adapter), tensor


def dequantized_state(model: Any) -> dict[str, Tensor]:
    """``model.state_dict()`` with each bitsandbytes 4-bit weight (QLoRA's base,
    ``model.quantization``) dequantized to the dtype it was loaded in, and its quantization
    constants (``weight.absmax``, ``weight.quant_map``, ...) left out: what an engine that
    loaded the full-precision base can take."""
    state = model.state_dict()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        quant = getattr(weight, "quant_state", None)
        if quant is None or f"{name}.weight" not in state:  # peft's LoRA layer shows its base's weight
            continue
        from bitsandbytes.functional import dequantize_4bit

        key = f"{name}.weight"
        for extra in [k for k in state if k.startswith(key + ".")]:
            del state[extra]
        state[key] = dequantize_4bit(weight.data, quant).to(quant.dtype)
    return state


def policy_weights(model: Any) -> Iterator[tuple[str, Tensor]]:
    """The policy's weights as the base model names them, LoRA merged (a peft model), a
    4-bit base dequantized (:func:`dequantized_state`); the whole tensors of a sharded
    (fsdp2) model, gathered lazily one by one."""
    quantized = any(getattr(getattr(m, "weight", None), "quant_state", None) is not None for m in model.modules())
    state = dequantized_state(model) if quantized else model.state_dict()
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        adapter, scalings, transposed = lora_layout(model)
        yield from merge_lora(state, scalings, adapter, transposed)
    else:  # sharded (fsdp2) tensors are gathered one at a time, every process in step
        for name, tensor in state.items():
            yield vllm_weight_name(name), tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def cast_weights(weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype) -> list[tuple[str, Tensor]]:
    """``weights`` with every floating tensor in ``dtype``: the engine's, so that vLLM's
    loaders copy without a per-tensor dtype conversion (and its warning); integer tensors
    (buffers) are kept as they are."""
    return [(name, t.to(dtype) if t.is_floating_point() else t) for name, t in weights]
