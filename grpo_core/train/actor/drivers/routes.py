"""The ``routing`` episode driver: episodes that differ per dataset row (``rollout.routing``): a
column of each row names its route, and each route runs its rows with its own driver (by
default its source's: an in-process environment or an agent).

A rollout splits its prompts by route, runs each route's driver on its prompts (all ``G``
episodes of a prompt go the same way), and puts the rows back in the prompts' order, so the
rest of the step sees one batch. The tools a row's prompt shows are its route's."""

from __future__ import annotations

from typing import Any

from grpo_core.contracts import DriverSetup, EpisodeDriver, RolloutBatch, SamplingParams
from grpo_core.errors import RunError
from grpo_core.train.actor.drivers.episodes import source_of
from grpo_core.train.actor.rollout import concat_rollouts, select_rollout


class RoutedDriver:
    """Runs each row's episodes with the driver of the route its ``column`` names."""

    multi_turn = True

    def __init__(self, options: Any = None) -> None:
        self.column = ""
        self.drivers: dict[str, EpisodeDriver] = {}

    def setup(self, run: DriverSetup) -> None:
        routing = source_of(run, "routing", "routing")
        self.column = routing.column
        self.drivers = {name: run.driver(route.driver, route.source) for name, route in routing.routes.items()}

    def route(self, row: dict[str, Any]) -> str:
        name = row.get(self.column)
        if name not in self.drivers:
            raise RunError(f"rollout.routing: a row's column '{self.column}' is {name!r}, which names no route; "
                           f"routes: {', '.join(self.drivers)}")
        return name

    def tools_for(self, row: dict[str, Any]) -> list[dict]:
        """The tools shown in ``row``'s prompt: its route's."""
        return self.drivers[self.route(row)].tools_for(row)

    def run(self, backend: Any, prompts: list, group_size: int, sampling: SamplingParams) -> RolloutBatch:
        """``G = group_size`` episodes of each prompt, each prompt's by its route; rows in the
        prompts' order."""
        order: dict[str, list[int]] = {}
        for index, prompt in enumerate(prompts):
            order.setdefault(self.route(prompt.row), []).append(index)
        parts, placed = [], []
        for name, indices in order.items():
            parts.append(self.drivers[name].run(backend, [prompts[i] for i in indices], group_size, sampling))
            placed.extend(indices)
        merged = concat_rollouts(parts)
        position = {prompt: at for at, prompt in enumerate(placed)}
        return select_rollout(merged, [position[i] for i in range(len(prompts))])
