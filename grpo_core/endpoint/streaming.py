"""Answers of the agent endpoint as server-sent events (``stream: true``), in the chunk shapes
of the OpenAI API: ``chat.completion.chunk`` and ``text_completion`` chunks, then a ``usage``
chunk when ``stream_options.include_usage`` asks for it, then ``data: [DONE]``.

Generation is batched across the agents of a rollout (:mod:`grpo_core.train.actor.drivers.agents`):
a request's tokens exist once its batch's ``generate`` returned, so the chunks of an answer
are written together after it, one per token (or per few tokens, where one token alone is
not whole UTF-8 text), never before. What a client assembles from them is, character for
character, the unstreamed answer, so its next request extends the episode's history as an
unstreamed agent's does.

Each choice dict holds ``text``, ``ids``, ``logp`` (or None), ``finish``, ``message`` and
``pieces``: ``(text, start, end)`` spans of ``ids`` whose texts join to ``text``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any


def event(data: dict[str, Any], name: str | None = None) -> bytes:
    """One server-sent event: ``event: name`` (when named) and its JSON ``data``."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def usage(choices: list[dict[str, Any]], prompt_tokens: int) -> dict[str, int]:
    completion = sum(len(c["ids"]) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _logprobs(choice: dict[str, Any], start: int, end: int, wanted: bool) -> dict[str, Any] | None:
    if not wanted or choice["logp"] is None:
        return None
    return {"content": [{"token": str(t), "logprob": float(lp), "bytes": None, "top_logprobs": []}
                        for t, lp in zip(choice["ids"][start:end], choice["logp"][start:end])]}


def chat_events(request: Any, choices: list[dict[str, Any]], prompt_tokens: int,
                include_usage: bool) -> Iterator[bytes]:
    """The ``chat.completion.chunk`` events of an answer: per choice, its role, its content
    token by token (in one piece when tool calls or reasoning were taken out of the text), its
    reasoning, its tool calls (each a header delta with id and name, then its arguments), and
    a last chunk with the finish reason."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": "policy"}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
              ids: list[int] | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if ids is not None:
            choice["token_ids"] = ids
        return event({**head, "choices": [choice]})

    for index, choice in enumerate(choices):
        message = choice["message"]
        yield chunk(index, {"role": "assistant", "content": ""})
        if message.get("reasoning_content"):
            yield chunk(index, {"reasoning_content": message["reasoning_content"]})
        content = message.get("content") or ""
        if content == choice["text"]:  # the policy's text as it came: token by token
            for text, start, end in choice["pieces"]:
                yield chunk(index, {"content": text}, logprobs=_logprobs(choice, start, end, request.logprobs),
                            ids=choice["ids"][start:end])
            last = None
        else:
            if content:
                yield chunk(index, {"content": content})
            last = (_logprobs(choice, 0, len(choice["ids"]), request.logprobs), list(choice["ids"]))
        for number, call in enumerate(message.get("tool_calls") or []):
            function = call["function"]
            yield chunk(index, {"tool_calls": [{"index": number, "id": call["id"], "type": "function",
                                                "function": {"name": function["name"], "arguments": ""}}]})
            yield chunk(index, {"tool_calls": [{"index": number, "function": {"arguments": function["arguments"]}}]})
        logprobs, ids = last or (None, None)
        yield chunk(index, {}, choice["finish"], logprobs, ids)
    if include_usage:
        yield event({**head, "choices": [], "usage": usage(choices, prompt_tokens)})
    yield DONE


def completion_events(request: Any, choices: list[dict[str, Any]], prompt_tokens: int,
                      include_usage: bool) -> Iterator[bytes]:
    """The ``text_completion`` chunks of an answer: per choice its text token by token, then
    the finish reason."""
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": "policy"}

    def chunk(index: int, text: str, finish: str | None = None, ids: list[int] | None = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if ids is not None:
            choice["token_ids"] = ids
        return event({**head, "choices": [choice]})

    for index, choice in enumerate(choices):
        for text, start, end in choice["pieces"]:
            yield chunk(index, text, ids=choice["ids"][start:end])
        yield chunk(index, "", choice["finish"])
    if include_usage:
        yield event({**head, "choices": [], "usage": usage(choices, prompt_tokens)})
    yield DONE


def pieces(tokenizer: Any, ids: list[int], text: str) -> list[tuple[str, int, int]]:
    """``ids`` as ``(text, start, end)`` spans, a token each where its text is whole (a
    character split across tokens waits for its last), joining to ``text``; one span of
    all of it if the tokens' decoding does not give ``text``."""
    spans, shown, start = [], "", 0
    for end in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:end], skip_special_tokens=True)
        if len(now) > len(shown) and now.startswith(shown) and not now.endswith("\ufffd"):
            spans.append((now[len(shown):], start, end))
            shown, start = now, end
    if start < len(ids):  # tokens with no text of their own (an end-of-sequence token)
        spans.append(("", start, len(ids)))
    return spans if shown == text else [(text, 0, len(ids))]
