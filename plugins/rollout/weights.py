"""The policy's weights as an inference engine wants them: the base model's parameter
names, with a LoRA adapter (peft) merged in, ``W + scaling * B @ A`` per layer, computed
from the state dict so that the training model itself is never modified
(:func:`policy_weights`), and cast to the engine's dtype (:func:`cast_weights`).

A push streams them (:func:`weight_buckets`): each tensor is made only when it is reached
(:func:`pending_weights`: a sharded one gathered with ``full_tensor``, a 4-bit one dequantized,
a LoRA layer merged), cast as it is made, and gathered into buckets of at most a bound of bytes
(:func:`plan_buckets`; a tensor larger than the bound goes alone), which the backend sends and
drops before the next is made: the pushing process holds one bucket beyond its own weights,
never the whole model.

Used by the ``vllm`` and ``vllm-server`` rollout backends (:mod:`grpo_plugins.vllm`) for their
weight sync; any backend that keeps its own copy of the weights (another engine, a server)
can use it the same way. A helper, not a plugin: it registers nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

__all__ = ["PUSH_BUCKET_MB", "PendingWeight", "bucket_sizes", "cast_weights", "dequantized_state", "lora_layout",
           "merge_lora", "merge_pending", "pending_weights", "plan_buckets", "policy_weights", "push_bucket_field",
           "take_part",
           "vllm_weight_name", "weight_buckets"]


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


def _gathered(name: str, tensor: Tensor) -> Tensor:
    """``tensor`` whole: a sharded (fsdp2) DTensor gathered (a collective: every process calls
    it in step), any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _delta(state: Mapping[str, Tensor], module: str, adapter: str, scaling: float, transposed: bool,
           whole: Callable[[str, Tensor], Tensor] = _gathered) -> Tensor:
    """``scaling * B @ A`` of one LoRA layer, float32, in the base weight's layout."""
    linear = (f"{module}.lora_A.{adapter}.weight", f"{module}.lora_B.{adapter}.weight")
    embedding = (f"{module}.lora_embedding_A.{adapter}", f"{module}.lora_embedding_B.{adapter}")
    if linear[0] in state:
        a, b = (whole(k, state[k]) for k in linear)
        if a.dim() != 2:
            raise NotImplementedError(f"vllm rollout: LoRA on {module} ({a.dim()}-d weight) is not supported")
        delta = b.float() @ a.float()  # (out, r) @ (r, in)
        return scaling * (delta.T if transposed else delta)
    if embedding[0] in state:
        a, b = (whole(k, state[k]) for k in embedding)  # (r, num_embeddings), (dim, r)
        return scaling * (b.float() @ a.float()).T
    raise KeyError(f"vllm rollout: no LoRA weights for {module} (adapter {adapter!r})")


@dataclasses.dataclass(frozen=True)
class PendingWeight:
    """One tensor of a push before it is made: its base-model ``name``, ``shape`` and ``dtype``
    (of the whole tensor), whether making it ``gathers`` (a collective of sharded processes),
    and ``load``, which makes it: gathered, dequantized, LoRA merged."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    gathers: bool
    load: Callable[[], Tensor]

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Its bytes whole, cast to ``dtype`` if it is floating (None: its own dtype)."""
        cast = dtype if dtype is not None and self.dtype.is_floating_point else self.dtype
        return math.prod(self.shape) * torch.empty((), dtype=cast).element_size()


def merge_pending(
    state: Mapping[str, Tensor],
    scalings: Mapping[str, float],
    adapter: str = "default",
    transposed: frozenset[str] = frozenset(),
    whole: Callable[[str, Tensor], Tensor] = _gathered,
    shapes: Mapping[str, tuple[torch.Size, torch.dtype]] | None = None,
) -> list[PendingWeight]:
    """:func:`merge_lora`'s tensors as :class:`PendingWeight`: nothing is made until each one's
    ``load`` is called, which makes that tensor alone (``whole`` gathers or dequantizes the
    state's tensors it reads; ``shapes``: the whole shape and dtype of a state entry whose
    stored tensor is not it, a 4-bit weight's)."""
    suffix = ".base_layer.weight"
    shapes = shapes or {}
    pending = []
    for name, tensor in state.items():
        if ".lora_" in name or ".original_module." in name:
            continue
        if ".modules_to_save." in name and f".modules_to_save.{adapter}." not in name:
            continue
        module = name[: -len(suffix)] if name.endswith(suffix) else None
        shape, dtype = shapes.get(name, (tensor.shape, tensor.dtype))
        sharded = hasattr(tensor, "full_tensor")
        if module is not None and module in scalings:
            def load(name=name, module=module) -> Tensor:
                base = whole(name, state[name])
                delta = _delta(state, module, adapter, scalings[module], module in transposed, whole)
                return (base.float() + delta.to(base.device)).to(base.dtype)
        else:
            def load(name=name) -> Tensor:
                return whole(name, state[name])
        pending.append(PendingWeight(vllm_weight_name(name, adapter), tuple(shape), dtype, sharded, load))
    return pending


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
    one at a time (a sharded one gathered as it is reached): nothing in ``state`` is modified.
    """
    for weight in merge_pending(state, scalings, adapter, transposed):
        yield weight.name, weight.load()


def _dequantizer(model: Any, state: dict[str, Tensor]) -> tuple[Callable[[str, Tensor], Tensor], dict]:
    """For a model with bitsandbytes 4-bit weights: a ``whole(name, tensor)`` that dequantizes
    such a weight when it is reached (to the dtype it was loaded in) and gathers any other, and
    each 4-bit weight's whole shape and dtype; their quantization constants (``weight.absmax``,
    ``weight.quant_map``, ...) are taken out of ``state``."""
    quantized: dict[str, Any] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if getattr(weight, "quant_state", None) is not None and f"{name}.weight" in state:
            quantized[f"{name}.weight"] = weight  # (peft's LoRA layer shows its base's weight: not in state)
    for key in quantized:
        for extra in [k for k in state if k.startswith(key + ".")]:
            del state[extra]

    def whole(name: str, tensor: Tensor) -> Tensor:
        if name not in quantized:
            return _gathered(name, tensor)
        from bitsandbytes.functional import dequantize_4bit

        quant = quantized[name].quant_state
        return dequantize_4bit(quantized[name].data, quant).to(quant.dtype)

    shapes = {k: (tuple(w.quant_state.shape), w.quant_state.dtype) for k, w in quantized.items()}
    return whole, shapes


def dequantized_state(model: Any) -> dict[str, Tensor]:
    """``model.state_dict()`` with each bitsandbytes 4-bit weight (QLoRA's base,
    ``model.quantization``) dequantized to the dtype it was loaded in, and its quantization
    constants (``weight.absmax``, ``weight.quant_map``, ...) left out: what an engine that
    loaded the full-precision base can take. Every weight at once: a push takes them one at a
    time (:func:`pending_weights`)."""
    state = model.state_dict()
    whole, shapes = _dequantizer(model, state)
    return {name: whole(name, tensor) if name in shapes else tensor for name, tensor in state.items()}


def pending_weights(model: Any, *, base_only: bool = False) -> list[PendingWeight]:
    """The policy's weights as the base model names them (:func:`policy_weights`), each still to
    be made: LoRA merged (``base_only``: the base without the adapter), a 4-bit base
    dequantized, a sharded (fsdp2) tensor gathered, each only when its ``load`` is called, so
    that a push holds what it has made and not sent, never the whole model."""
    state = model.state_dict()  # the model's own tensors (its shards under fsdp2): no copy
    quantized = any(getattr(getattr(m, "weight", None), "quant_state", None) is not None for m in model.modules())
    whole, shapes = _dequantizer(model, state) if quantized else (_gathered, {})
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        adapter, scalings, transposed = lora_layout(model)
        return merge_pending(state, {} if base_only else scalings, adapter, transposed, whole, shapes)
    return merge_pending(state, {}, "default", frozenset(), whole, shapes)


def policy_weights(model: Any) -> Iterator[tuple[str, Tensor]]:
    """The policy's weights as the base model names them, LoRA merged (a peft model), a
    4-bit base dequantized (:func:`dequantized_state`); the whole tensors of a sharded
    (fsdp2) model, gathered lazily one by one (every process in step). One tensor is made at
    a time (:func:`pending_weights`)."""
    for weight in pending_weights(model):
        yield weight.name, weight.load()


# --------------------------------------------------------------------------- buckets
#: The default bound of one bucket of a streamed push, in MiB (verl's default is 512 MB).
PUSH_BUCKET_MB = 512.0


def push_bucket_field() -> Any:
    """The ``push_bucket_mb`` option of a backend that pushes weights in buckets (colocated
    ``vllm``, ``vllm-server``): one text for both."""
    return Field(
        PUSH_BUCKET_MB,
        gt=0,
        description=(
            "Most MiB one bucket of a weight push holds: the policy's tensors are made one at a time (gathered "
            "under fsdp2, LoRA merged, a 4-bit base dequantized), cast to the engine's dtype and handed over a "
            "bucket at a time, so the pushing process holds about one bucket beyond its own weights, never the "
            "whole model (a tensor larger than this goes alone). Larger buckets take fewer round trips. 512, as "
            "verl's default; each push's largest bucket is logged as sync/push_buffer_bytes."
        ),
    )


def plan_buckets(sizes: Sequence[int], bound: int) -> list[range]:
    """Consecutive runs of ``sizes`` (bytes, in order) whose sum is at most ``bound`` each; an
    entry larger than ``bound`` is a run of its own. Every index is in exactly one run, in order."""
    if bound < 1:
        raise ValueError(f"plan_buckets: the bound must be at least 1 byte, got {bound}")
    runs: list[range] = []
    start, held = 0, 0
    for i, size in enumerate(sizes):
        if i > start and held + size > bound:
            runs.append(range(start, i))
            start, held = i, 0
        held += size
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


def _sizes(pending: Sequence[PendingWeight], dtypes: Sequence[torch.dtype]) -> list[int]:
    return [sum(p.nbytes(d) for d in dtypes) for p in pending]


def bucket_sizes(pending: Sequence[PendingWeight], bound: int, dtypes: Sequence[torch.dtype]) -> list[int]:
    """The bytes of each bucket :func:`weight_buckets` makes of ``pending`` (cast to every one of
    ``dtypes``): their number, and the largest, the push's peak buffer."""
    sizes = _sizes(pending, list(dict.fromkeys(dtypes)))
    return [sum(sizes[i] for i in run) for run in plan_buckets(sizes, bound)]


def weight_buckets(
    pending: Sequence[PendingWeight], bound: int, dtypes: Sequence[torch.dtype],
    device: torch.device | str | None = None,
) -> Iterator[dict[torch.dtype, list[tuple[str, Tensor]]]]:
    """The tensors of ``pending`` made bucket by bucket, each cast to every one of ``dtypes``
    (floating tensors; others as they are) and moved to ``device`` (None: where they are): one
    dict ``dtype -> [(name, tensor)]`` per bucket, whose tensors take at most ``bound`` bytes in
    all (:func:`plan_buckets`; a tensor larger than the bound alone). Each tensor is cast as it
    is made and its whole source tensor dropped, so a push holds one bucket and the one tensor
    being made. The caller should empty each bucket's lists once sent (this generator keeps no
    reference to a bucket it has yielded). Every process of a sharded model iterates it to the
    end, in step: each sharded tensor is gathered as it is made."""
    dtypes = list(dict.fromkeys(dtypes))
    if not dtypes:
        raise ValueError("weight_buckets: at least one dtype to cast to")
    for run in plan_buckets(_sizes(pending, dtypes), bound):
        bucket: dict[torch.dtype, list[tuple[str, Tensor]]] | None = {d: [] for d in dtypes}
        for i in run:
            tensor = pending[i].load()
            for d in dtypes:
                cast = tensor.to(d) if tensor.is_floating_point() else tensor
                bucket[d].append((pending[i].name, cast if device is None else cast.to(device)))
                del cast
            del tensor
        yield bucket
        bucket = None


def take_part(pending: Sequence[PendingWeight]) -> None:
    """What a process that does not send does during a push: make (and drop at once) each
    tensor whose making is a collective of the sharded processes (``gathers``), in the order
    the sending process makes them; nothing for a whole model."""
    for weight in pending:
        if weight.gathers:
            weight.load()


def cast_weights(weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype) -> list[tuple[str, Tensor]]:
    """``weights`` with every floating tensor in ``dtype``: the engine's, so that vLLM's
    loaders copy without a per-tensor dtype conversion (and its warning); integer tensors
    (buffers) are kept as they are."""
    return [(name, t.to(dtype) if t.is_floating_point() else t) for name, t in weights]
