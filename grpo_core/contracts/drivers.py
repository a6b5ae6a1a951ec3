"""The episode driver contract: what runs a prompt's ``G`` episodes with the rollout backend
and returns the group's rollouts (single turn, environment turns, agent programs, per-row
routes, or a plugin's own), and what a run gives it when it is set up."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from grpo_core.contracts.rollout import RolloutBackend, RolloutBatch, SamplingParams


@dataclass(frozen=True)
class DriverSetup:
    """What a run gives an episode driver once, before its first rollout
    (:meth:`EpisodeDriver.setup`).

    Attributes:
        tokenizer: the policy's tokenizer (its chat template renders turns).
        eos_ids: the token ids that end a model turn; pad_id: the padding id of rollouts.
        group_size: ``G``, the most completions one request may ask for.
        source: the spec section the driver runs: ``rollout.environment`` (an environment
            slot, ``source.build()`` the environment), ``rollout.agent`` (an agent slot),
            ``rollout.routing`` (the routes), a route's environment or agent, or None
            (single turn).
        chat_template_kwargs: ``data.chat_template_kwargs``, for prompts a driver renders.
    """

    tokenizer: Any
    eos_ids: list[int]
    pad_id: int
    group_size: int
    source: Any = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def driver(self, slot: Any, source: Any) -> EpisodeDriver:
        """Another driver, built from its spec ``slot`` and set up to run ``source``: how the
        built-in ``routing`` driver runs each route."""
        built = slot.build()
        built.setup(replace(self, source=source))
        return built


@runtime_checkable
class EpisodeDriver(Protocol):
    """How a prompt's ``G`` episodes run: one completion each (single turn), model turns
    answered by an environment, agent programs talking to an endpoint, or each row its own
    way. Selected by ``rollout.driver.name``; unset, the spec's episode source names it
    (``single-turn``, ``environment``, ``agent`` or ``routing``).

    ``setup(run)`` is called once per run with a :class:`DriverSetup`, before any rollout.
    ``tools_for(row)`` gives the tool schemas a dataset row's prompt shows (transformers'
    format; empty for none). ``run(backend, prompts, group_size, sampling)`` runs
    ``G = group_size`` episodes of each of the ``P`` prompts with the rollout backend (any
    :class:`~grpo_core.contracts.RolloutBackend`, called through its ``generate``) and
    returns their :class:`~grpo_core.contracts.RolloutBatch` of ``B = P*G`` rows,
    prompt-major. Each prompt has ``ids`` (its token ids), ``row`` (its dataset row) and
    ``images`` (:class:`~grpo_core.contracts.PromptImages` or None). A multi-turn batch carries
    its :class:`~grpo_core.contracts.Episodes` and a loss mask with holes (only the policy's tokens True).

    Optional flag: ``multi_turn`` (default False): its rollouts are multi-turn episodes, on which
    process supervision (step scores) is refused.
    """

    multi_turn: bool = False

    def setup(self, run: DriverSetup) -> None: ...

    def tools_for(self, row: dict[str, Any]) -> list[dict[str, Any]]: ...

    def run(self, backend: RolloutBackend, prompts: Sequence[Any], group_size: int,
            sampling: SamplingParams) -> RolloutBatch: ...
