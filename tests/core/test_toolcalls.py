"""Tool calls and reasoning per model family (issue 48, item 4): the family read off the chat
template, each family's parser on the text its models write, reasoning split out; and one
agent episode through the endpoint with a Llama-3-style template."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from grpo_plugins.environments.calculator import calculator

from grpo_core import Trainer
from grpo_core.endpoint.toolcalls import (
    parse_hermes,
    parse_llama3,
    parse_mistral,
    split_reasoning,
    tool_format,
)

from .test_agents import TOOLS, Scripted, ScriptedPlugin, _spec, long_model  # noqa: F401 - a fixture

ARGS = {"expression": "2+3"}

# The parts of real templates that name the family (Qwen2.5's, Llama 3.1's, Mistral's, Qwen3's).
QWEN = '{%- if tools %}...For each function call, return a json object ... within <tool_call></tool_call> XML tags'
LLAMA = ('{{- "Given the following functions, please respond with a JSON for a function call with its proper '
         'arguments that best answers the given prompt.\\n\\n" }}{{- \'Respond in the format {"name": function name, '
         '"parameters": dictionary of argument name and its value}.\' }}{{- "<|python_tag|>" }}')
MISTRAL = "{%- if message.tool_calls %}{{- \"[TOOL_CALLS] [\" }}{%- for tool_call in message.tool_calls %}"
QWEN3 = QWEN + "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"


@pytest.mark.parametrize(("template", "family", "reasoning"), [
    (QWEN, "hermes", False), (LLAMA, "llama3", False), (MISTRAL, "mistral", False), (QWEN3, "hermes", True),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes", False), (None, "hermes", False),
    ({"default": MISTRAL, "tool_use": MISTRAL}, "mistral", False),
])
def test_the_family_is_read_off_the_chat_template(template, family, reasoning):
    chosen = tool_format(template)
    assert (chosen.name, chosen.reasoning) == (family, reasoning)


def test_hermes_calls_in_their_tags():
    text = f'Let me compute. <tool_call>{{"name": "calculator", "arguments": {json.dumps(ARGS)}}}</tool_call>\n' \
           '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    assert parse_hermes(text) == ("Let me compute.", [("calculator", ARGS), ("calculator", {"expression": "1"})])
    cut = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'  # stopped at </tool_call>
    assert parse_hermes(cut) == ("", [("calculator", ARGS)])
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_llama3_json_calls():
    assert parse_llama3('{"name": "calculator", "parameters": {"expression": "2+3"}}') == ("", [("calculator", ARGS)])
    assert parse_llama3('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}') == \
        ("", [("a", {}), ("b", {"x": 1})])
    for text in ("The answer is 5.", '{"answer": 5}', '{"name": "a", "parameters": {}} and then text'):
        assert parse_llama3(text) == (text, [])


def test_mistral_calls_both_generations():
    v3 = 'Sure.[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "2+3"}}]'
    assert parse_mistral(v3) == ("Sure.", [("calculator", ARGS)])
    v11 = '[TOOL_CALLS]calculator[ARGS]{"expression": "2+3"}[TOOL_CALLS]other[ARGS]{}'
    assert parse_mistral(v11) == ("", [("calculator", ARGS), ("other", {})])
    assert parse_mistral("No call here.") == ("No call here.", [])
    assert parse_mistral("[TOOL_CALLS] garbage") == ("[TOOL_CALLS] garbage", [])


def test_reasoning_is_split_off():
    assert split_reasoning("<think>\nadd them\n</think>\n\nThe answer is 5.") == ("add them", "The answer is 5.")
    assert split_reasoning("add them</think>5") == ("add them", "5")  # the template opened <think>
    assert split_reasoning("The answer is 5.") == (None, "The answer is 5.")
    qwen3 = tool_format(QWEN3)
    message, calls = qwen3.message(
        '<think>use the tool</think>\n<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
        '</tool_call>', with_tools=True)
    assert calls and message["reasoning_content"] == "use the tool" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == ARGS
    message, calls = qwen3.message("<think>easy</think>5", with_tools=False)
    assert message == {"role": "assistant", "content": "5", "reasoning_content": "easy"} and not calls
    plain = tool_format(QWEN).message("<think>x</think>5", False)[0]  # no <think> in the template: text as is
    assert plain == {"role": "assistant", "content": "<think>x</think>5"}


def test_mistral_call_ids_are_nine_letters_and_digits():
    message, _ = tool_format(MISTRAL).message("", True, raw='[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    call_id = message["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum()


LLAMA_CALL = '{"name": "calculator", "parameters": {"expression": "2+3"}}'


class LlamaScripted(Scripted):
    """The scripted backend writing calls as Llama 3.x does: a bare JSON object."""

    def generate(self, prompt_ids, group_size, sampling):
        batch = super().generate(prompt_ids, group_size, sampling)
        for row, text in enumerate(batch.completions):
            if text.startswith("<tool_call>"):
                ids = self.tokenizer(LLAMA_CALL, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                batch.completion_ids[row] = 0
                batch.completion_mask[row] = False
                width = min(len(ids), batch.completion_ids.shape[1])
                assert width == len(ids), "the Llama call is longer than the Hermes one"
                batch.completion_ids[row, :width] = torch_tensor(ids)
                batch.completion_mask[row, :width] = True
                batch.completions[row] = LLAMA_CALL
                batch.truncated[row] = False
        return batch


def torch_tensor(ids):
    import torch

    return torch.tensor(ids)


def test_a_llama_template_agent_gets_its_json_call_as_a_tool_call(long_model, tmp_path):  # noqa: F811
    """A model whose template shows tools as Llama 3.1's does and writes a bare JSON call: the
    openai client receives it as a tool call (finish_reason tool_calls), and the episode goes
    on to its answer."""
    model = tmp_path / "llama"
    shutil.copytree(long_model, model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(
        "{% if tools %}<|system|>Respond in the format {\"name\": function name, \"parameters\": dictionary of "
        "argument name and its value}. {{ tools | tojson }}<|end|>\n{% endif %}" + template)
    replies = []

    def agent(episode):
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=60) as client:
            messages = list(episode.row["prompt"])
            for _ in range(3):
                reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
                replies.append(reply.choices[0])
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    return None
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": calculator(**json.loads(call.function.arguments))})

    plugin = ScriptedPlugin()
    plugin.backend = LlamaScripted()
    spec = _spec(model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 240})
    spec["train"]["prompts_per_step"] = 1
    rollout = Trainer(spec, agent=agent, plugins=[plugin])._build().actor.collect(0).scored.rollout
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    first = [r for r in replies if r.finish_reason == "tool_calls"]
    assert len(first) == 2 and all(r.message.content is None for r in first)
    assert all(json.loads(r.message.tool_calls[0].function.arguments) == ARGS for r in first)
    assert rollout.episodes.tool_calls.tolist() == [1, 1] and rollout.episodes.turns.tolist() == [2, 2]


class ThinkingScripted(Scripted):
    """The scripted backend thinking first, as Qwen3 does: ``<think>...</think>`` before each turn."""

    def generate(self, prompt_ids, group_size, sampling):
        batch = super().generate(prompt_ids, group_size, sampling)
        out = []
        for row, text in enumerate(batch.completions):
            ids = batch.completion_ids[row][batch.completion_mask[row]].tolist()
            out.append(self.tokenizer("<think>add 2 and 3</think>", add_special_tokens=False)["input_ids"] + ids)
            batch.completions[row] = "<think>add 2 and 3</think>" + text
        width = max(map(len, out))
        import torch

        batch.completion_ids = torch.zeros((len(out), width), dtype=torch.long)
        batch.completion_mask = torch.zeros((len(out), width), dtype=torch.bool)
        for row, ids in enumerate(out):
            batch.completion_ids[row, : len(ids)] = torch.tensor(ids)
            batch.completion_mask[row, : len(ids)] = True
        return batch


def test_a_thinking_template_agent_gets_reasoning_content_apart(long_model, tmp_path):  # noqa: F811
    """A template that mentions <think>: the openai client receives the thinking as the
    message's reasoning_content (unstreamed and streamed), the content and tool call without
    it, and the episode, its messages echoed back with the reasoning, goes on to its answer."""
    model = tmp_path / "thinking"
    shutil.copytree(long_model, model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text("{#- past <think> blocks are dropped -#}" + template)
    seen = []

    def agent(episode):
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=60) as client:
            messages = list(episode.row["prompt"])
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            seen.append((message.model_extra.get("reasoning_content"), message.content, len(message.tool_calls)))
            messages.append(message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"})
            stream = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True)
            thought = content = ""
            for chunk in stream:
                for choice in chunk.choices:
                    thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                    content += choice.delta.content or ""
            seen.append((thought, content, 0))

    spec = _spec(model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 240})
    spec["train"]["prompts_per_step"] = 1
    plugin = ScriptedPlugin()
    plugin.backend = ThinkingScripted()
    rollout = Trainer(spec, agent=agent, plugins=[plugin])._build().actor.collect(0).scored.rollout
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert sorted(seen, key=str) == [("add 2 and 3", "The answer is 5.", 0)] * 2 + [("add 2 and 3", None, 1)] * 2
    assert rollout.episodes.turns.tolist() == [2, 2]
