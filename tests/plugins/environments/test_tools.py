"""The tools environment (grpo_plugins.environments.tools): parsing calls, plain functions as
tools, how tools reach the prompt, and the env_reward reward."""

from __future__ import annotations

import pytest
from grpo_plugins.environments.tools import ToolsOptions, env_reward, parse_tool_calls, tool_success, tools_environment

from grpo_core.contracts import completion_text
from grpo_core.errors import PluginError, RunError
from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_tokenizer
from grpo_core.train.actor.drivers.episodes import TOOL_PROMPT, template_renders_tools, with_tools


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no call here", []),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', [("add", {"a": 1, "b": 2})]),
        ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', [("add", {"a": 1})]),
        ('x <tool_call> {"name": "f"} </tool_call> y <tool_call>{"name": "g", "arguments": {}}',
         [("f", {}), ("g", {})]),  # an unterminated last call counts (the turn stopped mid-way)
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}\n\nThis can be shown', [("add", {"a": 1})]),
    ],
)
def test_parse_tool_calls(text, expected):
    assert parse_tool_calls(text) == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("<tool_call>{name: add}</tool_call>", "malformed tool call (Expecting property name"),
        ('<tool_call>["add"]</tool_call>', "a JSON object with a string 'name'"),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "'arguments' must be a JSON object"),
    ],
)
def test_malformed_calls_become_messages_that_show_the_format(text, needle):
    [error] = parse_tool_calls(text)
    assert isinstance(error, str) and needle in error and '<tool_call>{"name": "<tool>"' in error


def test_a_plain_function_is_a_tool_with_its_json_schema():
    env = tools_environment(add)(ToolsOptions(tools=[]))
    assert [t["function"]["name"] for t in env.tools] == ["add"]
    params = env.tools[0]["function"]["parameters"]
    assert params["properties"]["a"] == {"type": "integer", "description": "The first."}
    assert params["required"] == ["a", "b"]
    obs = env.step(env.reset({}), '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>')
    assert obs.messages == [{"role": "tool", "content": "42"}] and not obs.done
    assert (obs.tool_calls, obs.tool_errors) == (1, 0)
    assert env.step(env.reset({}), "The answer is 42.").done  # no call: the episode ends


def test_more_calls_than_allowed_in_one_turn_are_errors():
    env = tools_environment(add)(ToolsOptions(tools=[], max_calls_per_turn=1, role="user"))
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    obs = env.step(env.reset({}), call * 2)
    assert [m["content"] for m in obs.messages] == ["2", "error: more than 1 tool calls in one turn"]
    assert [m["role"] for m in obs.messages] == ["user", "user"]
    assert (obs.tool_calls, obs.tool_errors) == (2, 1)


def test_a_function_without_a_documented_signature_is_refused_at_registration():
    def bare(x):
        return x

    with pytest.raises(PluginError, match="tool 'bare' has no JSON schema .*type hint on every argument"):
        tools_environment(bare)


def test_builtins_are_registered():
    registry = load_plugins(external=False).registry
    tools = registry.get("environment", "tools")
    assert tools.options is ToolsOptions
    env = tools.build(ToolsOptions())
    assert [t["function"]["name"] for t in env.tools] == ["calculator"] and env.stop == ("</tool_call>",)
    assert registry.get("reward_function", "env_reward").impl is env_reward


def test_env_reward_returns_the_environment_reward_and_needs_an_environment():
    assert env_reward(["p"] * 3, ["c"] * 3, env_reward=[1, None, 0.5]) == [1.0, None, 0.5]
    with pytest.raises(RunError, match="needs rollout.environment"):
        env_reward(["p"], ["c"], answer=["1"])


def test_tool_success_pays_for_a_tool_result_that_is_not_an_error():
    call = {"role": "assistant", "content": "<tool_call>...</tool_call>"}
    episodes = [
        [call, {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}],
        [call, {"role": "tool", "content": "error: malformed tool call"}, {"role": "assistant", "content": "1"}],
        [{"role": "assistant", "content": "408"}],
        "a plain string completion",
    ]
    assert tool_success(["p"] * 4, episodes) == [1.0, 0.0, 0.0, 0.0]


def test_a_template_without_tool_support_gets_the_plain_text_convention():
    tok = build_tokenizer()  # its template ignores `tools`, as SmolLM2's does
    env = tools_environment(add)(ToolsOptions(tools=[]))
    assert not template_renders_tools(tok, env.tools)
    messages, extra = with_tools(tok, [{"role": "user", "content": "hi"}], env.tools)
    assert extra == {} and messages[0]["role"] == "system"
    assert messages[0]["content"].startswith(TOOL_PROMPT.split("{")[0]) and '"name": "add"' in messages[0]["content"]
    # an existing system message keeps its text, the convention is appended
    messages, _ = with_tools(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                             env.tools)
    assert len(messages) == 2 and messages[0]["content"].startswith("Be brief.\n\nYou can call these tools")


def test_a_template_with_tool_support_gets_the_tools():
    tok = build_tokenizer()
    tok.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    env = tools_environment(add)(ToolsOptions(tools=[]))
    messages, extra = with_tools(tok, [{"role": "user", "content": "hi"}], env.tools)
    assert extra == {"tools": env.tools} and messages == [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, **extra).startswith("TOOLS:add;")


def test_completion_text_of_an_episode_is_the_model_turns_only():
    episode = [{"role": "assistant", "content": "<tool_call>x</tool_call>"}, {"role": "tool", "content": "408"},
               {"role": "assistant", "content": "The answer is 408."}]
    assert completion_text(episode) == "<tool_call>x</tool_call>The answer is 408."
