"""Environment ``tools``: function calling with plain Python functions.

A tool is a plain function with type hints and a Google-style docstring (``Args:``), as
transformers' chat templates accept them (``apply_chat_template(..., tools=[fn])``); its
JSON schema comes from ``transformers.utils.get_json_schema``. The model calls a tool by
writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the format of the
Qwen/Hermes tool templates; models whose template has no tool support are shown the same
format in the system prompt, see :mod:`grpo_core.train.actor.drivers.episodes`). A model turn ends at
``</tool_call>``; every call in it runs, and each result comes back as a ``tool`` message.
A turn without a tool call ends the episode.

Faults never stop the run: a malformed call (including JSON nested too deep or a number too
long to parse), an unknown tool, bad arguments, a tool that raises (even ``SystemExit``, as
argparse inside a tool does) or returns what JSON cannot encode becomes an ``error: ...``
tool message; a call that does not return within
``tool_timeout`` seconds is abandoned (its worker thread is left to finish on its own: a
Python thread cannot be killed) and reported the same way. Output longer than
``max_tool_output_chars`` is cut. Tools run in the trainer's process, with its
permissions: only register tools you would run yourself.

To ship your own tools, no class is needed::

    from grpo_core import hookimpl
    from grpo_plugins.environments import ToolsOptions, tools_environment

    def lookup(city: str) -> str:
        \"\"\"The weather in a city.

        Args:
            city: The city's name.
        \"\"\"
        return "sunny"

    @hookimpl
    def register_environments(register):
        register.add("weather", tools_environment(lookup), options=ToolsOptions)
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from typing import Any, Literal

from grpo_plugins.environments.calculator import calculator
from pydantic import Field

from grpo_core import hookimpl
from grpo_core.contracts import Observation
from grpo_core.errors import PluginError, fault_text
from grpo_core.options import Options, Seconds

__all__ = ["ToolsOptions", "ToolsEnvironment", "tools_environment", "parse_tool_calls", "env_reward", "tool_success",
           "BUILTIN_TOOLS"]

#: Tools the built-in ``tools`` environment can offer by name.
BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_JSON = json.JSONDecoder()
TOOL_CALL_FORMAT = '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'


class ToolsOptions(Options):
    """Options of a tools environment."""

    tools: list[Literal["calculator"]] = Field(
        default_factory=lambda: ["calculator"],
        description="Built-in tools to offer (the built-in 'tools' environment only; an environment "
        "made with tools_environment(fn, ...) offers its own functions plus these).",
    )
    tool_timeout: Seconds = Field(5.0, gt=0, description="Seconds one tool call may take before it is abandoned "
                                "and reported to the model as an error.")
    max_tool_output_chars: int = Field(1000, ge=1, description="A tool's output is cut to this many characters.")
    max_calls_per_turn: int = Field(
        4, ge=1, description="Tool calls run per model turn at most; the rest get an error."
    )
    role: Literal["tool", "user"] = Field(
        "tool", description="Role of the messages holding tool results: tool (chat templates with a "
        "tool role, ChatML renders any role), or user for templates that refuse other roles.",
    )


def parse_tool_calls(text: str) -> list[tuple[str, dict] | str]:
    """The tool calls in ``text``: ``(name, arguments)`` per well-formed call, an error
    message (a string) per malformed one. A call is the first JSON object after
    ``<tool_call>``; an unterminated last call counts too (a turn cut at its token limit)."""
    calls: list[tuple[str, dict] | str] = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        try:  # the first JSON value; text after it (a small model's chatter) is ignored
            call, _ = _JSON.raw_decode(body)
        except (ValueError, RecursionError) as exc:  # RecursionError: '[[[[...' nested too deep
            calls.append(f"malformed tool call ({_json_problem(exc)}); write {TOOL_CALL_FORMAT}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(f"malformed tool call: a JSON object with a string 'name' is needed; write {TOOL_CALL_FORMAT}")
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                pass
        if not isinstance(arguments, dict):
            calls.append(f"malformed tool call: 'arguments' must be a JSON object; write {TOOL_CALL_FORMAT}")
            continue
        calls.append((call["name"], arguments))
    return calls


def _json_problem(exc: BaseException) -> str:
    """What is wrong with a tool call's JSON, in words: a ``JSONDecodeError``'s message, or
    the reason of the other errors decoding raises (a 5,000-digit number is a plain
    ``ValueError``, deep nesting a ``RecursionError``)."""
    if isinstance(exc, RecursionError):
        return "JSON nested too deep"
    return getattr(exc, "msg", None) or str(exc).split(";")[0][:200]


def _encoded(value: Any) -> str:
    """A tool's result as the model sees it: a string as it is, anything else as JSON
    (unknown types as their ``str``); raises ``ValueError`` when JSON cannot encode it (a
    dict with tuple keys, a list holding itself, a number too large)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"returned a {type(value).__name__} that JSON cannot encode ({exc})") from None


def _run_with_timeout(fn: Callable[..., Any], arguments: dict, timeout: float) -> Any:
    """``fn(**arguments)`` on a daemon worker thread; raises ``TimeoutError`` after ``timeout``."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn(**arguments)
        except BaseException as exc:  # noqa: BLE001 - everything a tool raises is reported
            box["error"] = exc

    worker = threading.Thread(target=work, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError(f"did not return within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class ToolsEnvironment:
    """Function calling: each model turn's tool calls run, their results are the next
    observation; a turn without a tool call ends the episode (no reward of its own)."""

    stop = ("</tool_call>",)

    def __init__(self, functions: list[Callable[..., Any]], options: ToolsOptions | None = None):
        from transformers.utils import get_json_schema

        self.options = options or ToolsOptions()
        self.functions: dict[str, Callable[..., Any]] = {}
        for fn in [*functions, *(BUILTIN_TOOLS[name] for name in self.options.tools)]:
            self.functions.setdefault(fn.__name__, fn)
        self.tools = [get_json_schema(fn) for fn in self.functions.values()]

    def reset(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"row": row}

    def step(self, state: Any, text: str) -> Observation:
        calls = parse_tool_calls(text)
        if not calls:
            return Observation(done=True)
        messages, errors = [], 0
        for index, call in enumerate(calls):
            if index >= self.options.max_calls_per_turn:
                output, ok = f"error: more than {self.options.max_calls_per_turn} tool calls in one turn", False
            else:
                output, ok = self._call(call)
            errors += not ok
            messages.append({"role": self.options.role, "content": self._cut(output)})
        return Observation(messages=messages, tool_calls=len(calls), tool_errors=errors)

    def _call(self, call: tuple[str, dict] | str) -> tuple[str, bool]:
        """The text of one call's result and whether it succeeded."""
        if isinstance(call, str):
            return f"error: {call}", False
        name, arguments = call
        fn = self.functions.get(name)
        if fn is None:
            return f"error: unknown tool {name!r}; available: {', '.join(self.functions)}", False
        try:
            value = _run_with_timeout(fn, arguments, self.options.tool_timeout)
        except TimeoutError as exc:
            return f"error: tool {name!r} {exc}", False
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: the model sees what went wrong
            return f"error: tool {name!r} raised {fault_text(exc)}", False
        try:
            return _encoded(value), True
        except ValueError as exc:
            return f"error: tool {name!r} {exc}", False

    def _cut(self, output: str) -> str:
        limit = self.options.max_tool_output_chars
        return output if len(output) <= limit else output[:limit] + " ...[truncated]"


def tools_environment(*functions: Callable[..., Any]) -> Callable[[ToolsOptions], ToolsEnvironment]:
    """A factory for ``register.add(name, factory, options=ToolsOptions)``: an environment
    offering ``functions`` (plain functions with type hints and an ``Args:`` docstring).
    The built-in tools listed in the options are added unless ``tools: []``."""
    from transformers.utils import get_json_schema

    for fn in functions:  # fail at registration, naming the function, when it has no schema
        try:
            get_json_schema(fn)
        except Exception as exc:
            raise PluginError(
                f"tool {getattr(fn, '__name__', fn)!r} has no JSON schema ({type(exc).__name__}: {exc}); a tool "
                "needs a type hint on every argument and a docstring describing each under 'Args:'"
            ) from exc

    def build(options: ToolsOptions) -> ToolsEnvironment:
        return ToolsEnvironment(list(functions), options)

    build.__doc__ = f"tools: {', '.join(fn.__name__ for fn in functions)}"
    return build


def env_reward(prompts: list, completions: list, env_reward: list | None = None, **columns: Any) -> list:
    """The environment's own reward of each episode (None where it gave none)."""
    if env_reward is None:
        from grpo_core.errors import RunError

        raise RunError("reward function 'env_reward' needs rollout.environment: without an environment "
                       "there is no env_reward column")
    return [None if r is None else float(r) for r in env_reward]


def tool_success(prompts: list, completions: list, **columns: Any) -> list:
    """1.0 when the episode holds a tool result that is not an error (a ``tool`` message
    not starting with ``error:``), else 0.0: a shaping reward for learning to call tools."""
    def ok(message: Any) -> bool:
        return (isinstance(message, dict) and message.get("role") == "tool"
                and not str(message.get("content", "")).startswith("error:"))

    return [1.0 if isinstance(c, list) and any(ok(m) for m in c) else 0.0 for c in completions]


@hookimpl
def register_reward_functions(register) -> None:
    """Register ``env_reward`` (the environment's reward) and ``tool_success``."""
    register.add("env_reward", env_reward)
    register.add("tool_success", tool_success)


@hookimpl
def register_environments(register) -> None:
    """Register the ``tools`` environment (built-in tools: calculator)."""
    register.add(
        "tools",
        tools_environment(),
        options=ToolsOptions,
        description="function calling with plain Python functions as tools (built-in: calculator)",
    )
