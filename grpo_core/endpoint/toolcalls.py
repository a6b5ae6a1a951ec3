"""Tool calls and reasoning in the policy's text, per model family: what the agent endpoint
answers as an OpenAI ``tool_calls`` list and ``reasoning_content``.

Each family writes its calls its own way; the family is read off the tokenizer's chat template
(:func:`tool_format`), as vLLM and SGLang pick a tool parser per model:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, and grpo-core's plain-text convention for templates that
  show no tools): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, each call in
  its tags; a turn ends at ``</tool_call>``.
- ``llama3`` (Llama 3.1-3.3, whose templates ask for ``{"name": function name, "parameters":
  dictionary of argument name and its value}``): the turn is one JSON object (or several,
  separated by ``;``), optionally after ``<|python_tag|>``.
- ``mistral`` (templates with ``[TOOL_CALLS]``): ``[TOOL_CALLS]`` then a JSON list of
  ``{"name", "arguments"}`` (v3 tokenizers) or ``name[ARGS]{...}`` per call (v11 and later);
  call ids are 9 letters and digits, as Mistral's templates require.
- ``qwen3_xml`` (Qwen3.5, Qwen3.6, Qwen3-Coder: templates with ``<function=`` and
  ``<parameter=``): ``<tool_call><function=NAME><parameter=ARG>value</parameter>...
  </function></tool_call>``, read as vLLM's ``qwen3_xml`` parser reads it: one newline around
  each value trimmed, values converted by the type the request's tool schema gives the argument
  (integer, number, boolean, null, object, array), strings otherwise.
- ``harmony`` (gpt-oss: templates with ``<|channel|>`` and ``to=functions.``): parsed by the
  ``openai-harmony`` package (:mod:`grpo_core.endpoint.harmony`): the ``analysis`` channel is
  the reasoning, a ``commentary`` message to ``functions.NAME`` a call, the rest the content.

Reasoning (templates that mention ``<think>``, as Qwen3's and DeepSeek-R1's do): the text up to
``</think>`` (a leading ``<think>`` dropped: a template may open it in the generation prompt)
is the message's ``reasoning_content``, the rest its content and calls.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_core.endpoint import harmony

_DECODER = json.JSONDecoder()
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_MISTRAL_ARGS = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")
_XML_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|$)|(<function=.*?(?:</function>|$))",
                       re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=)|$)",
                            re.DOTALL)
_ALNUM = string.ascii_letters + string.digits

Calls = list[tuple[str, Any]]  # (name, arguments) per call


def _json_at(text: str, start: int = 0) -> tuple[Any, int] | None:
    """The JSON value at ``text[start:]`` (after blanks) and where it ends, or None."""
    while start < len(text) and text[start].isspace():
        start += 1
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None


def _call(value: Any) -> tuple[str, Any] | None:
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        arguments = value.get("arguments", value.get("parameters", {}))
        return value["name"], arguments
    return None


def parse_hermes(text: str, tools: Sequence[dict] = ()) -> tuple[str, Calls]:
    """``<tool_call>{json}</tool_call>`` calls; the text around them is the content."""
    calls = []
    for match in _HERMES.finditer(text):
        found = _json_at(match.group(1).strip())
        call = _call(found[0]) if found else None
        if call:
            calls.append(call)
    return (_HERMES.sub("", text).strip() if calls else text), calls


def parse_llama3(text: str, tools: Sequence[dict] = ()) -> tuple[str, Calls]:
    """A turn that is JSON calls (``{"name", "parameters"}``, ``;``-separated), optionally
    after ``<|python_tag|>``; any other text is content, with no call."""
    body = text.strip().removeprefix("<|python_tag|>").lstrip()
    calls, at = [], 0
    while at < len(body):
        found = _json_at(body, at)
        call = _call(found[0]) if found else None
        if call is None:
            return text, []
        calls.append(call)
        at = found[1]
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
    return ("", calls) if calls else (text, [])


def parse_mistral(text: str, tools: Sequence[dict] = ()) -> tuple[str, Calls]:
    """``[TOOL_CALLS]`` then a JSON list of calls, or ``name[ARGS]{json}`` per call; the text
    before the first ``[TOOL_CALLS]`` is the content."""
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return text, []
    content, calls = text[:at].strip(), []
    for part in text[at:].split("[TOOL_CALLS]")[1:]:
        found = _json_at(part)
        if found and isinstance(found[0], list):
            calls.extend(c for c in map(_call, found[0]) if c)
            continue
        position = 0
        while (match := _MISTRAL_ARGS.match(part, position)) is not None:
            arguments = _json_at(part, match.end())
            if arguments is None:
                break
            calls.append((match.group(1), arguments[0]))
            position = arguments[1]
    return (content, calls) if calls else (text, [])


#: JSON Schema types in the order a value is tried against them (vLLM's), and spellings of them.
_TYPE_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_TYPE_ALIASES = {"int": "integer", "float": "number", "bool": "boolean", "str": "string", "dict": "object",
                 "list": "array"}


def _schema_types(schema: Any) -> set[str]:
    """The types a JSON schema allows: ``type`` (one or a list), those of its ``enum`` values
    and of its ``anyOf``/``oneOf``/``allOf`` branches; ``{"string"}`` when it says none."""
    if not isinstance(schema, dict):
        return {"string"}
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else {t for t in declared or () if isinstance(t, str)}
    for value in schema.get("enum") or () if isinstance(schema.get("enum"), list) else ():
        types.add({type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
                   list: "array", dict: "object"}.get(type(value), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) or () if isinstance(schema.get(key), list) else ():
            types |= _schema_types(branch)
    return {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types} or {"string"}


def _finite_json(text: str) -> tuple[bool, Any]:
    try:
        value = json.loads(text, parse_constant=lambda name: float(name))
        json.dumps(value, allow_nan=False)
    except (ValueError, RecursionError):
        return False, None
    return True, value


def typed_value(text: str, schema: Any) -> Any:
    """An XML argument's text as the type its schema gives (the first of null, integer, number,
    boolean, object, array that the text reads as), as vLLM's ``qwen3_xml`` parser converts it;
    without a matching type, the text as JSON if it is, else the text."""
    types = _schema_types(schema)
    for kind in (t for t in _TYPE_ORDER if t in types):
        if kind == "string":
            return text
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if number == number and abs(number) != float("inf"):
                return int(number) if number == int(number) else number
        if kind == "boolean" and text.lower().strip() in ("true", "1", "false", "0"):
            return text.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            ok, value = _finite_json(text)
            if ok:
                return value
    ok, value = _finite_json(text)
    return value if ok else text


def _properties(tools: Sequence[dict], name: str) -> dict[str, Any]:
    """The argument schemas of the request's tool called ``name`` (none when it sent none)."""
    for tool in tools:
        function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def _one_newline_off(value: str) -> str:
    return value.removeprefix("\n").removesuffix("\n")


def parse_qwen3_xml(text: str, tools: Sequence[dict] = ()) -> tuple[str, Calls]:
    """``<tool_call><function=NAME><parameter=ARG>value</parameter></function></tool_call>``
    calls (a ``<function=`` block without its ``<tool_call>`` too, and a call cut before its
    closing tags); values converted by the request's ``tools`` schemas (:func:`typed_value`).
    The text outside the calls is the content."""
    calls, kept, at = [], [], 0
    for match in _XML_CALL.finditer(text):
        function = _XML_FUNCTION.search(match.group(1) if match.group(1) is not None else match.group(2))
        if function is None:
            continue
        name = function.group(1).strip()
        properties = _properties(tools, name)
        arguments = {}
        for parameter in _XML_PARAMETER.finditer(function.group(2)):
            key, value = parameter.group(1), _one_newline_off(parameter.group(2))
            arguments[key] = typed_value(value, properties[key]) if key in properties else value
        calls.append((name, arguments))
        kept.append(text[at:match.start()])
        at = match.end()
    return ("".join(kept + [text[at:]]).strip(), calls) if calls else (text, [])


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, rest)``: the text before ``</think>`` and after it; ``(None, text)`` when
    the text closes no thinking."""
    end = text.find("</think>")
    if end < 0:
        return None, text
    reasoning = text[:end].lstrip().removeprefix("<think>")
    return reasoning.strip(), text[end + len("</think>"):].lstrip()


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls: its name, its parser (the text and the
    request's tools), the stop strings that end a calling turn, whether the parser needs the
    special tokens kept in the text, whether reasoning is split off, and the ids of the calls."""

    name: str
    parse: Callable[[str, Sequence[dict]], tuple[str, Calls]]
    stop: tuple[str, ...] = ()
    special: bool = False
    reasoning: bool = False

    def call_id(self) -> str:
        if self.name == "mistral":
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:12]}"

    def message(self, text: str, with_tools: bool, raw: str | None = None,
                tools: Sequence[dict] = ()) -> tuple[dict[str, Any], bool]:
        """The assistant message of the policy's ``text`` (``raw``: the same tokens decoded
        with their special tokens, for a family whose markers are special tokens), and
        whether it calls tools; ``tools``: the request's, whose schemas type the arguments."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning:
            reasoning, rest = split_reasoning(text)
            if reasoning is not None:
                message = {"role": "assistant", "content": rest, "reasoning_content": reasoning}
                if raw is not None:
                    raw = split_reasoning(raw)[1]
        if not with_tools:
            return message, False
        content, calls = self.parse(raw if self.special and raw is not None else message["content"], tools)
        return self._with_calls(message, content, calls)

    def observation(self, messages: list[dict[str, Any]], tool_names: list[str], ended: bool) -> str | None:
        """The text of ``messages`` (tool results, user turns, each answering the call named in
        ``tool_names``) after a turn and of the next turn's header, where the family renders it
        itself; None: the chat template renders it. ``ended``: the turn ended with its stop token."""
        return None

    def keeps(self, answer: dict[str, Any]) -> bool | None:
        """Whether a conversation rendered again shows the answered turn ``answer`` as the
        policy wrote it once messages follow, where the family says (None: ask the chat template)."""
        return None

    def _with_calls(self, message: dict[str, Any], content: str, calls: Calls) -> tuple[dict[str, Any], bool]:
        if not calls:
            return message, False
        message["content"] = content or None
        message["tool_calls"] = [{"id": self.call_id(), "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(arguments)}}
                                 for name, arguments in calls]
        return message, True


class HarmonyFormat(ToolFormat):
    """gpt-oss's harmony turns (:mod:`grpo_core.endpoint.harmony`): the ``analysis`` channel
    is the message's ``reasoning_content``, calls to ``functions.NAME`` its tool calls, the
    final channel (and commentary preambles) its content. A turn that is not harmony is
    content as it reads."""

    def message(self, text: str, with_tools: bool, raw: str | None = None,
                tools: Sequence[dict] = ()) -> tuple[dict[str, Any], bool]:
        parsed = harmony.parse(raw if raw is not None else text)
        if parsed is None:
            return {"role": "assistant", "content": text}, False
        reasoning, content, calls = parsed
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return self._with_calls(message, content, calls if with_tools else [])


    def observation(self, messages: list[dict[str, Any]], tool_names: list[str], ended: bool) -> str | None:
        """Rendered by openai-harmony (a turn cut before its ``<|call|>``/``<|return|>`` closed
        with ``<|end|>``)."""
        return ("" if ended else "<|end|>") + harmony.observation_text(messages, tool_names)

    def keeps(self, answer: dict[str, Any]) -> bool | None:
        """A call's turn is kept; a final answer is not: harmony renders it again closed by
        ``<|end|>`` where the policy wrote ``<|return|>``, and drops its analysis."""
        return bool(answer.get("tool_calls"))


def _harmony_parse(text: str, tools: Sequence[dict] = ()) -> tuple[str, Calls]:
    parsed = harmony.parse(text)
    return (text, []) if parsed is None else (parsed[1], parsed[2])


FORMATS = {
    "hermes": ToolFormat("hermes", parse_hermes, stop=("</tool_call>",)),
    "llama3": ToolFormat("llama3", parse_llama3, special=True),
    "mistral": ToolFormat("mistral", parse_mistral, special=True),
    "qwen3_xml": ToolFormat("qwen3_xml", parse_qwen3_xml, stop=("</tool_call>",)),
    "harmony": HarmonyFormat("harmony", _harmony_parse, special=True),
}
#: What in a chat template says which family wrote it, checked in this order (every mark of
#: a family must be there).
MARKERS = (
    ("harmony", ("<|channel|>", "to=functions.")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3", ("<|python_tag|>",)),
    ("llama3", ('"parameters": dictionary of argument name and its value',)),
    ("qwen3_xml", ("<function=", "<parameter=")),
    ("hermes", ("<tool_call>",)),
)


def tool_format(template: str | dict | None) -> ToolFormat:
    """The tool-call family of a chat template (module doc); ``hermes`` when none is named,
    as grpo-core's plain-text tool convention is Hermes's. Reasoning is split where the
    template mentions ``<think>`` (harmony's reasoning is its analysis channel)."""
    text = "\n".join(template.values()) if isinstance(template, dict) else template or ""
    name = next((family for family, marks in MARKERS if all(m in text for m in marks)), "hermes")
    base = FORMATS[name]
    return type(base)(base.name, base.parse, base.stop, base.special,
                      reasoning="<think>" in text and name != "harmony")
