"""Streaming agents (issue 48, item 2): ``stream: true`` on /v1/chat/completions and
/v1/completions, with the official ``openai`` client. A streaming episode trains exactly the
tokens the same episode trains unstreamed; the chunks carry the text token by token, tool-call
deltas, a usage chunk and ``[DONE]``."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from grpo_plugins.environments.calculator import calculator

from grpo_core import Trainer

from .test_agents import CALL, TOOLS, ScriptedPlugin, _spec, calculator_agent, long_model  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def _streamed_turn(client, episode, messages, seen):
    """One chat call in stream mode, its chunks assembled as an agent library does."""
    stream = client.chat.completions.create(model=episode.model, messages=messages, tools=TOOLS, stream=True,
                                            stream_options={"include_usage": True})
    content, calls, finish, chunks, usage = "", {}, None, 0, None
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": None, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["function"]["name"] += call.function.name or ""
                    slot["function"]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    seen.append({"chunks": chunks, "usage": usage, "finish": finish, "calls": len(calls)})
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def test_a_streaming_episode_trains_the_tokens_of_the_same_episode_unstreamed(long_model, tmp_path):  # noqa: F811
    """The calculator tool loop twice over the endpoint, unstreamed and streamed (tool-call
    deltas assembled by the agent): the recorded sequences are equal token for token, and
    every stream ended with a usage chunk."""
    seen: list[dict] = []

    def streaming_agent(episode):
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=60) as client:
            messages = list(episode.row["prompt"])
            for _ in range(3):
                message = _streamed_turn(client, episode, messages, seen)
                messages.append(message)
                if "tool_calls" not in message:
                    return None
                for call in message["tool_calls"]:
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": calculator(**json.loads(call["function"]["arguments"]))})
        return None

    rollouts = []
    for name, agent in (("plain", calculator_agent), ("streamed", streaming_agent)):
        spec = _spec(long_model, tmp_path / name, name="scripted", agent={"max_total_tokens": 240, "concurrency": 8})
        rollouts.append(Trainer(spec, agent=agent, plugins=[ScriptedPlugin()])._build().actor.collect(0).scored.rollout)
    plain, streamed = rollouts
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(plain, field), getattr(streamed, field)), field
    assert streamed.episodes.turns.tolist() == [2] * 8 and streamed.episodes.tool_calls.tolist() == [1] * 8
    assert not streamed.episodes.failed.any()
    assert len(seen) == 16
    assert sorted((s["finish"], s["calls"]) for s in seen) == [("stop", 0)] * 8 + [("tool_calls", 1)] * 8
    assert all(s["usage"] is not None and s["usage"].completion_tokens > 0 for s in seen)
    answers = [s for s in seen if s["finish"] == "stop"]
    assert all(s["chunks"] > 4 for s in answers)  # role, the text token by token, finish, usage


def test_streamed_chunks_are_the_sampled_tokens_with_the_hf_backend(long_model, tmp_path):  # noqa: F811
    """The real policy: a coroutine agent streams a chat turn, then a completions turn; the
    token ids of its chunks, joined, are what the episode trains, and their texts are the
    decoded tokens."""
    got: dict[int, dict] = {}

    async def agent(episode):
        async with openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
            ids, text, usage, done = [], "", None, 0
            stream = await client.chat.completions.create(model=episode.model, messages=episode.row["prompt"],
                                                          max_tokens=6, stream=True,
                                                          stream_options={"include_usage": True})
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    ids += (choice.model_extra or {}).get("token_ids") or []
                    done += choice.finish_reason is not None
            got[episode.index] = {"ids": ids, "text": text, "usage": usage, "done": done}
        return float(len(text))

    spec = _spec(long_model, tmp_path / "o", agent={"concurrency": 8}, max_new_tokens=6, group_size=2)
    spec["rewards"] = [{"name": "env_reward"}]
    spec["train"]["prompts_per_step"] = 1
    run = Trainer(spec, agent=agent)._build()
    rollout = run.actor.collect(0).scored.rollout
    assert not rollout.episodes.failed.any()
    for row in range(2):
        trained = rollout.completion_ids[row][rollout.completion_mask[row]].tolist()
        assert got[row]["ids"] == trained and got[row]["done"] == 1
        assert got[row]["text"] == run.tokenizer.decode(trained, skip_special_tokens=True)
        assert got[row]["usage"].completion_tokens == len(trained)


def test_a_streamed_completion_and_the_stream_helper(long_model, tmp_path):  # noqa: F811
    """/v1/completions in stream mode ends with [DONE] (the client stops there) and joins to
    the unstreamed text; the client's chat ``stream()`` helper assembles a final completion
    whose tool call is the one the policy wrote."""
    texts: dict[int, str] = {}
    finals: dict[int, object] = {}

    def agent(episode):
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=60) as client:
            if episode.index == 0:
                with client.chat.completions.stream(model="policy", messages=episode.row["prompt"],
                                                    tools=TOOLS) as stream:
                    for _ in stream:
                        pass
                    finals[episode.index] = stream.get_final_completion()
                return None
            pieces = client.completions.create(model="policy", prompt="What is 2+3?", stream=True)
            texts[episode.index] = "".join(c.choices[0].text for c in pieces if c.choices)
        return None

    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 240})
    spec["train"]["prompts_per_step"] = 1
    Trainer(spec, agent=agent, plugins=[ScriptedPlugin()])._build().actor.collect(0)
    for final in finals.values():
        call = final.choices[0].message.tool_calls[0]
        assert final.choices[0].finish_reason == "tool_calls"
        assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "2+3"})
    assert len(finals) == 1 and texts == {1: CALL}
