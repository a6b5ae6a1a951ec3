"""An OpenEnv environment (``openenv-core``) run unchanged as an agent.

OpenEnv's environments follow a Gymnasium-style protocol: ``reset()`` gives the first
observation, ``step(action)`` the next one, each an ``Observation`` (pydantic) with ``done``,
``reward`` and the environment's own fields. Three kinds of object speak it, and all are read
here:

- an in-process ``Environment`` (synchronous), returning the observation itself;
- a client of an environment server (``EnvClient``: asynchronous, over a WebSocket; or its
  ``.sync()`` wrapper), returning a ``StepResult`` that holds the observation with its
  ``reward`` and ``done``;
- a server given by its URL (``"http://host:8000"``): each episode opens its own session with
  OpenEnv's ``GenericEnvClient``, whose actions and observations are plain dicts; nothing of the
  environment's package is needed here.

:func:`openenv_agent` makes an agent (``grpo_core.Trainer(agent=...)``) whose episode is one
environment episode as a chat: the row's prompt, then each observation as a user message; the
policy's answer, through the endpoint, becomes the action; the episode ends when the
environment says ``done`` (or after ``max_turns`` actions). The rewards of the steps, summed,
are the episode's reward (``env_reward``; None when the environment gave none).

A tool environment (OpenEnv's ``MCPEnvironment``: tools served over MCP, reached with
``ListToolsAction`` and ``CallToolAction``) is played with tool calls instead (``action=None``):
its tools are listed once and offered in every request, each tool call of an answer is a
``CallToolAction`` whose result (or error) is the tool message, and an answer with no tool call
ends the episode, as it ends an OpenAI-client tool loop.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any

from grpo_core.http import HTTPClient

#: Observation fields that are the protocol's, not what the environment shows.
PROTOCOL_FIELDS = {"done", "reward", "metadata"}


def observation_text(observation: Any) -> str:
    """What the policy reads of ``observation`` (an Observation, or a dict from a
    ``GenericEnvClient``): its one text field, or its own fields as JSON (``done``, ``reward``
    and ``metadata`` left out)."""
    dumped = observation if isinstance(observation, dict) else observation.model_dump()
    fields = {k: v for k, v in dumped.items() if k not in PROTOCOL_FIELDS}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields, default=str)


def text_action(action: Any) -> Callable[[str], Any]:
    """The action filled with the policy's answer: ``action`` an Action class with one required
    text field, the name of that field (a dict action, for a server reached by URL), or already
    a function from the policy's text to an action."""
    if isinstance(action, str):
        return lambda text: {action: text}
    if not isinstance(action, type):
        return action
    required = [name for name, f in action.model_fields.items() if f.is_required()]
    if len(required) != 1:
        raise ValueError(f"{action.__name__} has {len(required)} required fields ({', '.join(required)}); "
                         "pass action=a function from the policy's text to an action")
    return lambda text: action(**{required[0]: text})


def _unpack(result: Any) -> tuple[Any, float | None, bool]:
    """(observation, reward, done) of a reset or step result: an Observation, or a StepResult."""
    observation = getattr(result, "observation", result)
    reward = getattr(result, "reward", None)
    if reward is None:
        reward = observation.get("reward") if isinstance(observation, dict) else getattr(observation, "reward", None)
    done = bool(getattr(result, "done", False)) or bool(
        observation.get("done") if isinstance(observation, dict) else getattr(observation, "done", False))
    return observation, None if reward is None else float(reward), done


async def _call(environment: Any, method: str, *args: Any) -> Any:
    """``environment.method(*args)``: awaited for an asynchronous client, run in a worker
    thread for a synchronous environment (its step may block: a tool, a simulator), so that
    the other episodes' agents go on meanwhile."""
    function = getattr(environment, method)
    if inspect.iscoroutinefunction(function):
        return await function(*args)
    result = await asyncio.to_thread(function, *args)
    return await result if inspect.isawaitable(result) else result


def _maker(environment: Any) -> Callable[[], Any]:
    if isinstance(environment, str):
        if not environment.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"openenv_agent: {environment!r} is not a server URL (http://host:port); for an "
                             "installed environment by name pass lambda: AutoEnv.from_env(name, ...)")
        from openenv.core import GenericEnvClient

        return lambda: GenericEnvClient(base_url=environment)
    return environment


def openenv_agent(make_environment: Any, action: Any = None, *, text: Callable[[Any], str] = observation_text,
                  max_turns: int = 8) -> Callable[[Any], Any]:
    """An agent running one episode of an OpenEnv environment per grpo-core episode.

    ``make_environment``: a function making the environment (an ``Environment``, an
    ``EnvClient`` or its ``.sync()`` wrapper), or the URL of a running environment server.
    ``action``: the environment's Action class with one required text field, that field's name
    (for a server by URL), or a function from the policy's text to an action; None for a tool
    (MCP) environment, played with tool calls. ``text``: what the policy reads of an
    observation. ``max_turns``: model answers per episode at most.
    """
    make = _maker(make_environment)
    to_action = None if action is None else text_action(action)

    async def agent(episode: Any) -> float | None:
        environment = make()
        client = HTTPClient(timeout_s=episode.timeout, max_bytes=64 << 20)
        headers = {"Authorization": f"Bearer {episode.api_key}"}
        prompt = episode.row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        rewards: list[float] = []

        async def answer(**extra: Any) -> dict:
            body = {"model": episode.model, "messages": messages, **extra}
            response = await asyncio.to_thread(client.request, "POST", f"{episode.base_url}/chat/completions",
                                               json=body, headers=headers)
            return response.json()["choices"][0]["message"]

        try:
            if to_action is None:
                await _play_tools(environment, answer, messages, rewards, max_turns)
            else:
                await _play_text(environment, answer, messages, rewards, to_action, text, max_turns)
        finally:
            if callable(getattr(environment, "close", None)):
                await _call(environment, "close")
        return sum(rewards) if rewards else None

    agent.__name__ = "openenv_agent"
    return agent


async def _play_text(environment, answer, messages, rewards, to_action, text, max_turns) -> None:
    """Observations as user messages, answers as actions, until ``done``."""
    observation, _, done = _unpack(await _call(environment, "reset"))
    for _ in range(max_turns):
        shown = text(observation)
        if shown:
            messages.append({"role": "user", "content": shown})
        if done:
            return
        said = (await answer()).get("content") or ""
        messages.append({"role": "assistant", "content": said})
        observation, reward, done = _unpack(await _call(environment, "step", to_action(said)))
        if reward is not None:
            rewards.append(reward)
        if done:
            return


def tool_result_text(observation: Any) -> str:
    """What a tool message says of a ``CallToolObservation``: the error's message, else the
    text of the MCP result's content (its data, or the result as JSON, when it has no text)."""
    error = getattr(observation, "error", None)
    if error is not None:
        return f"Error: {getattr(error, 'message', error)}"
    result = getattr(observation, "result", None)
    content = getattr(result, "content", None)
    if content:
        texts = [getattr(part, "text", None) for part in content]
        if all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
    data = getattr(result, "data", result)
    return data if isinstance(data, str) else json.dumps(data, default=str)


async def _play_tools(environment, answer, messages, rewards, max_turns) -> None:
    """The tools listed once and offered in each request; each tool call a ``CallToolAction``;
    an answer without one ends the episode, as does ``done``."""
    from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

    _, _, done = _unpack(await _call(environment, "reset"))
    listed, _, _ = _unpack(await _call(environment, "step", ListToolsAction()))

    def field(tool: Any, name: str) -> Any:  # a Tool, or a dict from a GenericEnvClient
        return tool.get(name) if isinstance(tool, dict) else getattr(tool, name, None)

    tools = [{"type": "function", "function": {"name": field(t, "name"), "description": field(t, "description") or "",
                                               "parameters": field(t, "input_schema") or {"type": "object"}}}
             for t in (listed.get("tools") if isinstance(listed, dict) else getattr(listed, "tools", None)) or []]
    if not tools:
        metadata = (listed.get("metadata") if isinstance(listed, dict) else getattr(listed, "metadata", None)) or {}
        error = metadata.get("error")
        raise RuntimeError(f"the OpenEnv environment lists no tools{f' ({error})' if error else ''}: an "
                           "environment without tools takes text actions (pass action=)")
    for _ in range(max_turns):
        if done:
            return
        said = await answer(tools=tools)
        messages.append({k: v for k, v in said.items() if k in ("role", "content", "tool_calls")})
        calls = said.get("tool_calls") or []
        if not calls:
            return
        for call in calls:
            function = call.get("function") or {}
            shown = None
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except ValueError as exc:
                shown = f"Error: the arguments are not JSON ({exc})"
            else:
                if not isinstance(arguments, dict):
                    shown = "Error: the arguments are not a JSON object"
            if shown is None:
                observation, reward, done = _unpack(await _call(
                    environment, "step", CallToolAction(tool_name=function.get("name") or "", arguments=arguments)))
                shown = tool_result_text(observation)
                if reward is not None:
                    rewards.append(reward)
            messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": shown})
