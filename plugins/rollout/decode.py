"""The ``hf`` backend's lean decode loop (``rollout: {name: hf, decode: lean}``, the default).

transformers ``generate`` keeps every row of the batch in every decode step until the
last row ends: a row that produced EOS at token 3 of 128 is still run through the model
125 more times (its outputs replaced by padding). With sampled completions of uneven
length, a large share of the decode compute of a group goes to finished rows. This loop
drops a row from the batch (its KV cache rows included) as soon as it ends, and does
nothing else per token than the forward, the sampling and the stop check.

Same tokens as ``generate``: the sampling knobs are applied by transformers' own warpers
(temperature, then top-k, then top-p, as ``generate`` orders them), and a sampled token
is drawn with the rule ``torch.multinomial(probs, 1)`` uses on CPU for one sample,
``argmax(probs / E)`` with ``E ~ Exponential(1)`` of the shape of the *whole* batch's
probabilities, drawn every step for all ``B`` rows as ``generate`` does (finished rows
included) and indexed by the rows still alive. Under a fixed seed the two therefore draw
the same noise for the same row and step, and give the same tokens up to float rounding
of the forward at a different batch size (see ``tests/plugins/rollout/test_decode.py``).

That draw costs ``B * V`` exponentials per step (32 ms for 32 rows of SmolLM2's 49k
vocabulary on two cores, half a bf16 decode step there). ``sampler: inverse-cdf`` (the default)
draws one uniform per row instead and inverts the cumulative distribution (0.8 ms): the same
distribution, not the same tokens as ``generate``.

Two more things keep the per-token cost near the model's matmuls:

- :class:`SlabLayer`: the KV cache of each layer is one preallocated buffer with room for the
  prompt and every new token, written in place; transformers' ``DynamicCache`` concatenates
  the whole cache with the new position at every step (12% of a float32 decode step of 32
  rows of SmolLM2-135M on a 2-core EPYC). Dropping rows copies the buffer once per step in
  which some row ended.
- :func:`decode_attention`: the attention of a one-token query, two batched matmuls per
  layer with the query heads of a key/value head grouped (no repeated keys), softmax in
  float32. torch's CPU flash-attention kernel, which ``sdpa`` dispatches to, is slow for a
  one-token bfloat16 query: it took 37 ms of a 94 ms bfloat16 decode step of 32 rows on the
  EPYC, against 6 ms in float32. Prompts (more than one query position) still go to
  ``sdpa``. :func:`use_decode_attention` puts it on a generation copy of the policy.
- :func:`packed_linears`: on a CPU, the bfloat16 copy's linear layers run oneDNN's matmul
  on weights reordered once per generate call into its blocked layout (the same results to
  the bit; the matmuls were 63% of a bfloat16 generate call and run 1.2-1.6x faster packed).

The generation copy itself: whether ``dtype: auto`` makes one (:func:`auto_dtype`, on a device
with native bfloat16, :func:`native_bf16`); its empty shell is made by the engine's one helper
for copies of the policy (``grpo_core.contracts.policy_copy(model, dtype=..., weights=False)``)
and filled by the ``hf`` backend (:mod:`grpo_plugins.rollout.hf`) with the training weights.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from grpo_core.contracts import SamplingParams

__all__ = ["lean_decode", "warpers", "inverse_cdf", "decode_attention", "use_decode_attention", "SlabLayer",
           "use_slabs", "packed_linears", "auto_dtype", "native_bf16"]


def warpers(sampling: SamplingParams):
    """transformers' logits warpers for ``sampling``, in ``generate``'s order; None for greedy
    decoding (no warper changes an argmax)."""
    from transformers import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    if sampling.greedy:
        return None
    out = LogitsProcessorList()
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        out.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
    return out


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row of ``probs (a, V)`` for ``uniforms (a,)`` in [0, 1): the smallest
    ``k`` with ``cumsum(probs)[k] > u * sum(probs)``. A token of probability 0 is never
    drawn (its cumulative sum equals its predecessor's), and ``u * sum`` is kept below the
    sum so that float rounding cannot step past the last token."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _pick(
    scores: Tensor, alive: Tensor, batch: int, processors: Any, seqs: Tensor | None, sampler: str
) -> tuple[Tensor, Tensor | None]:
    """Next tokens ``long (a,)`` of the ``a`` alive rows from their float32 logits ``(a, V)``:
    argmax (greedy); ``argmax(softmax(warped) / E)`` with ``E`` drawn for all ``batch`` rows
    (``sampler="multinomial"``, generate's draw); or :func:`inverse_cdf` with one uniform
    drawn for each of the ``batch`` rows (``"inverse-cdf"``: ``V`` times fewer draws). Also the
    log-probs ``float (a,)`` of the drawn tokens under the distribution drawn from (after the
    warpers, as vLLM's ``processed_logprobs``); None for greedy decoding."""
    if processors is None:
        return scores.argmax(dim=-1), None
    scores = processors(seqs, scores)
    probs = torch.softmax(scores, dim=-1)
    if sampler == "inverse-cdf":
        uniforms = torch.rand((batch,), device=probs.device)
        tokens = inverse_cdf(probs, uniforms[alive])
    else:
        noise = torch.empty((batch, probs.shape[-1]), dtype=probs.dtype, device=probs.device)
        noise.exponential_(1)
        tokens = (probs / noise[alive]).argmax(dim=-1)
    return tokens, probs.gather(1, tokens[:, None]).squeeze(1).log()


def _forward(model: Any, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any, keep_arg: bool) -> Tensor:
    """float32 logits ``(b, V)`` of the last position of ``ids (b, s)`` (the cache extended)."""
    kwargs = {"logits_to_keep": 1} if keep_arg else {}
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions,
        past_key_values=cache, use_cache=True, **kwargs,
    )
    return out.logits[:, -1].float()


def lean_decode(
    model: Any,
    ids: Tensor,
    mask: Tensor,
    cache: Any,
    sampling: SamplingParams,
    eos_ids: list[int],
    pad_id: int,
    stop_criterion: Any | None = None,
    sampler: str = "inverse-cdf",
    with_logp: bool = False,
    on_forward: Callable[[Tensor, int], None] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Decode up to ``sampling.max_new_tokens`` tokens for ``B`` left-padded rows.

    Args:
        ids, mask: ``long (B, L)`` / ``bool (B, L)`` the rows' prompts (each prompt already
            repeated ``G`` times).
        cache: a ``DynamicCache`` holding the first ``c`` prompt positions of every row
            (``c = L - 1`` after a shared prefill, ``0`` for an empty cache); the remaining
            ``L - c`` positions are fed in the first step. Its plain layers become
            :class:`SlabLayer` s with room for the new tokens (:func:`use_slabs`).
        eos_ids, pad_id: a row ends at its first token in ``eos_ids``; ``pad_id`` fills
            the positions after it.
        stop_criterion: transformers' ``StopStringCriteria`` (called on the alive rows'
            prompt + completion ids), or None.
        sampler: ``inverse-cdf`` (one uniform per row, the default) or ``multinomial``
            (generate's draw and the same tokens); see :func:`_pick`.
        with_logp: also return each drawn token's log-prob under the distribution it was
            drawn from (sampling only).
        on_forward: called as ``on_forward(alive, t)`` after step ``t``'s forward on the rows
            ``alive`` (``long (b,)``, indices into ``B``): the ``hf`` backend reads the routers
            of a mixture-of-experts model there (routing replay, :mod:`grpo_plugins.rollout.routes`).

    Returns:
        ``(completions, lengths, logp)``: ``long (B, n)`` tokens (``pad_id`` after a row's
        end, ``n`` the number of steps run), ``long (B,)`` the length of each row that ended
        (its end token included), -1 for rows still running after ``max_new_tokens``, and
        ``float32 (B, n)`` log-probs (0 after a row's end) or None.
    """
    batch = ids.shape[0]
    device = ids.device
    processors = warpers(sampling)
    keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    out = torch.full((batch, sampling.max_new_tokens), pad_id, dtype=torch.long, device=device)
    sampled = processors is not None  # an empty warper list is still sampling
    logps = torch.zeros((batch, sampling.max_new_tokens), device=device) if with_logp and sampled else None
    lengths = torch.full((batch,), -1, dtype=torch.long, device=device)
    alive = torch.arange(batch, device=device)
    attn = mask.long()
    positions = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)
    cached = cache.get_seq_length()
    use_slabs(cache, ids.shape[1] - cached + sampling.max_new_tokens)
    step_ids, step_pos = ids[:, cached:], positions[:, cached:]
    seqs = ids if stop_criterion is not None else None  # only the stop check reads them
    steps = 0
    for t in range(sampling.max_new_tokens):
        logits = _forward(model, step_ids, attn, step_pos, cache, keep_arg)
        if on_forward is not None:
            on_forward(alive, t)
        tokens, picked = _pick(logits, alive, batch, processors, seqs, sampler)
        out[alive, t] = tokens
        if logps is not None:
            logps[alive, t] = picked
        steps = t + 1
        if seqs is not None:
            seqs = torch.cat([seqs, tokens[:, None]], dim=1)
        done = torch.isin(tokens, eos)
        if stop_criterion is not None:
            done = done | stop_criterion(seqs, None).to(device)
        if bool(done.any()):
            lengths[alive[done]] = t + 1
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            alive, tokens, attn = alive[keep], tokens[keep], attn[keep]
            step_pos = step_pos[keep]
            seqs = seqs[keep] if seqs is not None else None
            cache.batch_select_indices(keep)
        step_ids = tokens[:, None]
        step_pos = step_pos[:, -1:] + 1
        attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
    return out[:, :steps], lengths, None if logps is None else logps[:, :steps]


# ------------------------------------------------------------------ the KV cache
def use_slabs(cache: Any, room: int) -> None:
    """Turn ``cache``'s plain ``DynamicLayer`` s into :class:`SlabLayer` s with ``room`` more
    positions than they hold (other layer kinds, e.g. sliding-window ones, stay)."""
    layers = getattr(cache, "layers", None)
    for i, layer in enumerate(layers or ()):
        if type(layer) is DynamicLayer:
            layers[i] = SlabLayer.from_layer(layer, room)


class SlabLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of the first positions of one
    preallocated buffer each (``(b, kv_heads, capacity, head_dim)``), written in place; a
    buffer that is full grows by ``room`` positions."""

    room = 0
    _k: Tensor | None = None
    _v: Tensor | None = None

    @classmethod
    def from_layer(cls, layer: DynamicLayer, room: int) -> SlabLayer:
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)
        new.room, new._k, new._v = room, None, None
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            new._grow(layer.keys, layer.values, layer.keys.shape[-2] + room)
        return new

    def _grow(self, keys: Tensor, values: Tensor, capacity: int) -> None:
        used = keys.shape[-2]
        self._k = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        self._v = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        self._k[..., :used, :].copy_(keys)
        self._v[..., :used, :].copy_(values)
        self.keys, self.values = self._k[..., :used, :], self._v[..., :used, :]

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = 0 if self._k is None else self.keys.shape[-2]
        n = key_states.shape[-2]
        if self._k is None or used + n > self._k.shape[-2]:
            if self._k is None:
                self._grow(key_states[..., :0, :], value_states[..., :0, :], n + self.room)
            else:
                self._grow(self.keys, self.values, used + n + self.room)
        self._k[..., used:used + n, :].copy_(key_states)
        self._v[..., used:used + n, :].copy_(value_states)
        self.keys, self.values = self._k[..., :used + n, :], self._v[..., :used + n, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        if self._k is None:
            return super().batch_select_indices(indices)
        used = self.keys.shape[-2]
        self._k, self._v = self._k[indices], self._v[indices]
        self.keys, self.values = self._k[..., :used, :], self._v[..., :used, :]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._k is None:
            return super().batch_repeat_interleave(repeats)
        used = self.keys.shape[-2]
        self._k = self._k.repeat_interleave(repeats, dim=0)
        self._v = self._v.repeat_interleave(repeats, dim=0)
        self.keys, self.values = self._k[..., :used, :], self._v[..., :used, :]

    def reset(self) -> None:
        super().reset()
        self._k = self._v = None


# ------------------------------------------------------------------ decode attention
#: The name the decode attention is registered under with transformers.
DECODE_ATTENTION = "grpo_decode"

#: Keyword arguments that change the attention's formula: such layers stay on sdpa.
_SPECIAL = ("softcap", "sinks", "s_aux", "position_bias", "sliding_window_size")


def decode_attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """Attention for ``query (b, heads, q, d)`` against ``key``/``value (b, kv_heads, L, d)``;
    returns ``(b, q, heads, d)`` as transformers' attention functions do. A one-token query
    (decoding) is two batched matmuls with the ``heads / kv_heads`` query heads of each
    key/value head side by side, the softmax in float32; anything else (prompts, dropout,
    soft-capped or sink attention) goes to transformers' ``sdpa``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, q, d = query.shape
    kv_heads = key.shape[1]
    if q != 1 or dropout or heads % kv_heads or any(kwargs.get(k) is not None for k in _SPECIAL):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    packed = query.reshape(b, kv_heads, heads // kv_heads, d)
    scores = torch.matmul(packed, key.transpose(-1, -2)).float()  # (b, kv_heads, group, L)
    scores.mul_(d**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        last = attention_mask[:, :, -1:, : key.shape[-2]]  # (b, 1, 1, L)
        if last.dtype == torch.bool:
            scores.masked_fill_(~last, float("-inf"))
        else:
            scores.add_(last.float())
    out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)  # (b, kv_heads, group, d)
    return out.reshape(b, heads, 1, d).transpose(1, 2), None


def use_decode_attention(model: Any) -> bool:
    """Switch ``model`` (a generation copy, not the trained policy) from ``sdpa`` to
    :func:`decode_attention`; returns whether it did. Models on another attention
    implementation, or that cannot switch, are left as they are."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        if getattr(model.config, "_attn_implementation", None) != "sdpa":
            return False
        AttentionInterface.register(DECODE_ATTENTION, decode_attention)
        AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
        model.set_attn_implementation(DECODE_ATTENTION)
    except Exception:  # noqa: BLE001 - a model (or wrapper) that cannot switch keeps sdpa, which is correct
        return False
    return getattr(model.config, "_attn_implementation", None) == DECODE_ATTENTION


# ------------------------------------------------------------------ packed linear layers
def _packed_forward(module: torch.nn.Linear, x: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, module._grpo_packed, module.bias, "none", [], "")


def _can_pack(module: Any) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and weight is not None and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.numel() > 0)


def _onednn_bf16() -> bool:
    """Whether oneDNN computes bfloat16 on this CPU, as it sees it (its ISA cap included)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return probe is not None and bool(probe())


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int):
    """Inside, ``model``'s bfloat16 CPU linear layers multiply with their weights reordered into
    oneDNN's blocked layout for about ``rows`` rows (``torch.ops.mkldnn``, what torch's own
    compiler uses on CPU); their weights must not change inside. Outside, they are as before.
    Does nothing where torch has no oneDNN, or where oneDNN has no bfloat16 kernels on this CPU
    (one without AVX-512 BW/VL/DQ or AVX-NE-CONVERT, or with ``ONEDNN_MAX_CPU_ISA`` below them:
    the reorder would raise), as torch's compiler checks before it packs."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and _onednn_bf16()):
        yield
        return
    done = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if _can_pack(module):
                    module._grpo_packed = torch.ops.mkldnn._reorder_linear_weight(module.weight, max(rows, 1))
                    module.forward = partial(_packed_forward, module)
                    done.append(module)
        yield
    finally:
        for module in done:
            del module.forward, module._grpo_packed


# ------------------------------------------------------------------ the generation copy
def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 natively: a CUDA GPU with bf16 support, or a CPU
    with AVX512-BF16 or AMX tiles (torch's own probes)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


#: ``dtype: auto`` makes a bfloat16 copy only of models this large: below it a decode step is
#: per-operation overhead more than matmuls, which a copy does not speed up.
AUTO_MIN_PARAMETERS = 50_000_000


def auto_dtype(model: torch.nn.Module, decode: str) -> torch.dtype | None:
    """What ``dtype: auto`` generates in for ``model``: bfloat16 when its weights are float32
    plain tensors (not fsdp2 shards), at least :data:`AUTO_MIN_PARAMETERS` of them, ``decode``
    is the lean loop (which returns the sampler's log-probs for the rollout correction) and
    the device has native bf16; else None (the policy itself, as for a quantized one)."""
    weight = next(model.parameters())
    if decode != "lean" or weight.dtype != torch.float32 or hasattr(weight, "full_tensor"):
        return None
    if any(not p.is_floating_point() for p in model.parameters()):
        return None  # a 4-bit base (model.quantization): its packed weights cannot be cast; it generates itself
    if sum(p.numel() for p in model.parameters()) < AUTO_MIN_PARAMETERS:
        return None
    return torch.bfloat16 if native_bf16(weight.device) else None
