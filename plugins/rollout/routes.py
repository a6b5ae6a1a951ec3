"""The ``hf`` backend's record of expert routes (``algorithm.routing_replay``): where each
forward call of the lean decode loop (:func:`~grpo_plugins.rollout.decode.lean_decode`) puts the
experts a :class:`~grpo_core.contracts.RouteRecorder` read from the routers.

A part of a ``generate`` call (``p`` prompts of width ``L'``, ``G`` rows each) makes these calls:
the shared prefill of each prompt minus its last token (``p`` rows, positions ``0 .. L'-2``),
then step 0 (the prompt positions the cache does not hold, for every row), then step ``t >= 1``
(completion token ``t-1`` of each row still alive). A completion's last token is never fed back,
so it keeps no route (:data:`~grpo_core.contracts.routes.NOT_ROUTED`), nor does padding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_core.contracts import ExpertRoutes, RouteRecorder
from grpo_core.contracts.routes import NOT_ROUTED

__all__ = ["PartRoutes", "assemble_routes"]


class PartRoutes:
    """The routes of one part: ``prompt`` ``int16 (p, L', N, k)`` and ``completion``
    ``int16 (p*G, max_new_tokens, N, k)``, filled as the part's forward calls run."""

    def __init__(self, recorder: RouteRecorder, prompt_mask: Tensor, group_size: int, max_new_tokens: int):
        self.recorder, self.group_size, self.cached = recorder, group_size, 0
        p, width = prompt_mask.shape
        shape = (recorder.layers, recorder.top_k)
        device = prompt_mask.device
        self.prompt = torch.full((p, width, *shape), NOT_ROUTED, dtype=torch.int16, device=device)
        self.completion = torch.full((p * group_size, max_new_tokens, *shape), NOT_ROUTED, dtype=torch.int16,
                                     device=device)

    def prefilled(self, length: int) -> None:
        """After the shared prefill of the prompts' first ``length`` positions."""
        self.prompt[:, :length] = self.recorder.take((self.prompt.shape[0], length))
        self.cached = length

    def step(self, alive: Tensor, t: int) -> None:
        """After decode step ``t``'s forward on the rows ``alive`` (``long (b,)``)."""
        if t == 0:  # the prompt positions past the cache, every row (G copies of each prompt)
            routes = self.recorder.take((len(alive), self.prompt.shape[1] - self.cached))
            self.prompt[:, self.cached:] = routes[:: self.group_size]
        else:
            self.completion[alive, t - 1] = self.recorder.take((len(alive), 1))[:, 0]


def assemble_routes(parts: list[PartRoutes], prompt_mask: Tensor, sizes: list[int], width: int) -> ExpertRoutes:
    """The call's routes from its parts: the prompts' right-aligned in the call's ``(P, L)``
    ``prompt_mask`` (not routed on its padding), each completion row's first ``sizes[i]``
    positions in a ``width``-wide row."""
    layers, top_k = parts[0].prompt.shape[2:]
    prompt = torch.full((*prompt_mask.shape, layers, top_k), NOT_ROUTED, dtype=torch.int16, device=prompt_mask.device)
    start = 0
    for part in parts:
        p, columns = part.prompt.shape[:2]
        prompt[start:start + p, prompt_mask.shape[1] - columns:] = part.prompt
        start += p
    prompt[~prompt_mask] = NOT_ROUTED
    rows = torch.cat([part.completion for part in parts])
    completion = torch.full((rows.shape[0], width, layers, top_k), NOT_ROUTED, dtype=torch.int16, device=rows.device)
    for i, size in enumerate(sizes):
        completion[i, :size] = rows[i, :size]
    return ExpertRoutes(prompt, completion)
