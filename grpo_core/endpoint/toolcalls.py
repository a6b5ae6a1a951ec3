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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_MISTRAL_ARGS = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")
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


def parse_hermes(text: str) -> tuple[str, Calls]:
    """``<tool_call>{json}</tool_call>`` calls; the text around them is the content."""
    calls = []
    for match in _HERMES.finditer(text):
        found = _json_at(match.group(1).strip())
        call = _call(found[0]) if found else None
        if call:
            calls.append(call)
    return (_HERMES.sub("", text).strip() if calls else text), calls


def parse_llama3(text: str) -> tuple[str, Calls]:
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


def parse_mistral(text: str) -> tuple[str, Calls]:
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
    """How one model family writes tool calls: its name, its parser, the stop strings that end
    a calling turn, whether the parser needs the special tokens kept in the text, and the ids
    of the calls."""

    name: str
    parse: Callable[[str], tuple[str, Calls]]
    stop: tuple[str, ...] = ()
    special: bool = False
    reasoning: bool = False

    def call_id(self) -> str:
        if self.name == "mistral":
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:12]}"

    def message(self, text: str, with_tools: bool, raw: str | None = None) -> tuple[dict[str, Any], bool]:
        """The assistant message of the policy's ``text`` (``raw``: the same tokens decoded
        with their special tokens, for a family whose markers are special tokens), and
        whether it calls tools."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning:
            reasoning, rest = split_reasoning(text)
            if reasoning is not None:
                message = {"role": "assistant", "content": rest, "reasoning_content": reasoning}
                if raw is not None:
                    raw = split_reasoning(raw)[1]
        if not with_tools:
            return message, False
        content, calls = self.parse(raw if self.special and raw is not None else message["content"])
        if not calls:
            return message, False
        message["content"] = content or None
        message["tool_calls"] = [{"id": self.call_id(), "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(arguments)}}
                                 for name, arguments in calls]
        return message, True


FORMATS = {
    "hermes": ToolFormat("hermes", parse_hermes, stop=("</tool_call>",)),
    "llama3": ToolFormat("llama3", parse_llama3, special=True),
    "mistral": ToolFormat("mistral", parse_mistral, special=True),
}
#: What in a chat template says which family wrote it, checked in this order.
MARKERS = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3", ("<|python_tag|>", '"parameters": dictionary of argument name and its value')),
    ("hermes", ("<tool_call>",)),
)


def tool_format(template: str | None) -> ToolFormat:
    """The tool-call family of a chat template (module doc); ``hermes`` when none is named,
    as grpo-core's plain-text tool convention is Hermes's. Reasoning is split where the
    template mentions ``<think>``."""
    text = "\n".join(template.values()) if isinstance(template, dict) else template or ""
    name = next((family for family, marks in MARKERS if any(m in text for m in marks)), "hermes")
    base = FORMATS[name]
    return ToolFormat(base.name, base.parse, base.stop, base.special, reasoning="<think>" in text)
