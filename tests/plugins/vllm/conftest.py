"""What the vLLM plugins' tests share: the tiny policy (a fixture; the tokenizer is
tests/plugins/conftest.py's), and, imported as ``from .conftest import ...``, a free port, an
OpenAI-style server without vLLM's development routes, and an imitation ``grpo-run serve``
server (``FakeServe``, started by the ``serve`` fixture) whose answers each test makes."""

from __future__ import annotations

import http.server
import json
import socket

import pytest

from grpo_core.testing import build_model


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_model(tokenizer)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PlainOpenAIServer(http.server.BaseHTTPRequestHandler):
    """An OpenAI-style server without vLLM's development routes (as a plain ``vllm serve``)."""

    answers = {"/v1/models": {"data": [{"id": "m"}]}, "/weight_info": {"weight_version": "run/3"}}

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps(self.answers[self.path]).encode() if self.path in self.answers else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def good_answer(body: dict) -> dict:
    """What a rollout server answers to a ``/v1/completions`` request: ``n`` completions of
    ``max_tokens`` token ids (2, 3, ...), each with a log-prob per token."""
    n, size = body["n"], body["max_tokens"]
    return {"choices": [
        {"index": k, "text": "", "finish_reason": "length", "token_ids": [2 + (k + t) % 50 for t in range(size)],
         "logprobs": {"token_logprobs": [-0.5 - 0.01 * t for t in range(size)]}}
        for k in range(n)
    ]}


class FakeServe:
    """An imitation of a ``grpo-run serve`` server on 127.0.0.1: the routes the ``vllm-server``
    backend calls, the weights received over the real weight channel (a gloo group joined from
    the server's thread), and ``/v1/completions`` answered by ``handle(handler, body)`` (by
    default :func:`good_answer`). With ``secret``, every route but ``/health`` answers 401
    unless the request carries ``Authorization: Bearer <secret>``. Every request's path and
    headers are recorded in ``requests``."""

    def __init__(self, handle=None, secret: str | None = None):
        import threading

        from grpo_plugins.rollout.channel import open_group, receive_tensors

        self.requests: list[tuple[str, dict]] = []
        self.version: str | None = None
        self.received = 0
        fake = self
        channel: dict = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def reply(self, status: int, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def route(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append((self.path, dict(self.headers)))
                if secret is not None and self.path != "/health" \
                        and self.headers.get("Authorization") != f"Bearer {secret}":
                    return self.reply(401, {"error": "Unauthorized"})
                if self.path == "/v1/completions":
                    try:
                        return (handle or (lambda h, b: h.reply(200, good_answer(b))))(self, body)
                    except (BrokenPipeError, ConnectionResetError):  # the client gave up: what is tested
                        return None
                if self.path == "/init_weight_transfer_engine":
                    info = body["init_info"]
                    channel["group"] = open_group(info["host"], info["port"], 1, info["world_size"], info["backend"],
                                                  info["timeout_s"], info["token"])
                elif self.path == "/update_weights":
                    fake.received += sum(1 for _ in receive_tensors(channel["group"], body["update_info"], "cpu"))
                elif self.path == "/finish_weight_update":
                    fake.version = body["weight_version"]
                answers = {
                    "/v1/models": {"data": [{"id": "m"}]},
                    "/collective_rpc": {"results": [{"engine": "TorchWeightTransferEngine", "dtype": "float32",
                                                     "rank": 0}]},
                    "/weight_info": {"weight_version": fake.version},
                }
                self.reply(200, answers.get(self.path, {}))

            def do_GET(self):  # noqa: N802 (http.server's name)
                self.route("GET")

            def do_POST(self):  # noqa: N802
                self.route("POST")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def completions_asked(self) -> int:
        return sum(1 for path, _ in self.requests if path == "/v1/completions")

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    """``serve(handle=None, secret=None)``: a started :class:`FakeServe`, closed at teardown."""
    started: list[FakeServe] = []

    def start(handle=None, secret=None) -> FakeServe:
        started.append(FakeServe(handle, secret))
        return started[-1]

    yield start
    for server in started:
        server.close()
