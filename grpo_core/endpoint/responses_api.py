"""``POST /v1/responses``: the stateless part of OpenAI's Responses API that agent SDKs send
(the OpenAI Agents SDK's default model, ``client.responses.create``), served by the agent
endpoint as a chat request.

A request's ``instructions`` and ``input`` items become chat messages (``instructions`` a
system message; ``message`` items by role, ``developer`` as ``system``; a ``function_call``
item joins the assistant message before it as a tool call; a ``function_call_output`` item is
a ``tool`` message; ``reasoning`` items are left out, as the chat template leaves past
reasoning out), ``function`` tools become chat tools and ``max_output_tokens`` the token cap.
The episode's history is then extended and recorded as a chat request's is. The answer is a
``response`` object whose ``output`` holds a ``message`` item (the text) and a
``function_call`` item per tool call (after a ``reasoning`` item when the policy's thinking
was split out, :mod:`grpo_core.endpoint.toolcalls`), or, with ``stream: true``, the Responses API's events
(``response.created`` ... ``response.completed``), written once the batch's generate returned
(:mod:`grpo_core.endpoint.streaming`).

Not served, each a 400 naming it: stored state (``previous_response_id``, ``conversation``,
``item_reference`` items, ``background``; ``store`` is accepted and nothing is stored), built-in
tools (``web_search``, ``file_search``, ``code_interpreter``, ...), and inputs other than text
(images, files, audio).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from grpo_core.endpoint.streaming import event

#: The text content parts an input message may hold.
TEXT_PARTS = ("input_text", "output_text", "text")


class NotServed(ValueError):
    """A request the endpoint answers with a 400 carrying this message (the episode goes on)."""


def _refuse(message: str) -> Exception:
    return NotServed(message)


def _text(content: Any, where: str) -> str:
    """The text of an item's ``content`` (a string or text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{where}: a string or a list of content parts; got {type(content).__name__}")
    out = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _refuse(f"{where}[{index}]: {kind!r:.40} content is not served; text parts only "
                          f"({', '.join(TEXT_PARTS)}, each with a string text)")
        out.append(part["text"])
    return "".join(out)


def _messages(items: Any, instructions: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _refuse("instructions: a string (input items as instructions are not served)")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _refuse("input: a string or a non-empty list of input items")
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _refuse(f"{where}: an object (an input item); got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _refuse(f"{where}.role: user, system, developer or assistant; got {role!r:.40}")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(arguments, str) and isinstance(call_id, str)):
                raise _refuse(f"{where}: a function_call item has a string call_id, name and arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":  # the text and calls of one answer
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _refuse(f"{where}.call_id: a string")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # past reasoning: not part of what the chat template renders
        elif kind == "item_reference":
            raise _refuse(f"{where}: item_reference items name stored items, which are not served; send the item "
                          "itself")
        else:
            raise _refuse(f"{where}.type: {kind!r:.40} items are not served; message, function_call, "
                          "function_call_output (and reasoning, left out)")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _refuse("tools: a list of function tools ({type: function, name, parameters})")
    out = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _refuse(f"tools[{index}]: the built-in tool {kind!r:.40} is not served; function tools only "
                          "({type: function, name, description, parameters})")
        if not isinstance(tool.get("name"), str):
            raise _refuse(f"tools[{index}].name: a string")
        # the chat API's function: the tool's fields in the order sent (the chat template writes them as
        # JSON, key by key), as a chat client would have sent the same tool
        function = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": function})
    return out


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body a ``/v1/responses`` body stands for, or a 400 naming what is
    not served."""
    for name, why in (("previous_response_id", "stored responses are not served"),
                      ("conversation", "stored conversations are not served")):
        if body.get(name) is not None:
            raise _refuse(f"{name}: {why}; send the whole conversation as input items (and store: false)")
    if body.get("background"):
        raise _refuse("background: background responses are not served; send background: false")
    out_tokens = body.get("max_output_tokens")
    if out_tokens is not None and (not isinstance(out_tokens, int) or isinstance(out_tokens, bool) or out_tokens < 1):
        raise _refuse(f"max_output_tokens: {out_tokens!r:.60}; a positive integer")
    chat = {"messages": _messages(body.get("input"), body.get("instructions")), "tools": _tools(body.get("tools"))}
    for name in ("temperature", "top_p", "stream"):
        if name in body:
            chat[name] = body[name]
    if out_tokens is not None:
        chat["max_tokens"] = out_tokens
    return chat


def _items(choice: dict[str, Any], ids: dict[str, str]) -> list[dict[str, Any]]:
    """The output items of ``choice``: its text as a message item, each tool call a
    function_call item (ids fixed by ``ids``, so that stream events and the final response
    name the same items)."""
    message = choice["message"]
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):  # the policy's thinking (a template that splits it out)
        items.append({"type": "reasoning", "id": ids.setdefault("reasoning", f"rs_{uuid.uuid4().hex}"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    content = message.get("content") or ""
    if content or not message.get("tool_calls"):
        items.append({"type": "message", "id": ids.setdefault("message", f"msg_{uuid.uuid4().hex}"),
                      "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}]})
    for number, call in enumerate(message.get("tool_calls") or []):
        items.append({"type": "function_call", "id": ids.setdefault(f"call{number}", f"fc_{uuid.uuid4().hex}"),
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def response_object(request: Any, choice: dict[str, Any], prompt_tokens: int, response_id: str,
                    ids: dict[str, str], done: bool = True) -> dict[str, Any]:
    """A ``response`` object of one choice (``done=False``: as it starts, in progress, no output)."""
    # cut at a token limit: incomplete, as OpenAI answers, unless rollout.agent.cut_response says completed
    incomplete = choice["finish"] == "length" and request.cut_status == "incomplete"
    status = ("incomplete" if incomplete else "completed") if done else "in_progress"
    completion = len(choice["ids"])
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": "policy",
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and done else None,
        "instructions": request.instructions, "max_output_tokens": request.max_tokens, "metadata": {},
        "output": _items(choice, ids) if done else [], "parallel_tool_calls": True, "tool_choice": "auto",
        "tools": request.response_tools, "temperature": None, "top_p": None, "store": False,
        "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt_tokens + completion} if done else None,
        "token_ids": list(choice["ids"]) if done else None,
    }


def response_body(request: Any, choices: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    return response_object(request, choices[0], prompt_tokens, f"resp_{uuid.uuid4().hex}", {})


def response_events(request: Any, choices: list[dict[str, Any]], prompt_tokens: int) -> Iterator[bytes]:
    """The Responses API's stream of one answer: created, in progress, each output item
    (added, its text deltas token by token or its arguments, done), then completed (or
    incomplete) with the whole response."""
    choice, response_id, ids = choices[0], f"resp_{uuid.uuid4().hex}", {}
    sequence = iter(range(1 << 30))

    def emit(kind: str, **data: Any) -> bytes:
        return event({"type": kind, "sequence_number": next(sequence), **data}, kind)

    final = response_object(request, choice, prompt_tokens, response_id, ids)
    start = response_object(request, choice, prompt_tokens, response_id, ids, done=False)
    yield emit("response.created", response=start)
    yield emit("response.in_progress", response=start)
    for index, item in enumerate(final["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            yield emit("response.output_item.added", output_index=index,
                       item={**item, "status": "in_progress", "content": []})
            yield emit("response.content_part.added", output_index=index, item_id=item["id"], content_index=0,
                       part={**part, "text": ""})
            whole = part["text"] == choice["text"]
            for text, _, _ in choice["pieces"] if whole else [(part["text"], 0, 0)]:
                if text:
                    yield emit("response.output_text.delta", output_index=index, item_id=item["id"], content_index=0,
                               delta=text, logprobs=[])
            yield emit("response.output_text.done", output_index=index, item_id=item["id"], content_index=0,
                       text=part["text"], logprobs=[])
            yield emit("response.content_part.done", output_index=index, item_id=item["id"], content_index=0,
                       part=part)
        elif item["type"] == "reasoning":
            yield emit("response.output_item.added", output_index=index, item=item)
        else:
            yield emit("response.output_item.added", output_index=index,
                       item={**item, "status": "in_progress", "arguments": ""})
            yield emit("response.function_call_arguments.delta", output_index=index, item_id=item["id"],
                       delta=item["arguments"])
            yield emit("response.function_call_arguments.done", output_index=index, item_id=item["id"],
                       name=item["name"], arguments=item["arguments"])
        yield emit("response.output_item.done", output_index=index, item=item)
    yield emit("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
