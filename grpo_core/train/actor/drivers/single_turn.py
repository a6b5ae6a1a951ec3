"""The ``single-turn`` episode driver: one completion per episode, ``G`` of each prompt from one
batched ``backend.generate`` call (the prompt prefilled once); the default when the spec sets
no episode source. Prompts with images (``data.image_column``) pass them to the backend, and
the rollout keeps them for the learner's forward."""

from __future__ import annotations

from typing import Any

from grpo_core.contracts import DriverSetup, RolloutBackend, RolloutBatch, SamplingParams


class SingleTurn:
    """One completion per episode (module doc)."""

    multi_turn = False

    def __init__(self, options: Any = None) -> None:
        pass

    def setup(self, run: DriverSetup) -> None:
        """Nothing to set up: the backend does all the work."""

    def tools_for(self, row: dict[str, Any]) -> list[dict]:
        """No tools: a single turn cannot call one."""
        return []

    def run(self, backend: RolloutBackend, prompts: list, group_size: int, sampling: SamplingParams
            ) -> RolloutBatch:
        """``G = group_size`` completions of each of the ``P`` prompts: ``B = P*G`` rows."""
        images = [p.images for p in prompts]
        if all(i is None for i in images):
            return backend.generate([p.ids for p in prompts], group_size, sampling)
        rollout = backend.generate([p.ids for p in prompts], group_size, sampling, images=images)
        rollout.prompt_images = images
        return rollout
