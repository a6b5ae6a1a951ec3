"""What the vLLM plugins' tests share: the tiny policy (a fixture; the tokenizer is
tests/plugins/conftest.py's), and, imported as ``from .conftest import ...``, a free port and an
OpenAI-style server without vLLM's development routes."""

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
