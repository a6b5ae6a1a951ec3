"""TRL's tool loop as an agent: ``GRPOTrainer(tools=..., environment_factory=...)``.

TRL 1.16 runs tool calls inside its trainer (``GRPOTrainer._tool_call_loop``): the model's
turn is parsed for calls, each call runs the named Python function (a standalone tool, or a
public method of the rollout's environment), its result is appended as a ``tool`` message
(``str(result)``; a failure as ``{'error': '...'}``, an unknown tool as ``Tool NAME not
found.``), and the model goes on, at most ``max_tool_calling_iterations`` rounds. With
``environment_factory`` each rollout gets its own environment: ``reset(**row)`` starts it
(a string it returns is appended to the last user message), and ``get_reward()``, when the
class has it, scores the rollout.

grpo-core runs the same loop as an agent (:class:`TRLToolLoop`) against the endpoint it
serves during rollouts: the chat template shows the tools (their JSON schemas, read off the
functions' signatures and docstrings as TRL reads them) and the tool messages, the endpoint
parses the calls per model family (:mod:`grpo_core.endpoint.toolcalls`), and what trains is
the tokens the policy sampled. The environment's ``get_reward()`` is the agent's return value,
which reaches the rewards as ``env_reward``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

from grpo_core.http import HTTPClient

#: The methods of an environment that are not tools (TRL's rule: public methods are tools).
NOT_TOOLS = ("reset", "get_reward")


def environment_tools(environment: Any) -> list[Callable]:
    """The public methods of ``environment``'s class, bound to it, less reset and get_reward."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


def _schema(tool: Callable) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    return get_json_schema(tool)


def _run(tool: Callable, arguments: dict[str, Any]) -> Any:
    result = tool(**arguments)
    return asyncio.run(result) if inspect.isawaitable(result) else result


class TRLToolLoop:
    """An agent (a function of a :class:`~grpo_core.contracts.AgentEpisode`) that runs TRL's
    tool loop for one episode: ``tools`` (standalone functions), ``factories`` (``{None:
    factory}`` for one environment, ``{name: factory}`` selected by each row's
    ``environment`` column), at most ``max_iterations`` rounds of tool calls (None: until the
    episode's ``rollout.agent.max_calls``)."""

    __name__ = "trl_tool_loop"

    def __init__(self, tools: list[Callable], factories: Mapping[str | None, Callable] | None,
                 max_iterations: int | None):
        self.tools, self.factories, self.max_iterations = list(tools), dict(factories or {}), max_iterations

    def _environment(self, row: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if not self.factories:
            return None, row
        if None in self.factories:
            return self.factories[None](), row
        return self.factories[row["environment"]](), {k: v for k, v in row.items() if k != "environment"}

    def __call__(self, episode: Any) -> float | None:
        environment, fields = self._environment(dict(episode.row))
        messages = [dict(m) for m in episode.row["prompt"]] if not isinstance(episode.row["prompt"], str) else [
            {"role": "user", "content": episode.row["prompt"]}]
        if environment is not None:
            observation = environment.reset(**fields)
            if observation is not None:
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
        tools = {tool.__name__: tool for tool in [*self.tools, *environment_tools(environment)]}
        schemas = [_schema(tool) for tool in tools.values()]
        client = HTTPClient(timeout_s=episode.timeout, max_bytes=64 << 20)
        headers = {"Authorization": f"Bearer {episode.api_key}"}
        rounds = 0
        while True:
            body = {"model": episode.model, "messages": messages, **({"tools": schemas} if schemas else {})}
            answer = client.request("POST", f"{episode.base_url}/chat/completions", json=body, headers=headers).json()
            message = answer["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
            calls = message.get("tool_calls") or []
            if not calls or (self.max_iterations is not None and rounds >= self.max_iterations):
                break
            rounds += 1
            for call in calls:
                name = call["function"]["name"]
                try:
                    if name not in tools:
                        raise ValueError(f"Tool {name} not found.")
                    result = _run(tools[name], json.loads(call["function"]["arguments"]))
                except Exception as exc:  # noqa: BLE001 - a failing tool is the model's observation, as in TRL
                    result = {"error": str(exc)}
                messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": str(result)})
        if environment is not None and callable(getattr(environment, "get_reward", None)):
            reward = environment.get_reward()
            return float(asyncio.run(reward) if inspect.isawaitable(reward) else reward)
        return None
