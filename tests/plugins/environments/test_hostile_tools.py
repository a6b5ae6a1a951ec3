"""What a model writes, or a tool returns, never stops the run (issue 26, items 1-3): JSON
nested a thousand deep, a 5,000-digit number, a result JSON cannot encode and a tool that
calls ``sys.exit`` each become an ``error: ...`` message the model sees next turn."""

from __future__ import annotations

import argparse
import sys

import pytest
from grpo_plugins.environments.tools import ToolsEnvironment, ToolsOptions, parse_tool_calls


def echo(text: str) -> str:
    """Echo the text.

    Args:
        text: What to echo.
    """
    return text


def tuple_keys(n: int) -> dict:
    """A dict JSON cannot encode.

    Args:
        n: How many keys.
    """
    return {(i, i): i for i in range(n)}


def loop(n: int) -> list:
    """A list that holds itself.

    Args:
        n: Ignored.
    """
    out: list = [n]
    out.append(out)
    return out


def cli(flags: str) -> str:
    """A tool built on argparse, which exits on a bad flag.

    Args:
        flags: Command-line flags.
    """
    parser = argparse.ArgumentParser(prog="cli")
    parser.add_argument("--n", type=int, required=True)
    return str(parser.parse_args(flags.split()).n)


def quits(code: int) -> str:
    """Calls sys.exit.

    Args:
        code: The exit code.
    """
    sys.exit(code)


@pytest.fixture(scope="module")
def env() -> ToolsEnvironment:
    return ToolsEnvironment([echo, tuple_keys, loop, cli, quits], ToolsOptions(tools=[], tool_timeout=5.0))


def _only_message(env: ToolsEnvironment, text: str) -> str:
    observation = env.step(env.reset({}), text)
    assert not observation.done and observation.tool_calls == 1 and observation.tool_errors == 1
    (message,) = observation.messages
    return message["content"]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("[" * 1000, "JSON nested too deep"),
        ('{"name": "echo", "arguments": ' + "[" * 5000 + "}", "JSON nested too deep"),
        ('{"name": "echo", "arguments": {"text": ' + "7" * 5000 + "}}", "4300 digits"),
        ('{"name": "echo", "arguments": "' + "[" * 2000 + '"}', "'arguments' must be a JSON object"),
    ],
    ids=["list-1000-deep", "arguments-5000-deep", "5000-digit-number", "string-arguments-2000-deep"],
)
def test_hostile_json_is_a_malformed_call_message(env, body, problem):
    # Python's default recursion limit, as in a training process: a library loaded earlier in
    # the same test process may have raised it, and "[" * 1000 would then parse up to its end
    # ("Expecting value", still a malformed call) instead of hitting the limit.
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        _check_malformed(env, body, problem)
    finally:
        sys.setrecursionlimit(previous)


def _check_malformed(env, body, problem):
    text = f"<tool_call>{body}</tool_call>"
    (call,) = parse_tool_calls(text)
    assert isinstance(call, str) and call.startswith("malformed tool call") and problem in call
    assert _only_message(env, text).startswith("error: malformed tool call")


@pytest.mark.parametrize("tool", ["tuple_keys", "loop"])
def test_a_result_json_cannot_encode_is_an_error_message(env, tool):
    message = _only_message(env, f'<tool_call>{{"name": "{tool}", "arguments": {{"n": 2}}}}</tool_call>')
    assert message.startswith(f"error: tool '{tool}' returned a ") and "JSON cannot encode" in message


def test_a_tool_calling_sys_exit_is_an_error_message_and_the_episode_goes_on(env):
    message = _only_message(env, '<tool_call>{"name": "cli", "arguments": {"flags": "--bad"}}</tool_call>')
    assert message == "error: tool 'cli' raised SystemExit (sys.exit(2) was called)"
    message = _only_message(env, '<tool_call>{"name": "quits", "arguments": {"code": 0}}</tool_call>')
    assert message == "error: tool 'quits' raised SystemExit (sys.exit(0) was called)"
    # The same environment still answers well-formed calls.
    observation = env.step(env.reset({}), '<tool_call>{"name": "cli", "arguments": {"flags": "--n 4"}}</tool_call>')
    assert observation.tool_errors == 0 and observation.messages[0]["content"] == "4"
