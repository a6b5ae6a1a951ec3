"""Routing replay's record: the experts a mixture-of-experts policy sent each token to where
the token was sampled, and the routers of the model classes it is read from and forced on.

A MoE layer's router picks the top-``k`` of ``E`` experts for every token from its logits. The
sampler and the learner compute those logits with different kernels, dtypes or weights, so they
can pick different experts for the same token, and the importance ratio of such a token then
compares two different networks. Routing replay (R3: Ma et al. 2025, "Stabilizing MoE
Reinforcement Learning by Aligning Training and Inference Routers", arXiv:2510.11370) records
the experts the sampler picked and forces them in the learner's forward; the learner's router
still computes its logits, and each forced expert's gate weight is the model's own gate rule
applied to the live logits of the forced experts (:data:`ROUTER_GATES`), so the router keeps
learning.

:class:`ExpertRoutes` is what a backend that records routes returns with its rollout
(:attr:`~grpo_core.contracts.RolloutBatch.routes`); :class:`RouteRecorder` is the hook a
backend that generates with a transformers model uses to read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ExpertRoutes", "RouteRecorder", "ROUTER_GATES", "moe_routers", "NOT_ROUTED"]

#: The expert index of a token whose route was not recorded (padding, a completion's last token,
#: which is never fed back): the learner routes it live.
NOT_ROUTED = -1


@dataclass
class ExpertRoutes:
    """The experts each token was routed to, in every MoE layer, where it was sampled.

    ``N``: MoE layers (in module order), ``k``: experts per token.

    Attributes:
        prompt: ``int16 (P, L, N, k)``: the experts of each prompt token (left-padded like
            ``prompt_ids``), :data:`NOT_ROUTED` on padding.
        completion: ``int16 (B, T, N, k)``: the experts of each completion token when it was fed
            to the model to sample the next one; :data:`NOT_ROUTED` on padding and on each
            row's last token (never fed: no log-prob depends on its route).
    """

    prompt: Tensor
    completion: Tensor

    def select(self, prompts: Tensor, rows: Tensor) -> ExpertRoutes:
        """The routes of ``prompts`` (indices into ``P``) and of completion ``rows`` (into ``B``)."""
        return ExpertRoutes(self.prompt[prompts.to(self.prompt.device)], self.completion[rows.to(self.prompt.device)])


def _softmax_then_top(router: nn.Module, logits: Tensor, index: Tensor) -> Tensor:
    """Qwen2/3-MoE, OLMoE, Mixtral: the softmax over all experts' logits at the chosen experts,
    renormalized over them when the router says ``norm_topk_prob`` (Mixtral always does)."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, index)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return top


def _top_then_softmax(router: nn.Module, logits: Tensor, index: Tensor) -> Tensor:
    """gpt-oss: the softmax over the chosen experts' logits."""
    return torch.softmax(logits.gather(-1, index), dim=-1, dtype=logits.dtype)


#: The router classes of transformers' MoE models whose route can be replayed, by class name,
#: with their gate rule ``(router, logits (n, E), experts (n, k)) -> gate weights (n, k)``. Each
#: of them returns ``(logits, gate weights, experts)`` from ``forward(hidden (n, H))``.
ROUTER_GATES: dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_then_top,
    "Qwen2MoeTopKRouter": _softmax_then_top,
    "OlmoeTopKRouter": _softmax_then_top,
    "MixtralTopKRouter": _softmax_then_top,
    "GptOssTopKRouter": _top_then_softmax,
}


def moe_routers(model: Any) -> list[nn.Module]:
    """The routers of ``model`` (a transformers causal LM, or a wrapper holding one) whose
    class is in :data:`ROUTER_GATES`, in module order: one per MoE layer."""
    plain = getattr(model, "module", model)
    return [m for m in plain.modules() if type(m).__name__ in ROUTER_GATES]


class RouteRecorder:
    """Forward hooks on a model's routers that keep the experts each router picked in the last
    forward call (while entered): :meth:`take` returns them for that call's tokens."""

    def __init__(self, model: Any):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay: {type(getattr(model, 'module', model)).__name__} has no router of "
                             f"a known mixture-of-experts class ({', '.join(sorted(ROUTER_GATES))})")
        self.top_k = int(self.routers[0].top_k)
        self._last: list[Tensor | None] = [None] * len(self.routers)
        self._handles: list[Any] = []

    @property
    def layers(self) -> int:
        """``N``: the MoE layers."""
        return len(self.routers)

    def __enter__(self) -> RouteRecorder:
        for n, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._keeper(n)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keeper(self, n: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._last[n] = output[2].detach()

        return hook

    def take(self, shape: tuple[int, ...]) -> Tensor:
        """``int16 (*shape, N, k)``: the experts of the last call's tokens, which were ``shape``
        (``(b, s)`` for a call on ``b`` rows of ``s`` tokens)."""
        if any(t is None for t in self._last):
            raise RuntimeError("routing replay: a router did not run in the last forward call")
        routes = torch.stack([t.reshape(-1, self.top_k) for t in self._last], dim=-2)  # (n, N, k)
        self._last = [None] * len(self.routers)
        return routes.reshape(*shape, self.layers, self.top_k).to(torch.int16)
