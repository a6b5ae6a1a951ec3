"""Log-probabilities of chosen tokens under the output layer, without full-vocabulary copies.

The policy loss needs ``log pi(o_t | q, o_<t)`` for every completion token, i.e. one entry of
a ``(B, T, V)`` log-softmax. Materializing that tensor (and keeping it for backward) costs
``B*T*V`` floats: for ``B*T = 64k`` tokens and ``V = 152k`` that is 40 GB in float32. Here the
output layer is applied to ``chunk_size`` rows at a time, each chunk reduced at once to the
chosen token's log-probability (``logit[target] - logsumexp(logits)``) and, when asked, the
entropy; the chunk's logits are recomputed in backward instead of being saved. Memory grows
with ``N * chunk_size`` and ``N * H``, never ``N * V``.

Public functions: :func:`token_logprobs` (the chunked core on flat hidden states ``(N, H)``)
and :func:`logit_transform` (the logit scaling / soft-capping a model config declares).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["token_logprobs", "logit_transform", "DEFAULT_CHUNK_SIZE"]

#: Rows of hidden states turned into logits at once. With ``V = 152k`` a chunk of 1024 rows
#: holds ~0.6 GB of float32 logits (plus the softmax in backward).
DEFAULT_CHUNK_SIZE = 1024

Head = Tensor | nn.Module | Callable[[Tensor], Tensor]


def logit_transform(config: Any) -> dict[str, float | None]:
    """The post-processing of final logits a transformers config declares, as keyword
    arguments of :func:`token_logprobs` (``logit_scale``, ``softcap``).

    Known generic attributes: ``final_logit_softcapping`` (Gemma 2/3:
    ``cap * tanh(z / cap)``), ``logit_scale`` (Cohere: ``z * scale``), ``logits_scaling``
    (Granite: ``z / scaling``). Llama, SmolLM2, Qwen2/3 and Mistral have none. A model whose
    ``forward`` transforms logits in another way is not covered: compare
    :func:`grpo_core.train.learner.logprobs.completion_logprobs` with ``model(...).logits`` once when adding
    such a model.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    return {"logit_scale": scale, "softcap": float(softcap) if softcap else None}


def _apply_head(head: Head, hidden: Tensor, bias: Tensor | None) -> Tensor:
    """Logits ``(n, V)`` of hidden states ``(n, H)`` under a weight ``(V, H)`` or a module."""
    if isinstance(head, Tensor):
        return F.linear(hidden.to(head.dtype), head, bias)
    return head(hidden)


def _chunk_stats(
    hidden: Tensor,
    targets: Tensor,
    head: Head,
    bias: Tensor | None,
    scale: float,
    softcap: float | None,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob ``(n,)`` of ``targets (n,)`` and entropy ``(n,)`` (or None) for one chunk
    of hidden states ``(n, H)``; the ``(n, V)`` logits live only inside this call."""
    logits = _apply_head(head, hidden, bias)
    # At least float32 for the reductions; float64 models stay float64.
    logits = _transform(logits.to(torch.promote_types(logits.dtype, torch.float32)), scale, softcap)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    probs = torch.softmax(logits, dim=-1)
    entropy = lse - (probs * logits).sum(dim=-1)
    return logp, entropy


def _linear_head(head: Head, bias: Tensor | None, device: torch.device) -> tuple[Tensor, Tensor | None] | None:
    """``(weight, bias)`` when the output layer is a plain matmul that :class:`_HeadLogprobs`
    can run (a weight, or an ``nn.Linear`` itself, not a wrapper such as a LoRA layer) outside
    autocast; None otherwise."""
    if torch.is_autocast_enabled(device.type):
        return None
    if isinstance(head, Tensor):
        return head, bias
    if type(head) is nn.Linear:
        return head.weight, head.bias
    return None


class _HeadLogprobs(torch.autograd.Function):
    """One chunk's log-probs (and entropies) under ``softmax(transform(h @ W.T + b))``, keeping
    for backward only ``h``, the targets and the ``(n,)`` log-sum-exp (and entropy).

    The checkpointed form (autograd through :func:`_chunk_stats`, recomputed in backward)
    runs the whole forward again in backward, logsumexp and its reductions included, then
    autograd's own backward over the ``(n, V)`` logits. Here backward recomputes the logits
    once and turns them into the gradient in place: ``p = exp(z - lse)``,
    ``dz = g_logp * (onehot - p) - g_ent * p * (z - (lse - entropy))``, through the softcap
    and scale, then the two matmuls: the same gradient with fewer passes over ``(n, V)``
    (``bench/packing.py``: 28% less time in the output layer of the quickstart's batch)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, softcap, with_entropy):
        logits = F.linear(hidden.to(weight.dtype), weight, bias)
        z = _transform(logits.to(torch.promote_types(logits.dtype, torch.float32)), scale, softcap)
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        entropy = None
        if with_entropy:
            entropy = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        ctx.scale, ctx.softcap, ctx.with_entropy = scale, softcap, with_entropy
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        logits = F.linear(hidden.to(weight.dtype), weight, bias)
        raw = logits.to(torch.promote_types(logits.dtype, torch.float32))
        z = _transform(raw, ctx.scale, ctx.softcap)
        grad = torch.exp(z - lse.unsqueeze(-1))  # the softmax p
        if ctx.with_entropy and grad_entropy is not None:
            # d entropy / dz = -p * (z - sum(p z)), with sum(p z) = lse - entropy
            z.sub_((lse - entropy).unsqueeze(-1)).mul_(grad).mul_(-grad_entropy.unsqueeze(-1))
        else:
            z = None
        grad.mul_(-grad_logp.unsqueeze(-1))
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
        if z is not None:
            grad.add_(z)
        if ctx.scale != 1.0:
            grad.mul_(ctx.scale)
        if ctx.softcap is not None:  # d/dx cap * tanh(x / cap) = 1 - tanh^2
            grad.mul_(1 - torch.tanh(raw / ctx.softcap).square_())
        grad = grad.to(weight.dtype)
        grad_hidden = (grad @ weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _transform(logits: Tensor, scale: float, softcap: float | None) -> Tensor:
    """``scale * softcap * tanh(logits / softcap)`` (the soft cap only when given)."""
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits * scale if scale != 1.0 else logits


def token_logprobs(
    hidden: Tensor,
    head: Head,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities (and entropies) of ``targets`` under ``softmax(head(hidden))``.

    For each chunk of ``chunk_size`` rows: ``z = head(h)`` (``h @ W.T + bias`` for a weight),
    upcast to at least float32, then ``z = softcap * tanh(z / softcap)`` if ``softcap``,
    ``z = z * logit_scale / temperature``; ``logp = z[target] - logsumexp(z)`` and
    ``entropy = logsumexp(z) - sum(softmax(z) * z)``. The matmul runs in the head's dtype
    (bf16 logits are what the model itself produces) and everything after it in float32.

    When gradients are enabled only each chunk's inputs (``hidden`` rows, targets) and its
    ``(chunk,)`` log-sum-exp are kept for backward; the ``(chunk, V)`` logits are recomputed
    there, one chunk at a time, and turned into the gradient in place (:class:`_HeadLogprobs`,
    for a weight or a plain ``nn.Linear`` outside autocast), or recomputed with the whole chunk
    under non-reentrant activation checkpointing (any other head module, or under autocast).
    Gradients flow to ``hidden`` and to the head's parameters.

    Args:
        hidden: ``(N, H)`` final hidden states, one row per predicted token.
        head: the output projection: a weight ``(V, H)``, or a module / callable mapping
            ``(n, H) -> (n, V)`` (e.g. ``model.get_output_embeddings()``, LoRA-wrapped or not).
        targets: ``long (N,)`` token ids whose log-probs are wanted.
        bias: ``(V,)`` bias when ``head`` is a weight tensor.
        chunk_size: rows per chunk (any positive number; need not divide ``N``).
        with_entropy: also return the entropy of each row's distribution.
        temperature: the sampling temperature; logits are divided by it (as TRL does) so the
            log-probs are those of the distribution the sampler drew from.
        logit_scale, softcap: see :func:`logit_transform`.

    Returns:
        ``(logp, entropy)``: ``float (N,)`` each (float32, or float64 for a float64 head),
        ``entropy`` None unless ``with_entropy``.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"token_logprobs: hidden must be (N, H) and targets (N,); got {tuple(hidden.shape)} "
            f"and {tuple(targets.shape)}"
        )
    if chunk_size <= 0:
        raise ValueError(f"token_logprobs: chunk_size must be positive, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be positive, got {temperature}")
    scale = float(logit_scale) / float(temperature)
    args = (head, bias, scale, softcap, with_entropy)
    use_checkpoint = torch.is_grad_enabled()
    linear = _linear_head(head, bias, hidden.device) if use_checkpoint else None
    logps: list[Tensor] = []
    entropies: list[Tensor] = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if linear is not None:
            logp, ent = _HeadLogprobs.apply(h, *linear, t, scale, softcap, with_entropy)
        elif use_checkpoint:
            logp, ent = checkpoint(
                _chunk_stats, h, t, *args, use_reentrant=False, preserve_rng_state=False
            )
        else:
            logp, ent = _chunk_stats(h, t, *args)
        logps.append(logp)
        if ent is not None:
            entropies.append(ent)
    if not logps:  # N == 0
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        empty = hidden.new_zeros((0,), dtype=dtype)
        return empty, (empty if with_entropy else None)
    logp = torch.cat(logps)
    return logp, (torch.cat(entropies) if with_entropy else None)
