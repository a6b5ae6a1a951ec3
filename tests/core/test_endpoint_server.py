"""The agent endpoint's HTTP server (issue 48, item 1): starlette routes served by uvicorn in a
thread, on real sockets on 127.0.0.1. A plain function stands in for the agent runner (the
runner's own behaviour is tested with real models in test_agents.py): what is checked here is
the protocol, HTTP/1.1 keep-alive, chunked bodies and their cap, many connections at once,
and errors as OpenAI-shaped JSON."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

from grpo_core.endpoint.server import Endpoint, EndpointError

SAMPLING = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0)


class Runner:
    """Answers every request with one fixed choice and records what it was asked and refused."""

    def __init__(self):
        self.requests, self.refused = [], []

    def handle(self, request):
        self.requests.append(request)
        if request.key == "bad":
            raise EndpointError(401, "unknown episode key")
        text = "Hello there"
        choice = {"text": text, "ids": [1, 2], "logp": [-0.5, -0.25], "finish": "stop",
                  "message": {"role": "assistant", "content": text}}
        return [choice], 7

    def refuse(self, key, error):
        self.refused.append((key, error.status, error.fatal))


@pytest.fixture
def served():
    runner = Runner()
    endpoint = Endpoint(runner.handle, runner.refuse, SAMPLING, max_request_bytes=4096, max_n=2)
    yield endpoint, runner
    endpoint.close()


def _connection(endpoint) -> http.client.HTTPConnection:
    url = urlsplit(endpoint.base_url)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=10)


CHAT = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_one_connection_serves_many_requests_over_http_1_1(served):
    """Keep-alive: an agent's client sends its calls over one connection; the server keeps it
    open (HTTP/1.1, no Connection: close) and answers each."""
    endpoint, runner = served
    connection = _connection(endpoint)
    sockets = []
    for _ in range(3):
        connection.request("POST", "/v1/chat/completions", body=CHAT, headers={"Authorization": "Bearer k"})
        answer = connection.getresponse()
        body = json.loads(answer.read())
        assert answer.status == 200 and answer.version == 11 and not answer.will_close
        assert body["choices"][0]["message"]["content"] == "Hello there" and body["usage"]["prompt_tokens"] == 7
        sockets.append(connection.sock)
    assert sockets[0] is not None and all(s is sockets[0] for s in sockets)
    connection.close()
    assert [r.key for r in runner.requests] == ["k"] * 3


def _chunked(endpoint, parts: list[bytes], key: str = "k") -> tuple[int, dict, socket.socket]:
    """A POST whose body is sent with Transfer-Encoding: chunked (no Content-Length)."""
    connection = _connection(endpoint)
    connection.putrequest("POST", "/v1/chat/completions")
    connection.putheader("Authorization", f"Bearer {key}")
    connection.putheader("Transfer-Encoding", "chunked")
    connection.endheaders()
    try:
        for part in parts:
            connection.send(b"%x\r\n%s\r\n" % (len(part), part))
        connection.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):  # refused before the body ended
        pass
    answer = connection.getresponse()
    body = json.loads(answer.read())
    return answer.status, body, answer


def test_a_chunked_body_is_served_and_capped(served):
    """A body without Content-Length (chunked) is read (the old server answered 411); one that
    grows past max_request_bytes is a 413 that fails its episode and closes the connection."""
    endpoint, runner = served
    status, body, _ = _chunked(endpoint, [CHAT[:10], CHAT[10:]])
    assert status == 200 and body["choices"][0]["message"]["content"] == "Hello there"
    status, body, answer = _chunked(endpoint, [b" " * 3000, b" " * 3000], key="big")
    assert status == 413 and "request body over 4096 bytes; rollout.agent.max_request_bytes is 4096" in \
        body["error"]["message"]
    assert answer.will_close
    assert ("big", 413, True) in runner.refused


def test_a_declared_length_over_the_cap_is_refused_unread(served):
    endpoint, runner = served
    connection = _connection(endpoint)
    connection.putrequest("POST", "/v1/chat/completions")
    connection.putheader("Authorization", "Bearer k")
    connection.putheader("Content-Length", "5000000")
    connection.endheaders()
    answer = connection.getresponse()
    message = json.loads(answer.read())["error"]["message"]
    assert answer.status == 413 and message == "request body of 5000000 bytes; rollout.agent.max_request_bytes is 4096"
    assert answer.will_close and runner.refused == [("k", 413, True)] and not runner.requests


def test_unknown_routes_and_methods_are_json_errors_naming_the_routes(served):
    endpoint, _ = served
    for method, path, status in (("POST", "/v1/embeddings", 404), ("GET", "/v1/chat/completions", 405),
                                 ("POST", "/v2/chat/completions", 404)):
        connection = _connection(endpoint)
        connection.request(method, path, body=b"{}" if method == "POST" else None)
        answer = connection.getresponse()
        message = json.loads(answer.read())["error"]["message"]
        assert answer.status == status, (path, message)
        assert message.startswith(f"no route {method} {path}; POST /v1/chat/completions, POST /v1/completions")
    connection = _connection(endpoint)
    connection.request("GET", "/v1/models")
    assert json.loads(connection.getresponse().read())["data"][0]["id"] == "policy"


def test_errors_are_answered_and_a_bug_is_a_500_that_fails_the_episode(served):
    endpoint, runner = served
    connection = _connection(endpoint)
    connection.request("POST", "/v1/chat/completions", body=CHAT, headers={"Authorization": "Bearer bad"})
    answer = connection.getresponse()
    assert answer.status == 401 and json.loads(answer.read())["error"]["message"] == "unknown episode key"
    endpoint.handle = lambda request: 1 / 0
    connection.request("POST", "/v1/chat/completions", body=CHAT, headers={"Authorization": "Bearer k"})
    answer = connection.getresponse()
    message = json.loads(answer.read())["error"]["message"]
    assert answer.status == 500 and "ZeroDivisionError" in message and "the episode is failed" in message
    assert runner.refused == [("bad", 401, False), ("k", 500, True)]


def test_two_hundred_connections_at_once_are_all_answered(served):
    """Every connection of a burst is accepted (the listen backlog) and answered while the
    others wait in the runner (a worker thread each)."""
    endpoint, runner = served
    gate = threading.Barrier(200, timeout=30)
    original = runner.handle

    def together(request):
        gate.wait()  # every request is inside the runner at once
        return original(request)

    endpoint.handle = together
    statuses = []

    def one():
        connection = _connection(endpoint)
        connection.request("POST", "/v1/chat/completions", body=CHAT, headers={"Authorization": "Bearer k"})
        statuses.append(connection.getresponse().status)
        connection.close()

    threads = [threading.Thread(target=one) for _ in range(200)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert statuses == [200] * 200


def test_close_stops_the_server_and_frees_its_thread(served):
    endpoint, _ = served
    endpoint.close()
    assert not endpoint.thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(urlsplit(endpoint.base_url).port)), timeout=2)


def test_stored_responses_are_a_400_naming_them(served):
    """/v1/responses is stateless: retrieving, cancelling or deleting a response says so."""
    endpoint, _ = served
    for method, path in (("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                         ("POST", "/v1/responses/resp_1/cancel"), ("GET", "/v1/responses/resp_1/input_items")):
        connection = _connection(endpoint)
        connection.request(method, path, body=b"{}" if method == "POST" else None)
        answer = connection.getresponse()
        message = json.loads(answer.read())["error"]["message"]
        assert answer.status == 400 and message.startswith(f"{method} {path}: stored responses are not served")
