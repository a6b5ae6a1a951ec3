"""The tool formats of the 2026 families (issue 59): Qwen3.5/3.6's XML calls and gpt-oss's harmony.

Each family is read off the chat template; Qwen3.5's calls parse as vLLM's ``qwen3_xml`` parser
reads them (its answers recorded in tests/core/data/qwen3_xml_vllm.json, checked against the live
parser in tests/vllm/test_qwen3_xml_reference.py) and harmony turns as ``openai-harmony`` reads
them. Then, per family, a tiny random model whose chat template renders as that family's does (the
templates below are written for these tests and render the same text as Qwen3.5's and gpt-oss's
for what the tests send) runs an ``openai``-client calculator agent through the endpoint, with a
scripted backend writing the family's calls, and takes two training steps on what was recorded.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import openai
import pytest
import torch
from grpo_plugins.environments.calculator import calculator

from grpo_core import Trainer, hookimpl
from grpo_core.contracts import RolloutBatch, left_pad
from grpo_core.endpoint.toolcalls import parse_qwen3_xml, tool_format

from .conftest import BASE_SPEC, merge
from .test_agents import TOOLS

pytestmark = pytest.mark.usefixtures("one_thread")

RECORD = json.loads((Path(__file__).parent / "data" / "qwen3_xml_vllm.json").read_text(encoding="utf-8"))

#: Renders as Qwen3.5's template does: tools in the system turn, XML calls, tool results in a user
#: turn, the thinking of turns before the last user query dropped, a generation prompt opening it.
QWEN35_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, reply with:\\n\\n<tool_call>\\n<function=example_function_name>\\n' }}
    {{- '<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}
    {%- if messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content | trim }}{%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content | trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user'
          and not ((message.content or '') | trim).startswith('<tool_response>') %}
        {%- set ns.found = true %}
        {%- set ns.last_query = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = (message.content or '') | trim %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning | trim + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {%- if not loop.first %}{{- '\\n' }}{%- elif content | trim %}{{- '\\n\\n' }}{%- endif %}
            {{- '<tool_call>\\n<function=' + call.name + '>\\n' }}
            {%- for key, value in (call.arguments or {}) | items %}
                {%- if value is mapping or (value is sequence and value is not string) %}
                    {%- set value = value | tojson %}
                {%- endif %}
                {{- '<parameter=' + key + '>\\n' + value | string + '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}
"""

#: Renders as gpt-oss's template does: harmony messages, a past call as ``to=functions.NAME<|channel|>
#: commentary json``, a tool result quoted as JSON, past analysis dropped once a final answer follows.
GPT_OSS_TEMPLATE = """
{{- '<|start|>system<|message|>You are a tiny model.\\nReasoning: medium\\n\\n# Valid channels: analysis, commentary, '
    'final. Channel must be included for every message.' }}
{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}{%- endif %}
{{- '<|end|>' }}
{%- set rest = messages[1:] if messages[0].role in ('system', 'developer') else messages %}
{%- if tools or rest is not sameas messages %}
    {{- '<|start|>developer<|message|>' }}
    {%- if rest is not sameas messages %}{{- '# Instructions\\n\\n' + messages[0].content + '\\n\\n' }}{%- endif %}
    {%- if tools %}
        {{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}
        {%- for tool in tools %}
            {{- '// ' + tool.function.description + '\\ntype ' + tool.function.name + ' = (_: ' }}
            {{- tool.function.parameters | tojson + ') => any;\\n\\n' }}
        {%- endfor %}
        {{- '} // namespace functions' }}
    {%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{%- set last = namespace(name=none) %}
{%- for message in rest %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {%- set later = namespace(final=false) %}
        {%- for future in rest[loop.index:] %}
            {%- if future.role == 'assistant' and not future.tool_calls %}{%- set later.final = true %}{%- endif %}
        {%- endfor %}
        {%- if message.thinking and not later.final %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' }}
        {{- call.arguments | tojson + '<|call|>' }}
        {%- set last.name = call.name %}
    {%- elif message.role == 'assistant' %}
        {%- if loop.last and not add_generation_prompt %}
            {%- if message.thinking %}
                {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
            {%- endif %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}
        {%- else %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
        {%- endif %}
    {%- elif message.role == 'tool' %}
        {%- if last.name is none %}{{- raise_exception('a tool message needs an assistant tool call before it') }}
        {%- endif %}
        {{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>' }}
        {{- message.content | tojson + '<|end|>' }}
    {%- else %}
        {{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""

QWEN_CALL = "I add 2 and 3.\n</think>\n\n<tool_call>\n<function=calculator>\n<parameter=expression>\n2+3\n" \
            "</parameter>\n</function>\n</tool_call>"
QWEN_ANSWER = "Done.\n</think>\n\nThe answer is 5.<|im_end|>"
HARMONY_CALL = "<|channel|>analysis<|message|>Add 2 and 3.<|end|><|start|>assistant<|channel|>commentary " \
               "to=functions.calculator <|constrain|>json<|message|>{\"expression\": \"2+3\"}<|call|>"
HARMONY_ANSWER = "<|channel|>analysis<|message|>It is 5.<|end|><|start|>assistant<|channel|>final<|message|>" \
                 "The answer is 5.<|return|>"
#: Per family: its template, the special tokens of its tiny tokenizer, the tokens that end a
#: turn, what marks a tool result in a prompt, and what the scripted policy writes before and after one.
FAMILIES = {
    "qwen3_xml": (QWEN35_TEMPLATE, ["<|pad|>", "<|im_start|>", "<|im_end|>"], ["<|im_end|>"], "<tool_response>",
                  QWEN_CALL, QWEN_ANSWER),
    "harmony": (GPT_OSS_TEMPLATE, ["<|pad|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                   "<|return|>", "<|call|>"], ["<|return|>", "<|call|>"], "to=assistant<|channel|>",
                HARMONY_CALL, HARMONY_ANSWER),
}


@pytest.fixture(scope="module", autouse=True)
def harmony_vocabulary():
    """openai-harmony's vocabulary file, offline: the copy the litellm package ships (a test
    dependency), found as openai-harmony's cache, unless the environment names one."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE") or os.environ.get("TIKTOKEN_RS_CACHE_DIR"):
        yield
        return
    (folder,) = importlib.util.find_spec("litellm").submodule_search_locations
    os.environ["TIKTOKEN_RS_CACHE_DIR"] = str(Path(folder) / "litellm_core_utils" / "tokenizers")
    yield
    del os.environ["TIKTOKEN_RS_CACHE_DIR"]


def tiny_family_model(path: Path, family: str) -> Path:
    """A tiny random Llama whose byte-level BPE tokenizer (built here) has the family's special
    tokens and chat template, its generation config ending turns at the family's stop tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from grpo_core.testing import _corpus, build_model

    template, specials, stops, _, call, answer = FAMILIES[family]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator([*_corpus(), template, call, answer, json.dumps(TOOLS)], trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", eos_token=stops[0],
                                        additional_special_tokens=specials[1:])
    tokenizer.chat_template, tokenizer.padding_side = template, "left"
    model = build_model(tokenizer)
    model.config.max_position_embeddings = 2048
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(stops)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class FamilyScripted:
    """A rollout backend that writes as the family's models do instead of sampling: a
    calculator call while the prompt holds no tool result, then the answer."""

    def __init__(self, family: str):
        *_, self.marker, self.call, self.answer = FAMILIES[family]
        self.written: list[list[int]] = []

    def setup(self, run):
        self.tokenizer = run.tokenizer

    def sync_weights(self, model):
        pass

    def generate(self, prompt_ids, group_size, sampling):
        ids = []
        for prompt in prompt_ids:
            text = self.answer if self.marker in self.tokenizer.decode(prompt) else self.call
            seq = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            assert len(seq) <= sampling.max_new_tokens
            ids += [seq] * group_size
        self.written += ids
        width = max(map(len, ids))
        completion = torch.zeros((len(ids), width), dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.bool)
        for row, seq in enumerate(ids):
            completion[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), True
        p_ids, p_mask = left_pad(prompt_ids, self.tokenizer.pad_token_id)
        texts = [self.tokenizer.decode(seq, skip_special_tokens=True) for seq in ids]
        return RolloutBatch(p_ids, p_mask, completion, mask, torch.zeros(len(ids), dtype=torch.bool), texts)


class FamilyPlugin:
    __name__ = "family"

    def __init__(self, family: str):
        self.backend = FamilyScripted(family)

    @hookimpl
    def register_rollout_backends(self, register):
        register.add("family", self.backend)


def calculator_loop(replies: list, follow_up: bool = True):
    """The calculator loop written with the openai client: tool calls answered until an answer;
    then (``follow_up``) a user turn and one more answer, which both families render otherwise
    than the policy wrote its first answer (past thinking dropped), so the episode splits."""

    def agent(episode):
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=60) as client:
            messages = list(episode.row["prompt"])
            for _ in range(3):
                reply = client.chat.completions.create(model=episode.model, messages=messages, tools=TOOLS)
                replies.append(reply.choices[0])
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": calculator(**json.loads(call.function.arguments))})
            if follow_up:
                messages.append({"role": "user", "content": "Thanks. Once more?"})
                replies.append(client.chat.completions.create(model=episode.model, messages=messages,
                                                              tools=TOOLS).choices[0])
        return float(episode.index)  # rewards that differ within a group: the steps train

    return agent


def family_spec(model: Path, out: Path, **agent) -> dict:
    return merge({"model": {"path": str(model)}, **BASE_SPEC}, {
        "rollout": {"name": "family", "group_size": 2, "max_new_tokens": 96,
                    "agent": {"max_total_tokens": 1024, **agent}},
        "train": {"output_dir": str(out), "prompts_per_step": 1}, "rewards": [{"name": "env_reward"}]})


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_run(request, tmp_path_factory):
    """One run per family, shared: the agent's replies, the first step's rollout, the model's
    parameter changes over two training steps, the scripted backend, and the endpoint's warnings."""
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    model = tiny_family_model(folder / "model", family)
    replies, plugin, warnings = [], FamilyPlugin(family), Warnings()
    logging.getLogger("grpo.templates").addHandler(warnings)
    try:
        run = Trainer(family_spec(model, folder / "out"), agent=calculator_loop(replies), plugins=[plugin])._build()
        changes, rollouts = [], []
        for step in range(2):
            experience = run.actor.collect(step)
            rollouts.append(experience.scored.rollout)
            before = [p.detach().clone() for p in run.model.parameters()]
            run.learner.learn(experience)
            changes.append(sum(float((p.detach() - q).abs().sum()) for p, q in zip(run.model.parameters(), before)))
    finally:
        logging.getLogger("grpo.templates").removeHandler(warnings)
    return family, model, replies, rollouts, changes, run.tokenizer, plugin.backend, warnings.messages


def test_the_families_are_read_off_their_chat_templates():
    qwen, oss = tool_format(QWEN35_TEMPLATE), tool_format(GPT_OSS_TEMPLATE)
    assert (qwen.name, qwen.reasoning, qwen.stop) == ("qwen3_xml", True, ("</tool_call>",))
    assert (oss.name, oss.reasoning, oss.special) == ("harmony", False, True)
    hermes = "{%- if tools %}...within <tool_call></tool_call> XML tags{% endif %}<think>"
    assert tool_format(hermes).name == "hermes"  # a <tool_call> alone is still Hermes's JSON


@pytest.mark.parametrize("case", RECORD["cases"], ids=lambda c: c["text"][:40])
def test_qwen3_xml_calls_parse_as_vllm_parses_them(case):
    content, calls = parse_qwen3_xml(case["text"], RECORD["tools"])
    assert (content or None, [[name, arguments] for name, arguments in calls]) == (case["content"], case["calls"])


def test_harmony_turns_parse_as_openai_harmony_reads_them():
    """The format's message of harmony's documented call and of a final answer: the calls,
    reasoning and content openai-harmony's own parser reads from the same tokens."""
    from grpo_core.endpoint.harmony import package

    h, encoding = package()  # the openai_harmony module and its gpt-oss encoding, loaded once
    documented = ('<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|><|start|>assistant'
                  '<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>'
                  '{"location":"San Francisco"}<|call|>')
    harmony = tool_format(GPT_OSS_TEMPLATE)
    for raw in (documented, HARMONY_CALL, HARMONY_ANSWER):
        reference = encoding.parse_messages_from_completion_tokens(encoding.encode(raw, allowed_special="all"),
                                                                   h.Role.ASSISTANT)
        message, called = harmony.message("ignored", True, raw=raw.removesuffix("<|call|>").removesuffix("<|return|>"))
        calls = [(m.recipient.removeprefix("functions."), json.loads(m.content[0].text)) for m in reference
                 if m.recipient]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
                message.get("tool_calls", [])] == calls and called == bool(calls)
        analysis = [m.content[0].text for m in reference if m.channel == "analysis"]
        assert message["reasoning_content"] == "\n".join(analysis)
        final = [m.content[0].text for m in reference if m.channel == "final"]
        assert message["content"] == (final[0] if final else None)
    assert harmony.message("not harmony at all", True, raw="not harmony at all") == (
        {"role": "assistant", "content": "not harmony at all"}, False)


def test_an_openai_agent_runs_the_calculator_loop_in_each_family(family_run):
    """The client receives the family's call as a tool call (the reference parser's reading of
    the turn) and its thinking as reasoning_content; the episode goes on to its answer; what is
    trained is exactly the tokens the policy wrote, the tool result between them as context
    rendered as the family renders it; the follow-up user turn starts a second training sample
    prompted as the chat template renders the conversation; two training steps change the weights."""
    family, model, replies, rollouts, changes, tokenizer, backend, _ = family_run
    calls = [r for r in replies if r.finish_reason == "tool_calls"]
    answers = [r for r in replies if r.finish_reason == "stop"]
    assert len(calls) == 4 and len(answers) == 8  # 2 episodes x 2 steps
    for reply in calls:
        (call,) = reply.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == tuple(RECORD["cases"][0]["calls"][0])
        assert reply.message.content is None
    assert {r.message.content for r in answers} == {"The answer is 5."}
    reasoning = {(r.message.model_extra or {}).get("reasoning_content") for r in replies}
    assert reasoning == ({"I add 2 and 3.", "Done."} if family == "qwen3_xml" else {"Add 2 and 3.", "It is 5."})
    rollout = rollouts[0]
    assert not rollout.episodes.failed.any() and rollout.episodes.turns.tolist() == [3, 3]
    assert rollout.episodes.tool_calls.tolist() == [1, 1] and rollout.episodes.samples.tolist() == [2, 2]
    _, _, _, _, call_text, answer_text = FAMILIES[family]
    call, answer = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (call_text, answer_text))
    for row in range(2):
        (split,) = rollout.episodes.splits[row]
        ids, mask = rollout.completion_ids[row], rollout.completion_mask[row]
        assert ids[mask].tolist() == call + answer + answer  # the sampled tokens, nothing re-tokenized
        assert ids[split - len(answer): split].tolist() == answer and mask[split - len(answer): split].all()
        start = int(mask.nonzero()[0])  # the first sampled token: what leads it is the first prompt's rest
        assert ids[start: start + len(call)].tolist() == call
        context = tokenizer.decode(ids[start + len(call): split - len(answer)])
        if family == "harmony":  # openai-harmony's rendering of the result, then the next turn's header
            assert context == "<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>5<|end|>" \
                              "<|start|>assistant"
        else:  # the chat template's: the call's turn closed, the result in a user turn, thinking opened
            assert context == "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
                              "<|im_start|>assistant\n<think>\n"
        second = tokenizer.decode(ids[split: int(rollout.episodes.lengths[row])][~mask[split:
                                                                                      int(rollout.episodes.lengths[row])]])
        assert "Thanks. Once more?" in second and "I add 2 and 3." not in second and "Add 2 and 3." not in second
    assert all(change > 0 for change in changes)


def test_a_template_that_renders_the_episode_otherwise_is_named(family_run, tmp_path):
    """The Qwen3.5-style template renders the conversation as the policy wrote it: no warning.
    gpt-oss's template writes a past call's header in another order than the model does
    (``to=functions.calculator<|channel|>commentary json``): named once in a warning, and under
    ``template_check: refuse`` the episode fails with that name."""
    family, model, *_, warnings = family_run
    named = [w for w in warnings if "renders this episode's conversation otherwise" in w]
    if family == "qwen3_xml":
        assert named == []
        return
    assert len(named) == 1 and "tool-call format harmony" in named[0], warnings
    assert "to=functions.calculator<|channel|>commentary json" in named[0]
    spec = family_spec(model, tmp_path / "o", template_check="refuse")
    rollout = Trainer(spec, agent=calculator_loop([]), plugins=[FamilyPlugin(family)])._build().actor.collect(0) \
        .scored.rollout
    assert rollout.episodes.failed.all()
    assert "template_check: refuse" in rollout.episodes.messages[0][-1]["content"]
