"""FSDP2: the policy (and reference) sharded over processes with ``fully_shard``.

The engine never calls a causal LM's own ``forward``: it runs the decoder on prompts and
completions (prompt keys/values shared by a group) and the output layer only on completion
positions, in chunks (:func:`grpo_core.train.learner.logprobs.completion_logprobs`). FSDP2 hangs its
all-gather and reduce-scatter on the ``forward`` of each module it shards, so the units are:

- every decoder layer (called once or twice per forward, the same count on every process:
  see :class:`LogprobModel`);
- the input embeddings, when not tied to the output layer;
- the root, :class:`LogprobModel`: a module whose ``forward`` is that log-prob computation. It
  owns what no other unit does: the final norm and the output layer (with the embeddings
  when they are tied, so a tied weight is one unit). The output layer is called once per
  chunk of completion tokens, a count that differs between processes; in the root's unit it
  is gathered once for the root's forward and once for its backward, whatever the count.

At rest every process holds ``1/N`` of each unit (weights, gradients, AdamW state). Rollouts
with transformers ``generate`` call the model's own ``forward`` instead: :func:`full_weights`
gathers every unit for the duration of generation and frees the gathered copies after.

Checkpoints take one of two forms. Gathered (:func:`full_state_dict`, :func:`optimizer_state`):
the whole weights and optimizer state on the main process's CPU, which writes them. Sharded
(:func:`save_shards`, :func:`load_shards`): ``torch.distributed.checkpoint`` (DCP), each process
writing its own shards of both and the main one the metadata that maps them to whole tensors,
so no process holds more than its own; loading reshards them for any process count and
strategy (a whole copy per process under ddp or one process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_core.errors import RunError
from grpo_core.train.learner.logprobs import completion_logprobs

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LogprobModel(nn.Module):
    """A causal LM's completion log-probs as one module ``forward`` (the FSDP2 root).

    ``length_buckets``: run rows of very different lengths as separate decoder calls; off
    under FSDP2, where how many calls a batch takes would depend on each process's lengths and
    the collectives would not match."""

    def __init__(self, model: nn.Module, length_buckets: bool = True, logprobs: Any = None):
        super().__init__()
        self.model = model
        self.length_buckets = length_buckets
        # a log-prob function of the completion_logprobs signature that runs the model on every
        # call itself (sequence parallelism's, a collective of its group); None: completion_logprobs
        self.logprobs = logprobs

    def forward(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
        with_entropy: bool = False, temperature: float = 1.0, share_prompt: bool = True,
        packed: bool = False, prompt_index: Tensor | None = None, images: list | None = None, routes: Any = None,
    ) -> tuple[Tensor, Tensor | None]:
        """:func:`completion_logprobs` of the wrapped model, ``(B, T)`` each. ``share_prompt``:
        encode each prompt once for its completions (two decoder calls) where the rows allow
        it; under FSDP2 every process must pass the same value
        (:meth:`grpo_core.train.learner.parallel.FSDP2.lockstep` agrees on it per mini-batch).
        ``packed``: the rows as one padding-free sequence (one decoder call whatever the rows,
        so a process may pack rows of any lengths while another packs others;
        ``train.packing`` is resolved alike on every process), ``prompt_index`` the prompt of
        each row (:mod:`grpo_core.train.learner.packing`); ``routes`` the recorded expert routes
        to force (:mod:`grpo_core.train.learner.routing`).

        A batch with no completion token still runs the model (on its first column, result
        times 0) so that every process joins the same all-gathers and reduce-scatters."""
        if self.logprobs is not None:
            return self.logprobs(self.model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                 with_entropy=with_entropy, temperature=temperature, packed=packed,
                                 prompt_index=prompt_index, images=images)
        empty = not bool(completion_mask.any())
        if empty:
            if completion_ids.shape[1] == 0:
                raise RunError("fsdp2: a micro-batch has no completion column to run the model on")
            completion_mask = completion_mask.clone()
            completion_mask[:, 0] = True
        logp, entropy = completion_logprobs(
            self.model, prompt_ids, prompt_mask, completion_ids, completion_mask,
            with_entropy=with_entropy, temperature=temperature, share_prompt=share_prompt,
            length_buckets=self.length_buckets, packed=packed, prompt_index=prompt_index, images=images,
            routes=routes,
        )
        if empty:
            logp = logp * 0.0
            entropy = entropy * 0.0 if entropy is not None else None
        return logp, entropy


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise RunError(
            f"train.parallel.strategy fsdp2: cannot find the decoder layers of {type(model).__name__} "
            "(expected a ModuleList at get_decoder().layers); use strategy: ddp"
        )
    return list(layers)


def shard(model: nn.Module, parallel: Any, device: torch.device, logprobs: Any = None) -> LogprobModel:
    """Apply ``fully_shard`` to ``model`` as the module doc says, in place; return its root.

    ``parallel`` is the spec's ``train.parallel`` (reshard_after_forward, offload, param_dtype,
    reduce_dtype); ``logprobs`` the root's log-prob function (:class:`LogprobModel`). Gradients
    are reduce-scattered as sums, not means: the engine's losses are already normalized over
    the whole batch of every process."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    param_dtype = _DTYPES.get(parallel.param_dtype) if parallel.param_dtype else None
    reduce_dtype = _DTYPES.get(parallel.reduce_dtype) if parallel.reduce_dtype else None
    kwargs = {
        "reshard_after_forward": parallel.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if parallel.offload
        else OffloadPolicy(),
    }
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    if not tied:
        fully_shard(embed, **kwargs)
    root = LogprobModel(model, length_buckets=False, logprobs=logprobs)
    fully_shard(root, **kwargs)
    for module in root.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    # Make the root the root now: a unit first called alone (generation before any training
    # forward) would otherwise take that role.
    root._get_fsdp_state()._lazy_init()
    return root


@contextlib.contextmanager
def full_weights(root: nn.Module) -> Iterator[None]:
    """Inside, every unit under the sharded ``root`` (:func:`shard`) holds its gathered
    weights and keeps them through any number of forwards (transformers ``generate``: one per
    token, a count that differs between processes, so nothing may be gathered per call). The
    gathered copies are freed on exit. Entering is a collective: every process must enter
    together."""
    units = [m for m in root.modules() if hasattr(m, "unshard")]
    groups = [g for unit in units for g in _param_groups(unit)]
    after_forward = [g.post_forward_mesh_info for g in groups]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        for group, info in zip(groups, after_forward):  # each unit's own setting back
            group.post_forward_mesh_info = info


def _param_groups(unit: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of one unit: a list in torch 2.13 (``_fsdp_param_groups``),
    one group or ``None`` in torch 2.11 (``_fsdp_param_group``), which ``bench/gpu/`` met on a GPU."""
    state = unit._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def is_sharded(model: Any) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: Any) -> dict[str, Tensor]:
    """The whole ``model.state_dict()``, gathered on the CPU of the main process when
    ``model`` is sharded (other processes get ``{}``; every process must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return model.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    # A tied weight comes back once per name, as separate copies: keep its first name only,
    # as save_pretrained does for the shared tensor of an unsharded model.
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    tied = {name for name, param in model.named_parameters(remove_duplicate=False) if first[id(param)] != name}
    return {k: v for k, v in state.items() if k not in tied}


def load_full_state_dict(model: Any, state: dict[str, Tensor]) -> None:
    """Load a whole (unsharded) state dict into a sharded ``model``, each process keeping its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def full_parameters(model: Any) -> Iterator[tuple[str, Tensor]]:
    """``(name, whole tensor)`` of each parameter and buffer, one gathered at a time
    (``DTensor.full_tensor()``: every process must iterate in step); plain tensors as they are."""
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def optimizer_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state keyed by parameter name, gathered on the CPU of the main
    process (every process must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a state from :func:`optimizer_state` (any process count, sharded model or not)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def named_optimizer_state(model: Any, native: dict[str, Any]) -> dict[str, Any]:
    """A native ``optimizer.state_dict()`` (parameters numbered in ``model.parameters()``
    order, trainable ones only, as :func:`grpo_core.train.learner.optim.make_optimizer` lists them)
    re-keyed by parameter name, the form :func:`load_optimizer_state` reads."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    state = {names[i]: v for i, v in native["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in native["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_shards(model: Any, optimizer: torch.optim.Optimizer, folder: Path, group: Any = None) -> None:
    """Write ``model``'s weights and ``optimizer``'s state to ``folder`` in DCP's layout: each
    process its own shards (``__<rank>_<n>.distcp``; under ddp, DCP spreads the replicated
    tensors over the processes), the main process the metadata (``.metadata``). Keyed by
    parameter name, as :func:`load_shards` reads them under any strategy. Every process must
    call it (``group``: the process group, default the default one; none initialised: one
    process writes everything)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, optimizer)
    with _one_process_quiet():
        dcp.save({"model": weights, "optimizer": optim}, checkpoint_id=str(folder), process_group=group)


def load_shards(model: Any, optimizer: torch.optim.Optimizer | None, folder: Path, group: Any = None) -> None:
    """Load what :func:`save_shards` wrote (under any process count and strategy) into
    ``model`` and, unless None, ``optimizer``: each process reads the parts of the saved
    shards that overlap its own (the whole tensors for an unsharded model). Every process must
    call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        weights = get_model_state_dict(model)
        with _one_process_quiet():
            dcp.load({"model": weights}, checkpoint_id=str(folder), process_group=group)
        set_model_state_dict(model, weights)
        return
    weights, optim = get_state_dict(model, optimizer)
    with _one_process_quiet():
        dcp.load({"model": weights, "optimizer": optim}, checkpoint_id=str(folder), process_group=group)
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim)


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP without a process group warns that it assumes one process, which is the case meant."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def shards_finite(model: Any) -> bool:
    """Whether this process's own shards (or whole tensors) of ``model`` are finite."""
    from torch.distributed.tensor import DTensor

    return all(bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()) for p in model.parameters())
