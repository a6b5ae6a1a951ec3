"""Routing replay in the learner's forwards (``algorithm.routing_replay``).

The rollout carries the experts a mixture-of-experts policy routed each token to where it was
sampled (:class:`~grpo_core.contracts.ExpertRoutes`, see :mod:`grpo_core.contracts.routes`
for why). :func:`replayed` forces them during one decoder call: a forward hook on each router
(:func:`~grpo_core.contracts.moe_routers`) keeps the router's live logits, replaces the experts
it picked by the recorded ones, and recomputes their gate weights from the live logits with the
model's own gate rule (:data:`~grpo_core.contracts.routes.ROUTER_GATES`), so gradients reach
the router through the gate weights. A token without a recorded route (padding, a row's last
token) keeps its live route.

A decoder call sees its tokens in its own layout (a padded block with each prompt repeated for
its completions, or one packed sequence): :func:`route_keys` numbers every prompt and
completion token of the batch, the log-prob pass lays the numbers out exactly as it lays out
the token ids (the same trimming, repetition and :func:`~grpo_core.train.learner.packing.pack_rows`),
and :meth:`Replay.at` looks the routes up by number.

:class:`RouteTally` counts, in the forwards with gradients (the update), the share of tokens
whose live routing differs from the replayed one (``routing/replay_mismatch_tokens``: in at
least one MoE layer; ``routing/replay_mismatch_routes``: per token and layer).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from grpo_core.contracts.routes import NOT_ROUTED, ROUTER_GATES, ExpertRoutes, moe_routers
from grpo_core.errors import RunError
from grpo_core.train.recompute import on_recompute

__all__ = ["Replay", "RouteTally", "replayed", "route_keys", "check_replayable"]


@dataclass
class RouteTally:
    """Tokens (and token-layer routes) whose live routing differed from the replayed one, over
    the forwards with gradients of one batch."""

    tokens: float = 0.0
    differing_tokens: float = 0.0
    routes: float = 0.0
    differing_routes: float = 0.0

    def metrics(self, total: Callable[[Sequence[float]], list[float]]) -> dict[str, float]:
        """The shares as metrics, summed over processes by ``total`` first."""
        tokens, differing_tokens, routes, differing_routes = total(
            [self.tokens, self.differing_tokens, self.routes, self.differing_routes])
        return {"routing/replay_mismatch_tokens": differing_tokens / tokens if tokens else 0.0,
                "routing/replay_mismatch_routes": differing_routes / routes if routes else 0.0}


@dataclass
class Replay:
    """The routes of a batch's prompts and rows (or of a selection of them) with the tally the
    forwards add to."""

    routes: ExpertRoutes
    tally: RouteTally = field(default_factory=RouteTally)

    def select(self, prompts: Tensor, rows: Tensor) -> Replay:
        """The routes of ``prompts`` and completion ``rows`` (indices), sharing this tally."""
        return Replay(self.routes.select(prompts, rows), self.tally)

    def at(self, keys: Tensor) -> Tensor:
        """``long (*keys.shape, N, k)``: the routes of the tokens numbered ``keys`` (:func:`route_keys`)."""
        prompt, completion = self.routes.prompt, self.routes.completion
        table = torch.cat([prompt.reshape(-1, *prompt.shape[2:]), completion.reshape(-1, *completion.shape[2:])])
        return table.to(keys.device)[keys].long()


def route_keys(prompt_ids: Tensor, completion_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(long (P, L), long (B, T))``: a number for every prompt token and every completion
    token, in :meth:`Replay.at`'s order (the prompts', then the completions', row-major)."""
    device = prompt_ids.device
    prompts = torch.arange(prompt_ids.numel(), device=device).view(prompt_ids.shape)
    completions = prompt_ids.numel() + torch.arange(completion_ids.numel(), device=device).view(completion_ids.shape)
    return prompts, completions


def _hook(gate: Callable, forced: Tensor, tally: RouteTally | None, differs: Tensor):
    def hook(module: nn.Module, args: Any, output: Any) -> tuple[Tensor, Tensor, Tensor]:
        logits, scores, live = output
        if forced.shape[0] != live.shape[0]:
            raise RuntimeError(f"routing replay: {type(module).__name__} routed {live.shape[0]} tokens, "
                               f"{forced.shape[0]} routes were laid out for the call")
        known = forced[:, 0] != NOT_ROUTED
        index = torch.where(known[:, None], forced, live)
        if tally is not None and torch.is_grad_enabled():
            with torch.no_grad():
                changed = known & (live.sort(dim=-1).values != forced.sort(dim=-1).values).any(dim=-1)
                differs.logical_or_(changed)
                tally.routes += float(known.sum())
                tally.differing_routes += float(changed.sum())
        return logits, gate(module, logits, index).to(scores.dtype), index

    return hook


@contextlib.contextmanager
def replayed(model: Any, routes: Tensor, tally: RouteTally) -> Iterator[None]:
    """Force ``routes`` (``long (..., N, k)``, one per token of the decoder call made inside, in
    its flattened order) on ``model``'s routers; see the module doc. A checkpointed layer run
    inside is recomputed in the backward with the same routes forced, its tokens not counted
    again."""
    routers = moe_routers(model)
    if len(routers) != routes.shape[-2]:
        raise RunError(f"routing replay: the rollout recorded {routes.shape[-2]} MoE layers, "
                       f"the policy has {len(routers)}")
    with _forced(routers, routes.reshape(-1, *routes.shape[-2:]), tally):
        yield


@contextlib.contextmanager
def _forced(routers: list[nn.Module], flat: Tensor, tally: RouteTally | None) -> Iterator[None]:
    """The hooks of :func:`replayed` on ``routers`` (``flat``: ``long (N, layers, k)``); ``tally``
    None: nothing counted (a recomputation)."""
    differs = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
    handles = [router.register_forward_hook(_hook(ROUTER_GATES[type(router).__name__], flat[:, n], tally, differs))
               for n, router in enumerate(routers)]
    try:
        with on_recompute(functools.partial(_forced, routers, flat, None)):
            yield
    finally:
        for handle in handles:
            handle.remove()
    if tally is not None and torch.is_grad_enabled():
        tally.tokens += float((flat[:, 0, 0] != NOT_ROUTED).sum())
        tally.differing_tokens += float(differs.sum())


def check_replayable(model: Any) -> None:
    """A RunError naming the model's class when it has no router routing replay can force."""
    if not moe_routers(model):
        plain = getattr(model, "module", model)
        raise RunError(f"algorithm.routing_replay: the policy ({type(plain).__name__}) has no mixture-of-experts "
                       f"router of a supported class ({', '.join(sorted(ROUTER_GATES))}); set "
                       "algorithm.routing_replay: false for a dense model")
