"""The ``environment`` episode driver: episodes of model turns and environment observations,
trained as one sequence per episode with a loss mask with holes.

Each turn is one batched ``backend.generate`` call for every episode still running (the
first turn generates ``G`` completions of each prompt, sharing its prefill; later turns
continue each episode from its own tokens with ``group_size=1``), so any rollout backend
(``hf``, ``vllm``) runs episodes through its ordinary contract. After a model turn the
environment's observation is rendered with the model's chat template and its tokens are
appended with mask False: they are context for later turns, never trained, never counted
in a normalizer. An episode ends when the environment says so, after
``max_turns`` model turns, or when ``max_total_tokens`` (model plus environment tokens
after the prompt) would be exceeded. A model turn that hits ``rollout.max_new_tokens``
without ending is still given to the environment (it may hold a complete tool call). An
episode counts as truncated (``rollout.mask_truncated_completions``,
``completions/clipped_ratio``) when the budget ended it or its last turn was cut.

The environment's tools are shown in every prompt
(:func:`~grpo_core.train.actor.drivers.episodes.with_tools`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from dataclasses import dataclass, replace
from typing import Any

from grpo_core.contracts import DriverSetup, Environment, RolloutBatch, SamplingParams
from grpo_core.train.actor.drivers.episodes import (
    EpisodeRecord,
    TurnRenderer,
    device_of,
    episodes_batch,
    source_of,
)


@dataclass
class EpisodeRunner:
    """Runs multi-turn episodes of ``environment`` with a rollout backend (see the module doc)."""

    environment: Environment
    tokenizer: Any
    max_turns: int
    max_total_tokens: int
    eos_ids: list[int]
    pad_id: int

    def __post_init__(self) -> None:
        self.renderer = TurnRenderer(self.tokenizer, self.eos_ids)

    @property
    def tools(self) -> list[dict]:
        return list(getattr(self.environment, "tools", None) or [])

    def run(self, backend: Any, prompts: list, group_size: int, sampling: SamplingParams) -> RolloutBatch:
        """``G = group_size`` episodes of each of the ``P`` prompts (:class:`Prompt`);
        a :class:`RolloutBatch` of ``B = P*G`` rows whose mask has holes."""
        stop = tuple(dict.fromkeys((*sampling.stop, *getattr(self.environment, "stop", ()))))
        episodes = [EpisodeRecord(list(p.ids), self.environment.reset(p.row))
                    for p in prompts for _ in range(group_size)]
        with_logp = True
        for turn in range(self.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            room = max(self.max_total_tokens - len(e.ids) for e in live)
            params = replace(sampling, stop=stop, max_new_tokens=min(sampling.max_new_tokens, room),
                             seed=None if sampling.seed is None else sampling.seed + 104_729 * turn)
            if turn == 0:  # every episode starts at its prompt: G per prompt, prefill shared
                batch = backend.generate([p.ids for p in prompts], group_size, params)
            else:
                batch = backend.generate([e.prompt_ids + e.ids for e in live], 1, params)
            with_logp = with_logp and batch.sampling_logp is not None
            answered = [(row, e, text) for row, e in enumerate(live)
                        if (text := self._model_turn(e, batch, row)) is not None]
            observations = self._steps([(e.state, text) for _, e, text in answered])
            for (row, e, _), obs in zip(answered, observations):
                self._observe(e, obs, bool(batch.truncated[row]))
        return self._assemble(prompts, episodes, backend, with_logp)

    def _model_turn(self, e: EpisodeRecord, batch: RolloutBatch, row: int) -> str | None:
        """Append one model turn (row ``row`` of ``batch``); its text for the environment, or
        None when the episode's token budget ran out inside it (the episode is over)."""
        n = int(batch.completion_mask[row].sum())
        new = batch.completion_ids[row, :n].tolist()
        room = self.max_total_tokens - len(e.ids)
        logp = batch.sampling_logp[row, :n].tolist() if batch.sampling_logp is not None else None
        cut = len(new) > room
        new, logp = new[:room], None if logp is None else logp[:room]
        e.extend(new, True, logp)
        text = self.tokenizer.decode(new, skip_special_tokens=True) if cut else batch.completions[row]
        e.messages.append({"role": "assistant", "content": text})
        e.turns += 1
        e.last_eos = bool(new) and new[-1] in self.eos_ids
        if cut:
            e.done = e.truncated = True
            return None
        return text  # a turn cut at max_new_tokens is answered too

    def _steps(self, calls: list[tuple[Any, str]]) -> list[Any]:
        """The environment's answers to every episode's turn: one after the other, or for an
        environment whose ``step`` is a coroutine function, awaited together (in an event loop
        of a helper thread, so that a caller inside a running loop, a notebook, is served)."""
        step = self.environment.step
        if not (inspect.iscoroutinefunction(step) or inspect.iscoroutinefunction(inspect.unwrap(step))):
            return [step(state, text) for state, text in calls]

        async def together() -> list[Any]:
            return await asyncio.gather(*(step(state, text) for state, text in calls))

        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["value"] = asyncio.run(together())
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                box["error"] = exc

        worker = threading.Thread(target=work, name="grpo-env-steps", daemon=True)
        worker.start()
        worker.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _observe(self, e: EpisodeRecord, obs: Any, cut_at_max_new_tokens: bool) -> None:
        """Append the environment's answer to the episode's last model turn."""
        e.tool_calls += int(obs.tool_calls)
        e.tool_errors += int(obs.tool_errors)
        if obs.reward is not None:
            e.reward = float(obs.reward)
        if obs.done or e.turns >= self.max_turns:
            e.done = True
            e.truncated = cut_at_max_new_tokens  # the last turn did not end by itself
            return
        ids = self.renderer.observation_ids(list(obs.messages), e.last_eos)
        if len(e.ids) + len(ids) >= self.max_total_tokens:  # no room left for another model token
            e.done = e.truncated = True
            return
        e.extend(ids, False)
        e.messages.extend(obs.messages)

    def _assemble(self, prompts: list, episodes: list[EpisodeRecord], backend: Any, with_logp: bool) -> RolloutBatch:
        return episodes_batch([p.ids for p in prompts], episodes, self.tokenizer, self.pad_id, device_of(backend),
                              with_logp)


class EnvironmentDriver:
    """The built-in ``environment`` episode driver: each prompt's ``G`` episodes answered turn by
    turn by the environment of ``rollout.environment`` (or of a route), through an
    :class:`EpisodeRunner`."""

    multi_turn = True

    def __init__(self, options: Any = None) -> None:
        self.runner: EpisodeRunner | None = None

    def setup(self, run: DriverSetup) -> None:
        slot = source_of(run, "environment", "environment")
        self.runner = EpisodeRunner(slot.build(), run.tokenizer, max_turns=slot.max_turns,
                                    max_total_tokens=slot.max_total_tokens, eos_ids=run.eos_ids, pad_id=run.pad_id)

    def tools_for(self, row: dict[str, Any]) -> list[dict]:
        """The environment's tools: every row's prompt shows them."""
        return self.runner.tools

    def run(self, backend: Any, prompts: list, group_size: int, sampling: SamplingParams) -> RolloutBatch:
        return self.runner.run(backend, prompts, group_size, sampling)
