"""Multi-turn rollouts: episodes of model turns and environment observations, trained as
one sequence per episode with a loss mask with holes.

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

Tool prompts: when the tokenizer's chat template renders ``tools`` (Qwen, Llama 3,
Hermes-style templates) the environment's JSON schemas are passed to it. When it ignores
them (SmolLM2's ChatML template, for one) a system message in this module's plain-text
convention (:data:`TOOL_PROMPT`) lists the schemas and the call format
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; an existing system message
gets it appended.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from grpo_core.contracts import Environment, Episodes, RolloutBatch, SamplingParams, left_pad
from grpo_core.errors import RunError

TOOL_PROMPT = (
    "You can call these tools:\n<tools>\n{schemas}\n</tools>\n"
    "To call a tool, write <tool_call>{{\"name\": \"<tool name>\", \"arguments\": {{<JSON arguments>}}}}</tool_call> "
    "and stop; the result comes back in a tool message. When you know the answer, reply without a tool call."
)
_SENTINEL = "\x00GRPO-TURN\x00"


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def template_renders_tools(tokenizer, tools: list[dict]) -> bool:
    """Whether the chat template shows ``tools`` to the model (its rendering changes)."""
    probe = [{"role": "user", "content": "x"}]
    return _render(tokenizer, probe, tools=tools, add_generation_prompt=True) != _render(
        tokenizer, probe, add_generation_prompt=True)


def with_tools(tokenizer, messages: list[dict], tools: list[dict]) -> tuple[list[dict], dict[str, Any]]:
    """``(messages, template kwargs)`` that show ``tools`` to the model: ``tools=`` for a
    template that renders them, else the :data:`TOOL_PROMPT` system message."""
    if not tools:
        return messages, {}
    if template_renders_tools(tokenizer, tools):
        return messages, {"tools": tools}
    text = TOOL_PROMPT.format(schemas="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]], {}
    return [{"role": "system", "content": text}, *messages], {}


class TurnRenderer:
    """Token ids of an observation, rendered by the chat template as it would render the
    conversation: the end of the model's turn the model did not write itself, then the
    observation's messages, then the header of the next assistant turn."""

    def __init__(self, tokenizer, eos_ids: list[int]):
        if not getattr(tokenizer, "chat_template", None):
            raise RunError("rollout.environment needs a tokenizer with a chat template (the tokenizer has none)")
        self.tokenizer = tokenizer
        self.probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        self.base = _render(tokenizer, self.probe)
        at = self.base.rfind(_SENTINEL)
        if at < 0:
            raise RunError("rollout.environment: the chat template drops assistant messages; cannot render turns")
        self.tail = self.base[at + len(_SENTINEL):]  # what closes an assistant turn, e.g. "<|im_end|>\n"
        self.eos_texts = [tokenizer.decode([i]) for i in eos_ids]

    def observation_ids(self, messages: list[dict], ended_with_eos: bool) -> list[int]:
        try:
            full = _render(self.tokenizer, self.probe + messages, add_generation_prompt=True)
        except Exception as exc:
            roles = sorted({str(m.get("role")) for m in messages})
            raise RunError(
                f"rollout.environment: the chat template cannot render messages with role(s) {roles}: "
                f"{type(exc).__name__}: {exc} (the tools environment takes role: user)") from exc
        if not full.startswith(self.base):
            raise RunError("rollout.environment: the chat template re-renders earlier turns when a message is "
                           "added, so observations cannot be appended as tokens")
        closing = self.tail
        if ended_with_eos:  # the model wrote the turn's end token itself
            closing = next((closing[len(e):] for e in self.eos_texts if e and closing.startswith(e)), closing)
        return self.tokenizer(closing + full[len(self.base):], add_special_tokens=False)["input_ids"]


@dataclass
class EpisodeRecord:
    """One episode as it runs: its tokens after the prompt (the model's under ``mask``), the
    sampler's log-probs of them, the conversation after the prompt, its counts."""

    prompt_ids: list[int]
    state: Any
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None
    done: bool = False
    truncated: bool = False
    last_eos: bool = False  # the last model turn ended with an EOS token
    splits: list[int] = field(default_factory=list)  # where its 2nd, 3rd... training sample start in ids

    def extend(self, ids: list[int], trained: bool, logp: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [trained] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)


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
        return episodes_batch([p.ids for p in prompts], episodes, self.tokenizer, self.pad_id, _device_of(backend),
                              with_logp)


def episodes_batch(prompts: list[list[int]], episodes: list[EpisodeRecord], tokenizer: Any, pad_id: int,
                   device: torch.device, with_logp: bool, failed: list[bool] | None = None) -> RolloutBatch:
    """The :class:`RolloutBatch` of ``B = P*G`` episodes (prompt-major) after the ``P``
    prompts' token ids: each episode's tokens are its completion, the model's under the mask,
    the rest context; ``failed`` marks episodes an agent failed."""
    width = max(1, max(len(e.ids) for e in episodes))
    rows = len(episodes)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    logp = torch.zeros((rows, width), dtype=torch.float32) if with_logp else None
    for i, e in enumerate(episodes):
        ids[i, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
        mask[i, : len(e.ids)] = torch.tensor(e.mask, dtype=torch.bool)
        if logp is not None:
            logp[i, : len(e.ids)] = torch.tensor(e.logp, dtype=torch.float32)
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    record = Episodes(
        messages=[e.messages for e in episodes], env_rewards=[e.reward for e in episodes],
        turns=torch.tensor([e.turns for e in episodes]), tool_calls=torch.tensor([e.tool_calls for e in episodes]),
        tool_errors=torch.tensor([e.tool_errors for e in episodes]),
        lengths=torch.tensor([len(e.ids) for e in episodes]),
        failed=torch.tensor(failed if failed is not None else [False] * rows, dtype=torch.bool),
        splits=[list(e.splits) for e in episodes] if any(e.splits for e in episodes) else None,
    )
    return RolloutBatch(
        prompt_ids.to(device), prompt_mask.to(device), ids.to(device), mask.to(device),
        torch.tensor([e.truncated for e in episodes], device=device),
        tokenizer.batch_decode([e.ids for e in episodes], skip_special_tokens=False),
        None if logp is None else logp.to(device), episodes=record,
    )


def _device_of(backend: Any) -> torch.device:
    """Where the backend's rollouts live: its capabilities' ``device`` (None is the CPU)."""
    device = backend.capabilities.device
    return torch.device(device) if device is not None else torch.device("cpu")


def episode_metrics(episodes: Episodes, mask: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """Per-episode means: ``env/turns_per_episode``, ``env/tool_calls``, ``env/tool_errors``,
    ``env/model_tokens``, ``env/env_tokens``, ``env/samples_per_episode`` (training samples:
    more than 1 where an agent's history was split); ``env/tool_call_rate`` (episodes with at
    least one call) and ``env/tool_success_rate`` (calls without error, over all calls)."""
    model_tokens = mask.sum(dim=1).float().cpu()
    calls, errors = episodes.tool_calls.float(), episodes.tool_errors.float()
    out = {
        "env/turns_per_episode": float(episodes.turns.float().mean()),
        "env/tool_calls": float(calls.mean()),
        "env/tool_errors": float(errors.mean()),
        "env/model_tokens": float(model_tokens.mean()),
        "env/env_tokens": float((episodes.lengths.float() - model_tokens).mean()),
        "env/tool_call_rate": float((calls > 0).float().mean()),
        "env/samples_per_episode": float(episodes.samples.float().mean()),
    }
    if calls.sum() > 0:
        out["env/tool_success_rate"] = float(1 - errors.sum() / calls.sum())
    if episodes.failed is not None:
        out["env/failed_episodes"] = float(episodes.failed.float().mean())
    return {f"{prefix}{k}": v for k, v in out.items()}
