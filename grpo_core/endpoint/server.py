"""The OpenAI-compatible endpoint agents talk to: ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models``, served on 127.0.0.1 while a rollout's agent episodes
run (:mod:`grpo_core.train.actor.drivers.agents`), and ``/v1/responses``
(:mod:`grpo_core.endpoint.responses_api`): starlette routes on a uvicorn server in a thread of
its own (HTTP/1.1, keep-alive, chunked bodies), as vLLM and SGLang serve theirs.

Each request names its episode by its key (``Authorization: Bearer <key>``, the
``api_key`` of an OpenAI client). The endpoint parses and checks it and hands it to its
``handle`` function (the agent driver's), which turns it into the prompt token ids the policy
continues and never re-tokenizes what the policy wrote: an episode's history is the tokens of
its first prompt, then, per call, the tokens the policy sampled and the tokens of the messages
the agent added after them (tool results, user turns, rendered by the chat template as an
in-process environment's observations are). A request whose messages do not extend that
history (the agent edited or dropped a message) starts a new training sample or fails its
episode (``rollout.agent.history``).

What a request may set: ``messages`` (or ``prompt``), ``tools``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``n``, ``logprobs``; ``temperature``, ``top_p`` and
``top_k`` only at the spec's values (the learner's log-probs assume them); ``stream`` and
``stream_options.include_usage`` (:mod:`grpo_core.endpoint.streaming`). Every request is
bounded: its body (``max_request_bytes``), the episode's calls
(``max_calls``), tokens (``max_total_tokens``) and its agent's own time (``timeout_s``: the time
its requests spend here, waiting for the shared policy, does not count), and the wait for one
answer (``wait_timeout_s``).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as StarletteRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from grpo_core.endpoint import responses_api
from grpo_core.endpoint.streaming import chat_events, completion_events
from grpo_core.errors import fault_text

#: Levels of arrays and objects a request body may nest (a tool's JSON schema takes a few;
#: the spec's YAML has the same bound).
MAX_DEPTH = 100
log = logging.getLogger("grpo.agents")
#: The POST routes under ``/v1``.
APIS = ("chat/completions", "completions", "responses")


class EndpointError(Exception):
    """A refused request: the HTTP status and the message the agent receives. ``fatal``
    also fails the episode (a broken limit, an edited history)."""

    def __init__(self, status: int, message: str, fatal: bool = False):
        super().__init__(message)
        self.status, self.message, self.fatal = status, message, fatal


@dataclass
class Request:
    """One completion request, parsed and checked: the episode, the messages (chat) or text
    (completions), the tools, and what may vary per request."""

    key: str
    api: str  # the route: "chat/completions", "completions", "responses"
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    instructions: str | None = None  # /v1/responses: echoed in the response object
    response_tools: list[dict[str, Any]] = field(default_factory=list)  # /v1/responses: its tools, as sent
    cut_status: str = "incomplete"  # /v1/responses: the status of an answer cut at a token limit

    @property
    def chat(self) -> bool:
        """Whether the request holds messages (rendered by the chat template), not text."""
        return self.api != "completions"


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _close(value: Any, spec_value: float) -> bool:
    """Whether a request's number is the spec's (an integer too large for a float is not)."""
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isclose(value, spec_value)
    except OverflowError:
        return False


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise EndpointError(400, f"{name}: a boolean; got {value!r:.60}")
    return bool(value)


def parse_request(body: dict[str, Any], key: str, api: str, sampling: Any, max_n: int) -> Request:
    """Check one request body against what the endpoint serves; an :class:`EndpointError`
    (400) naming the field otherwise."""
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict)
                                    and isinstance(options.get("include_usage", False), bool)):
        raise EndpointError(400, f"stream_options: an object {{include_usage: a boolean}}; got {options!r:.60}")
    for name, spec_value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        value = body.get(name)
        if value is not None and not _close(value, spec_value):
            raise EndpointError(400, f"{name}: {value!r:.60}; this run samples at the spec's rollout.{name}, "
                                     f"{spec_value} (the learner's log-probs assume it): omit it or send {spec_value}")
    top_k = body.get("top_k")
    served = (sampling.top_k, -1 if sampling.top_k == 0 else None)
    if top_k is not None and (not _integer(top_k) or top_k not in served):
        raise EndpointError(400, f"top_k: {top_k!r:.60}; this run samples with the spec's rollout.top_k, "
                                 f"{sampling.top_k}")
    n = body.get("n")
    n = 1 if n is None else n
    if not _integer(n) or not 1 <= n <= max_n:
        raise EndpointError(400, f"n: {n!r:.60}; 1 to {max_n} completions per request")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not _integer(max_tokens) or max_tokens < 1):
        raise EndpointError(400, f"max_tokens: {max_tokens!r:.60}; a positive integer")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 8:
        raise EndpointError(400, "stop: a string or a list of at most 8 non-empty strings")
    request = Request(key, api, max_tokens=max_tokens, stop=tuple(stop), n=n, logprobs=_flag(body, "logprobs"),
                      stream=stream, include_usage=stream and bool((options or {}).get("include_usage")))
    if request.chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise EndpointError(400, "messages: a non-empty list of {role, content} objects")
        for index, message in enumerate(messages):
            _check_message(message, f"messages[{index}]")
        request.messages = messages
        tools = body.get("tools") or []
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise EndpointError(400, "tools: a list of tool objects ({type: function, function: {...}})")
        for index, tool in enumerate(tools):
            function = tool.get("function")
            if "function" in tool and (not isinstance(function, dict) or not isinstance(function.get("name"), str)):
                raise EndpointError(400, f"tools[{index}].function: an object with a string name (and a description "
                                         f"and parameters); got {function!r:.60}")
        request.tools = tools
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise EndpointError(400, "prompt: a non-empty string (token-id and list prompts are not served)")
        request.prompt = prompt
    return request


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON (JSON has no NaN or infinities)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range (beyond a 64-bit float)")
    return value


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def decode_body(data: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or an :class:`EndpointError` (400, the episode goes
    on) saying what is wrong: not UTF-8, not JSON (NaN and infinities included, as JSON has
    none), nested deeper than :data:`MAX_DEPTH`, a string that is not valid Unicode (a lone
    surrogate escape), not an object."""
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is tolerated, as json.loads(bytes) did
    except UnicodeDecodeError as exc:
        raise EndpointError(400, f"the body is not valid UTF-8 (byte {exc.start}: {exc.reason}); send JSON "
                                 "encoded as UTF-8") from None
    try:
        body = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:
        raise EndpointError(400, f"the body nests deeper than {MAX_DEPTH} levels of arrays and objects") from None
    except ValueError as exc:
        raise EndpointError(400, f"the body is not JSON ({exc})") from None
    _check_tree(body)
    if not isinstance(body, dict):
        raise EndpointError(400, f"the body must be a JSON object, not {_json_type(body)}")
    return body


def _check_tree(value: Any) -> None:
    """Every array and object within :data:`MAX_DEPTH` levels, every string (keys too)
    encodable as UTF-8: what the chat template, the tokenizer and the answer's JSON take."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise EndpointError(400, f"a string of the body is not valid Unicode ({exc.reason}: "
                                         f"{item[exc.start:exc.end]!r}); send text, not lone surrogates") from None
        elif isinstance(item, (list, dict)):
            if depth > MAX_DEPTH:
                raise EndpointError(400, f"the body nests deeper than {MAX_DEPTH} levels of arrays and objects")
            children = item if isinstance(item, list) else [*item, *item.values()]
            stack.extend((child, depth + 1) for child in children)


def _check_message(message: dict[str, Any], where: str) -> None:
    """A 400 naming ``where`` unless the message's content and tool calls have the shapes the
    OpenAI API gives them (the fields the endpoint reads; others are ignored)."""
    content = message.get("content")
    if not (content is None or isinstance(content, str) or isinstance(content, list) and all(
            isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content)):
        raise EndpointError(400, f"{where}.content: a string, null or a list of content parts "
                                 f"({{type: text, text: ...}}); got {type(content).__name__}")
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)):
        raise EndpointError(400, f"{where}.tool_calls: a list of {{id, type, function: {{name, arguments}}}} objects "
                                 "(as the endpoint answered them)")


def plain(message: dict[str, Any]) -> dict[str, Any]:
    """What the chat template renders of a message the agent sent: its role and text (a
    ``tool_call_id``, a name and other client fields left out, as the tools environment's
    messages have none)."""
    content = message.get("content")
    if isinstance(content, list):  # typed parts: the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": message["role"], "content": "" if content is None else str(content)}


def tool_calls(message: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """``(name, arguments)`` of each of a message's tool calls, arguments sent as a JSON string
    parsed to an object (left as sent when they do not parse)."""
    out = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        out.append((function.get("name"), arguments))
    return out


def same_message(sent: dict[str, Any], answered: dict[str, Any]) -> bool:
    """Whether ``sent`` (a message in a request) is the assistant message the endpoint
    answered: the same text and the same tool calls (names and arguments), whatever other
    fields the client echoed."""
    if sent.get("role") != "assistant":
        return False
    same_text = (plain(sent)["content"] or "") == (answered.get("content") or "")
    return same_text and tool_calls(sent) == tool_calls(answered)


def response_body(request: Request, choices: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    """An OpenAI ``chat.completion`` or ``text_completion`` object; each choice dict holds
    ``text``, ``ids``, ``logp`` (or None), ``finish`` and, for chat, ``message``."""
    created, out = int(time.time()), []
    for index, choice in enumerate(choices):
        logprobs = None
        if request.logprobs and choice["logp"] is not None:
            logprobs = {"content": [{"token": str(t), "logprob": float(lp), "bytes": None, "top_logprobs": []}
                                    for t, lp in zip(choice["ids"], choice["logp"])]}
        entry: dict[str, Any] = {"index": index, "finish_reason": choice["finish"], "logprobs": logprobs,
                                 "token_ids": list(choice["ids"])}
        if request.chat:
            entry["message"] = choice["message"]
        else:
            entry["text"] = choice["text"]
        out.append(entry)
    completion_tokens = sum(len(c["ids"]) for c in choices)
    return {
        "id": f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if request.chat else "text_completion",
        "created": created, "model": "policy", "choices": out,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


class Endpoint:
    """The HTTP server of one rollout's agent episodes: starlette routes served by uvicorn
    (HTTP/1.1, keep-alive) in a thread of its own, on 127.0.0.1 at a free port.

    ``handle(request) -> (choices, prompt_tokens)`` (the agent runner's, blocking until the
    policy answered) does the work in a worker thread, and ``refuse(key, error)`` hears of
    every refused request (a fatal one fails the episode); the server reads and bounds the
    body, parses it, and writes the answer as JSON or as server-sent events. :meth:`close`
    stops it."""

    #: Connections the kernel queues before the server accepts them: every episode of a step
    #: may connect at once (the standard library's default, 5, dropped some of 32 agents).
    BACKLOG = 2048

    def __init__(self, handle, refuse, sampling: Any, max_request_bytes: int, max_n: int,
                 cut_response: str = "incomplete"):
        self.handle, self.refuse, self.sampling = handle, refuse, sampling
        self.cut_response = cut_response
        self.max_request_bytes, self.max_n = max_request_bytes, max_n
        # Every waiting request holds a worker thread until its batch's generate returns: room
        # for far more than rollout.agent.concurrency, so no episode waits for another's thread.
        self.limiter = anyio.CapacityLimiter(1024)
        app = Starlette(routes=[
            Route("/v1/models", self._models, methods=["GET"]),
            *(Route(f"/v1/{api}", self._post, methods=["POST"], name=api) for api in APIS),
            Route("/v1/responses/{rest:path}", self._stored, methods=["GET", "POST", "DELETE"]),
        ], exception_handlers={HTTPException: self._no_route})
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(self.BACKLOG)
        config = uvicorn.Config(app, http="h11", loop="asyncio", ws="none", lifespan="off", log_config=None,
                                log_level="warning", access_log=False, backlog=self.BACKLOG,
                                timeout_graceful_shutdown=1, timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="grpo-agent-endpoint", daemon=True)
        self.thread.start()
        while not self.server.started:  # serving before the first agent starts
            if not self.thread.is_alive():
                raise RuntimeError("the agent endpoint's server did not start (see the log above)")
            time.sleep(0.005)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.socket.getsockname()[1]}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()

    # ----------------------------------------------------------------- requests
    async def _models(self, http: StarletteRequest) -> Response:
        return _json({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "grpo"}]})

    async def _stored(self, http: StarletteRequest) -> Response:
        """Retrieving, cancelling or deleting a stored response: nothing is stored."""
        return _json(_error(f"{http.method} {http.url.path}: stored responses are not served (every /v1/responses "
                            "request is answered and forgotten); keep the output items the answer gave"), 400)

    async def _no_route(self, http: StarletteRequest, exc: HTTPException) -> Response:
        served = ", ".join(f"POST /v1/{api}" for api in APIS)
        return _json(_error(f"no route {http.method} {http.url.path}; {served}, GET /v1/models"), exc.status_code)

    async def _post(self, http: StarletteRequest) -> Response:
        api = http.scope["route"].name
        key = (http.headers.get("authorization") or "").removeprefix("Bearer ").strip()
        try:
            data = await self._read(http)
            request, answer = await anyio.to_thread.run_sync(self._work, data, key, api, limiter=self.limiter)
            if request.api == "responses":
                if request.stream:
                    return _events(responses_api.response_events(request, *answer))
                return _json(responses_api.response_body(request, *answer))
            if request.stream:
                return _events((chat_events if request.chat else completion_events)(request, *answer,
                                                                                    request.include_usage))
            return _json(response_body(request, *answer))
        except EndpointError as exc:
            self.refuse(key, exc)
            headers = {"Connection": "close"} if exc.status == 413 else None  # the body was not read
            return _json(_error(exc.message), exc.status, headers)
        except BaseException as exc:  # noqa: BLE001 - the engine's fault on this request: answered, never dropped
            log.warning("the agent endpoint failed on a request of episode key %s...", key[:6], exc_info=True)
            error = EndpointError(500, f"the endpoint failed on this request ({fault_text(exc)}); the episode is "
                                       "failed (a bug: please report it)", fatal=True)
            self.refuse(key, error)
            return _json(_error(error.message), 500)

    def _work(self, data: bytes, key: str, api: str) -> tuple[Request, tuple[list[dict[str, Any]], int]]:
        """In a worker thread: the body parsed, then the runner's answer (which waits for the
        batch's generate)."""
        body = decode_body(data or b"{}")
        if api != "responses":
            request = parse_request(body, key, api, self.sampling, self.max_n)
            return request, self.handle(request)
        try:
            chat = responses_api.chat_body(body)
        except responses_api.NotServed as exc:
            raise EndpointError(400, str(exc)) from None
        request = parse_request(chat, key, api, self.sampling, self.max_n)
        request.instructions = body.get("instructions")
        request.response_tools = body.get("tools") or []
        request.cut_status = self.cut_response
        return request, self.handle(request)

    async def _read(self, http: StarletteRequest) -> bytes:
        """The body, at most ``max_request_bytes``: a larger declared length is refused before
        reading, a chunked body as soon as it grows past the cap (413, the episode fails)."""
        cap = self.max_request_bytes
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise EndpointError(413, f"request body of {declared} bytes; rollout.agent.max_request_bytes is {cap}",
                                fatal=True)
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > cap:
                raise EndpointError(413, f"request body over {cap} bytes; rollout.agent.max_request_bytes is {cap}",
                                    fatal=True)
            chunks.append(chunk)
        return b"".join(chunks)

def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def _json(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status, headers, media_type="application/json")


def _events(events: Any) -> Response:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
