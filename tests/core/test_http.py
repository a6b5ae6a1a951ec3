"""The one HTTP client (:mod:`grpo_core.http`, issue 34 item 1) on real servers on 127.0.0.1:
no redirects (named with their Location), the body cap (a declared length refused before
reading, a stream cut), a deadline per attempt that a dripping server cannot stretch, retries
of what may succeed next time only, durations the platform can represent, and every error
naming the method and URL."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_core.http import (
    BadAnswer,
    HTTPClient,
    HTTPFailure,
    Redirected,
    StatusError,
    TooLarge,
    Unreachable,
)
from grpo_core.options import MAX_SECONDS


class Server:
    """``handle(handler)`` answers every request; each one's method, path and headers are kept."""

    def __init__(self, handle):
        self.requests: list[tuple[str, str, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append((self.command, self.path, dict(self.headers)))
                try:
                    handle(self)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up: what is tested
                    pass

            do_GET = do_POST = _any  # noqa: N815 (http.server's names)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
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
    for server in started:
        server.close()


def answer(status: int, body: bytes = b"", **headers: str):
    def handle(handler):
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            handler.send_header(key.replace("_", "-"), value)
        handler.end_headers()
        handler.wfile.write(body)

    return handle


def test_a_json_round_trip_with_the_clients_headers(serve):
    server = serve(answer(200, b'{"ok": [1, 2]}'))
    client = HTTPClient(timeout_s=5, headers={"Authorization": "Bearer t"})
    got = client.request("POST", server.url + "/x?q=1", json={"a": 1}, headers={"X-Extra": "y"})
    assert got.status == 200 and got.json() == {"ok": [1, 2]}
    method, path, headers = server.requests[0]
    assert (method, path) == ("POST", "/x?q=1")
    assert headers["Authorization"] == "Bearer t" and headers["X-Extra"] == "y"
    assert headers["Content-Type"] == "application/json"


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_an_error_naming_the_url_and_the_location(serve, status):
    elsewhere = serve(answer(200, b"{}"))
    home = serve(answer(status, Location=elsewhere.url + "/other"))
    with pytest.raises(Redirected) as info:
        HTTPClient(timeout_s=5, retries=3, backoff_s=0).request("POST", home.url + "/p", json={})
    assert str(info.value).startswith(f"POST {home.url}/p answered HTTP {status} ")
    assert f"a redirect to '{elsewhere.url}/other'; redirects are not followed" in str(info.value)
    assert info.value.location == elsewhere.url + "/other"
    assert elsewhere.requests == [] and len(home.requests) == 1  # neither followed nor retried


def test_a_declared_length_over_the_cap_is_refused_before_reading(serve):
    def declares(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", "400000000")
        handler.end_headers()
        handler.wfile.write(b"{")
        time.sleep(5)  # the rest never comes

    server = serve(declares)
    started = time.monotonic()
    with pytest.raises(TooLarge, match=r"GET .* answered a body of 400000000 bytes \(Content-Length\); at most "
                                       r"1000 bytes are read"):
        HTTPClient(timeout_s=10, max_bytes=1000).request("GET", server.url)
    assert time.monotonic() - started < 2


def test_an_endless_stream_is_cut_after_the_cap(serve):
    def endless(handler):
        handler.send_response(200)
        handler.end_headers()  # no Content-Length: read until the server closes, which it does not
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            handler.wfile.write(b"x" * 65536)

    server = serve(endless)
    started = time.monotonic()
    with pytest.raises(TooLarge, match="answered a body of more than 100000 bytes"):
        HTTPClient(timeout_s=10, max_bytes=100_000).request("GET", server.url)
    assert time.monotonic() - started < 5


def test_the_deadline_covers_the_whole_answer_however_slowly_it_drips(serve):
    def drip(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", "40")
        handler.end_headers()
        for _ in range(40):  # a byte every 0.2 s: 8 s in all, each read well within any per-read timeout
            handler.wfile.write(b"1")
            handler.wfile.flush()
            time.sleep(0.2)

    server = serve(drip)
    started = time.monotonic()
    with pytest.raises(Unreachable) as info:
        HTTPClient(timeout_s=1, retries=1, backoff_s=0).request("GET", server.url + "/slow")
    assert str(info.value) == f"GET {server.url}/slow failed after 2 attempt(s): timed out after 1 s"
    assert info.value.timed_out and info.value.attempts == 2
    assert time.monotonic() - started < 3.5


def test_headers_that_never_come_time_out_too():
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(Unreachable, match="timed out after 0.5 s"):
            HTTPClient(timeout_s=0.5).request("GET", url)
        assert time.monotonic() - started < 2


def test_retriable_failures_are_retried_and_others_are_not(serve):
    calls = []

    def flaky(handler):
        calls.append(1)
        (answer(503, b"busy") if len(calls) < 3 else answer(200, b"[1]"))(handler)

    server = serve(flaky)
    assert HTTPClient(timeout_s=5, retries=2, backoff_s=0).request("GET", server.url).json() == [1]
    assert len(calls) == 3
    refused = serve(answer(401, b"who are you"))
    with pytest.raises(StatusError) as info:
        HTTPClient(timeout_s=5, retries=2, backoff_s=0).request("GET", refused.url)
    assert str(info.value) == f"GET {refused.url} answered HTTP 401 Unauthorized: 'who are you'"
    assert info.value.status == 401 and len(refused.requests) == 1


def test_a_refused_connection_names_the_url_after_its_retries():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
        with pytest.raises(Unreachable, match=rf"^GET {url}/h failed after 3 attempt\(s\): ConnectionRefusedError"):
            HTTPClient(timeout_s=2, retries=2, backoff_s=0).request("GET", url + "/h")


def test_an_answer_that_is_not_json_names_the_url(serve):
    server = serve(answer(200, b"<html>"))
    with pytest.raises(BadAnswer, match=f"^GET {server.url} answered a body that is not JSON: '<html>'"):
        HTTPClient(timeout_s=5).request("GET", server.url).json()
    assert isinstance(BadAnswer("GET", "u", "x"), HTTPFailure)


@pytest.mark.parametrize("field", ["timeout_s", "backoff_s", "backoff_max_s"])
@pytest.mark.parametrize("value", [1e30, float("inf"), float("nan"), -1.0])
def test_durations_must_be_finite_and_representable(field, value):
    with pytest.raises(ValueError, match=rf"HTTPClient: {field} must be a finite number of seconds"):
        HTTPClient(**{field: value})
    HTTPClient(**{field: float(MAX_SECONDS)})  # the longest one is fine


def test_a_url_must_be_http():
    with pytest.raises(ValueError, match="'ftp://h/x' is not an http:// or https:// URL"):
        HTTPClient().request("GET", "ftp://h/x")


def test_the_client_is_in_the_plugin_api_reference():
    from grpo_core.docs_gen import api_page

    page = api_page()
    assert "\n## `grpo_core.http`\n" in page
    for name in ("HTTPClient", "HTTPFailure", "Redirected", "TooLarge", "Unreachable", "StatusError", "BadAnswer"):
        assert f"\n### `{name}`" in page, name
