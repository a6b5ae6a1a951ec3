"""A server the ``remote`` reward calls must not leak secrets or hang the run (issue 26,
items 4-7): redirects are not followed (the Authorization header never reaches another
origin), the answer is capped, ``timeout`` is a deadline for the whole request, and a
non-finite duration is refused at validation. Real ``http.server`` servers on 127.0.0.1,
each test bounded in time."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from grpo_plugins.rewards.remote import RemoteOptions, RemoteReward
from pydantic import ValidationError

from grpo_core.errors import RunError

PROMPTS = ["a", "b"]
COMPLETIONS = ["x", "yy"]


class Server:
    """``handle(handler)`` answers each POST; every request's headers are recorded."""

    def __init__(self, handle):
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.requests.append(dict(self.headers))
                try:
                    handle(self)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up: what we test
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    started: list[Server] = []

    def start(handle) -> Server:
        started.append(Server(handle))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _answer(handler, status: int, body: bytes, **headers: str) -> None:
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body)))
    for key, value in headers.items():
        handler.send_header(key, value)
    handler.end_headers()
    handler.wfile.write(body)


def _rewards(handler) -> None:
    _answer(handler, 200, json.dumps({"rewards": [0.25, 0.75]}).encode())


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_the_secret_stays_home(serve, monkeypatch, status):
    monkeypatch.setenv("RM_AUTH", "Bearer s3cret")
    elsewhere = serve(_rewards)  # another origin (another port), that would answer with rewards
    home = serve(lambda h: _answer(h, status, b"", Location=elsewhere.url))
    fn = RemoteReward(RemoteOptions(url=home.url, headers_from_env={"Authorization": "RM_AUTH"},
                                    retries=2, backoff=0.01, timeout=5))
    started = time.monotonic()
    with pytest.raises(RunError, match=rf"answered HTTP {status} .*a redirect to '{elsewhere.url}'; redirects "
                       "are not followed"):
        fn(PROMPTS, COMPLETIONS)
    assert time.monotonic() - started < 5
    assert elsewhere.requests == []  # neither the headers nor the request went there
    assert len(home.requests) == 1 and home.requests[0]["Authorization"] == "Bearer s3cret"  # not retried


def _endless(handler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.end_headers()  # no Content-Length: read until the server closes, which it never does
    handler.wfile.write(b'{"rewards": [')
    chunk = b"1, " * 4096
    deadline, sent = time.monotonic() + 20, 0
    while time.monotonic() < deadline and sent < 64 << 20:  # endless to the client: 640 times its cap
        handler.wfile.write(chunk)
        sent += len(chunk)


def test_an_endless_answer_is_cut_at_max_response_bytes(serve):
    server = serve(_endless)
    fn = RemoteReward(RemoteOptions(url=server.url, max_response_bytes=100_000, timeout=10, retries=0))
    started = time.monotonic()
    with pytest.raises(RunError, match=r"reward function 'remote': the answer of .* is longer than "
                       r"max_response_bytes \(100000 bytes\)"):
        fn(PROMPTS, COMPLETIONS)
    assert time.monotonic() - started < 8


def test_a_declared_length_over_the_cap_is_refused_before_reading(serve):
    server = serve(lambda h: _answer(h, 200, b" " * 5000 + json.dumps({"rewards": [1, 2]}).encode()))
    with pytest.raises(RunError, match=r"longer than max_response_bytes \(1000 bytes\)"):
        RemoteReward(RemoteOptions(url=server.url, max_response_bytes=1000, retries=0))(PROMPTS, COMPLETIONS)
    fn = RemoteReward(RemoteOptions(url=server.url, retries=0))  # the default cap (8 MiB) lets it through
    assert fn(PROMPTS, COMPLETIONS) == [1.0, 2.0]


def _drip(handler) -> None:
    body = json.dumps({"rewards": [1, 2]}).encode()
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    for byte in body:  # one byte every 0.25 s: about 4 s for the whole answer
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        time.sleep(0.25)


def test_timeout_is_a_deadline_for_the_whole_request(serve):
    server = serve(_drip)
    fn = RemoteReward(RemoteOptions(url=server.url, timeout=1, retries=1, backoff=0.01))
    started = time.monotonic()
    with pytest.raises(RunError, match=r"failed after 2 attempt\(s\): timed out after 1 s"):
        fn(PROMPTS, COMPLETIONS)
    took = time.monotonic() - started
    assert took < 3.0, took  # two attempts of at most 1 s each (each read alone is 0.25 s: never timed out)
    assert len(server.requests) == 2


def test_a_drip_that_finishes_within_the_deadline_is_read(serve):
    server = serve(_drip)
    assert RemoteReward(RemoteOptions(url=server.url, timeout=30, retries=0))(PROMPTS, COMPLETIONS) == [1.0, 2.0]


@pytest.mark.parametrize("key", ["timeout", "backoff", "backoff_max"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_non_finite_duration_is_refused(key, value):
    with pytest.raises(ValidationError, match=rf"{key}\n  Input should be a finite number"):
        RemoteOptions(url="http://127.0.0.1:1/", **{key: value})


@pytest.mark.parametrize("value", [True, False])
def test_json_booleans_follow_the_one_rule_for_reward_values(serve, value):
    server = serve(lambda h: _answer(h, 200, json.dumps({"rewards": [value, None]}).encode()))
    assert RemoteReward(RemoteOptions(url=server.url, retries=0))(PROMPTS, COMPLETIONS) == [float(value), None]
