"""gpt-oss's harmony format, parsed and rendered by OpenAI's ``openai-harmony`` package.

A gpt-oss turn is a run of messages, each on a channel: ``analysis`` (the reasoning),
``commentary`` (a call when addressed ``to=functions.NAME``, a preamble otherwise) and
``final`` (the answer), ending at ``<|call|>`` or ``<|return|>``::

    <|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>commentary
    to=functions.calculator <|constrain|>json<|message|>{"expression": "2+3"}<|call|>

:func:`parse` reads such a turn (the text as the policy wrote it, special tokens kept) with the
package's parser; :func:`observation_text` renders the tool results and user turns that follow
a turn, and the header of the next assistant turn, with the package's renderer, as vLLM renders
gpt-oss conversations. The package works on its own tokens (``o200k_harmony``): the text goes
through them, so any tokenizer that spells the harmony markers as special tokens is served.

The package loads its vocabulary file (``o200k_base.tiktoken``) on first use: from the folder
named by ``TIKTOKEN_ENCODINGS_BASE``, else from its cache (``TIKTOKEN_RS_CACHE_DIR``, a file
named by the SHA-1 of the file's URL), else downloading it. Offline, point either variable at a
copy (the ``litellm`` package ships one in ``litellm/litellm_core_utils/tokenizers``).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from grpo_core.errors import RunError

#: What the vocabulary's absence says, and how to supply it offline.
_OFFLINE = ("openai-harmony could not load its vocabulary file o200k_base.tiktoken ({error}): set "
            "TIKTOKEN_ENCODINGS_BASE to a folder holding it, or TIKTOKEN_RS_CACHE_DIR to a folder holding it under "
            "the name fb374d419588a4632f3f557e76b4b70aebbca790 (the litellm package ships one in "
            "litellm/litellm_core_utils/tokenizers), or allow the download once")


@functools.cache
def package() -> tuple[Any, Any]:
    """``(openai_harmony module, its gpt-oss encoding)``, loaded once."""
    try:
        import openai_harmony
    except ImportError:
        raise RunError("the model's chat template speaks gpt-oss's harmony format, which is parsed with the "
                       "openai-harmony package: pip install 'grpo-core[harmony]'") from None
    try:
        encoding = openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except openai_harmony.HarmonyError as exc:
        raise RunError(_OFFLINE.format(error=exc)) from None
    return openai_harmony, encoding


def _text(message: Any) -> str:
    return "".join(getattr(part, "text", "") for part in message.content)


def parse(raw: str) -> tuple[str | None, str, list[tuple[str, Any]]] | None:
    """``(reasoning, content, calls)`` of one assistant turn as the policy wrote it (special
    tokens kept, after the ``<|start|>assistant`` header); None when it is not harmony. Calls
    are ``(name, arguments)``, arguments parsed from JSON (the text as written otherwise)."""
    harmony, encoding = package()
    tokens = encoding.encode(raw, allowed_special="all")
    try:
        messages = encoding.parse_messages_from_completion_tokens(tokens, harmony.Role.ASSISTANT, strict=False)
    except harmony.HarmonyError:
        return None
    reasoning, content, calls = [], [], []
    for message in messages:
        recipient = message.recipient or ""
        if recipient.startswith("functions."):
            text = _text(message)
            try:
                arguments = json.loads(text)
            except ValueError:
                arguments = text
            calls.append((recipient.removeprefix("functions."), arguments))
        elif message.channel == "analysis":
            reasoning.append(_text(message))
        elif not recipient:  # the final answer, and preambles on the commentary channel
            content.append(_text(message))
    return ("\n".join(reasoning) if reasoning else None), "\n".join(content), calls


def observation_text(messages: list[dict[str, Any]], tool_names: list[str]) -> str:
    """The harmony text of ``messages`` (tool results, each from ``functions.NAME`` with the
    name of the call it answers, in ``tool_names``' order; user turns) followed by the header
    of the next assistant turn, as openai-harmony renders a conversation for completion."""
    harmony, encoding = package()
    rendered, names = [], iter(tool_names)
    for message in messages:
        content = str(message.get("content") or "")
        if message.get("role") == "tool":
            author = harmony.Author.new(harmony.Role.TOOL, f"functions.{next(names, 'tool')}")
            rendered.append(harmony.Message.from_author_and_content(author, content)
                            .with_recipient("assistant").with_channel("commentary"))
        else:
            role = harmony.Role.DEVELOPER if message.get("role") == "system" else harmony.Role(message["role"])
            rendered.append(harmony.Message.from_role_and_content(role, content))
    conversation = harmony.Conversation.from_messages(rendered)
    return encoding.decode(encoding.render_conversation_for_completion(conversation, harmony.Role.ASSISTANT))
