"""One HTTP client for every outbound call the project makes: the ``remote`` reward, the rollout
servers of the ``vllm-server`` backend, and a plugin's own calls (a judge, an agent's endpoint).

What every call gets, whoever makes it:

- **no redirects**: a 3xx answer is a :class:`Redirected` failure naming the URL and the
  ``Location`` header, so a request and its headers (a secret among them) go only to the URL
  given, and a POST never silently turns into another server's GET;
- **a cap on the body**: an answer whose ``Content-Length`` is above ``max_bytes`` is refused
  before its body is read, and a longer stream is cut after ``max_bytes + 1`` bytes
  (:class:`TooLarge`), so a server cannot grow the trainer's memory;
- **a deadline per attempt**: ``timeout_s`` covers connecting, sending, the headers and every
  byte of the body. At the deadline the socket is shut from a timer thread, which ends any
  read at once: a server that drips one byte at a time cannot stretch it (a per-read timeout,
  what ``urllib`` and ``http.client`` offer, would let it);
- **finite durations the platform can represent**: a timeout or backoff above
  :data:`grpo_core.options.MAX_SECONDS` is a ``ValueError`` when the client is made;
- **errors that name the URL**: every failure is an :class:`HTTPFailure` whose message starts
  with the method and URL, and says whether another attempt may help
  (:attr:`HTTPFailure.retriable`: a connection error, a timeout, status 408, 429 or 5xx).
  :meth:`HTTPClient.request` makes ``retries`` further attempts after those, ``backoff_s``
  seconds apart, doubling up to ``backoff_max_s``; anything else fails at once.

Connections go straight to the URL's host (proxy environment variables are not used), one
connection per request, so several threads may call one client at once. Name resolution is
the operating system's and is not under the deadline. Plain standard library
(``http.client``). A plugin's call, e.g. a judge reward's:

    from grpo_core.http import HTTPClient, HTTPFailure

    client = HTTPClient(timeout_s=10, max_bytes=1 << 20, retries=2)
    try:
        answer = client.request("POST", url, json={"prompt": "..."}, headers={"Authorization": token})
        scores = answer.json()
    except HTTPFailure as exc:
        raise RunError(f"my judge: {exc}") from None
"""

from __future__ import annotations

import dataclasses
import http.client
import json as jsonlib
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from grpo_core.options import MAX_SECONDS

__all__ = [
    "BadAnswer", "HTTPClient", "HTTPFailure", "Redirected", "Response", "StatusError", "TooLarge",
    "Unreachable",
]

#: Answers worth another attempt: the server is busy, overloaded or failed, not the request.
RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CHUNK = 1 << 16


# --------------------------------------------------------------------------- failures
class HTTPFailure(Exception):
    """A request that did not give a usable answer. ``str()`` starts with the method and URL;
    ``attempts`` is how many were made when :meth:`HTTPClient.request` gave up."""

    #: Whether another attempt may succeed (a connection error, a timeout, 408, 429, 5xx).
    retriable = False

    def __init__(self, method: str, url: str, reason: str):
        super().__init__(reason)
        self.method, self.url, self.reason = method, url, reason
        self.attempts = 1

    def __str__(self) -> str:
        if self.retriable:
            return f"{self.method} {self.url} failed after {self.attempts} attempt(s): {self.reason}"
        return f"{self.method} {self.url} {self.reason}"


class Unreachable(HTTPFailure):
    """No answer: the connection was refused, reset or broken, or the deadline passed
    (``timed_out``)."""

    retriable = True

    def __init__(self, method: str, url: str, reason: str, *, timed_out: bool = False):
        super().__init__(method, url, reason)
        self.timed_out = timed_out


class StatusError(HTTPFailure):
    """An answer with a status other than 2xx; ``body`` holds its first bytes."""

    def __init__(self, method: str, url: str, status: int, phrase: str, body: bytes):
        self.status, self.phrase, self.body = status, phrase, body
        excerpt = body[:200].decode("utf-8", "replace")
        text = f"HTTP {status} {phrase}: {excerpt!r}"
        super().__init__(method, url, text if self.retriable else f"answered {text}")

    @property
    def retriable(self) -> bool:  # type: ignore[override]
        return self.status in RETRIED_STATUS


class Redirected(StatusError):
    """A 3xx answer: not followed (its ``Location`` is another address, maybe another host)."""

    def __init__(self, method: str, url: str, status: int, phrase: str, location: str | None):
        super().__init__(method, url, status, phrase, b"")
        self.location = location
        self.reason = (
            f"answered HTTP {status} {phrase}, a redirect to {location!r}; redirects are not followed "
            "(a request and its headers go only to the URL given): use the address that answers"
        )


class TooLarge(HTTPFailure):
    """An answer longer than the cap (declared by ``Content-Length`` or streamed)."""

    def __init__(self, method: str, url: str, limit: int, declared: int | None = None):
        self.limit, self.declared = limit, declared
        size = f"of {declared} bytes (Content-Length)" if declared is not None else f"of more than {limit} bytes"
        super().__init__(method, url, f"answered a body {size}; at most {limit} bytes are read")


class BadAnswer(HTTPFailure):
    """A 2xx answer whose content is not what the caller expects (not JSON, a wrong shape).
    Callers raise it for their own checks too: it names the URL like every failure."""


# --------------------------------------------------------------------------- answers
@dataclasses.dataclass(frozen=True)
class Response:
    """A 2xx answer, read whole (within the cap): status, reason phrase, headers (names in lower
    case) and body."""

    method: str
    url: str
    status: int
    phrase: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body parsed as JSON (None for an empty body); a :class:`BadAnswer` otherwise."""
        if not self.body:
            return None
        try:
            return jsonlib.loads(self.body)
        except (ValueError, RecursionError):
            excerpt = self.body[:200].decode("utf-8", "replace")
            raise BadAnswer(self.method, self.url, f"answered a body that is not JSON: {excerpt!r}") from None


# --------------------------------------------------------------------------- the client
def _check_duration(name: str, value: float, positive: bool) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0) or value > MAX_SECONDS:
        bound = "greater than 0" if positive else "at least 0"
        raise ValueError(f"HTTPClient: {name} must be a finite number of seconds, {bound} and at most "
                         f"{MAX_SECONDS} (365 days), got {value!r}")


@dataclasses.dataclass(frozen=True)
class HTTPClient:
    """Requests with the guarantees of the module doc. ``timeout_s``: the deadline of one
    attempt, in seconds; ``max_bytes``: the longest body read; ``retries``: further attempts
    after a retriable failure, ``backoff_s`` apart then doubling, at most ``backoff_max_s``;
    ``headers``: sent with every request (a request's own headers are added to them)."""

    timeout_s: float = 30.0
    max_bytes: int = 8 << 20
    retries: int = 0
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_duration("timeout_s", self.timeout_s, positive=True)
        _check_duration("backoff_s", self.backoff_s, positive=False)
        _check_duration("backoff_max_s", self.backoff_max_s, positive=False)
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"HTTPClient: max_bytes must be a positive integer, got {self.max_bytes!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"HTTPClient: retries must be an integer >= 0, got {self.retries!r}")

    def request(self, method: str, url: str, *, body: bytes | None = None, json: Any = None,
                headers: Mapping[str, str] | None = None, timeout_s: float | None = None,
                max_bytes: int | None = None, retries: int | None = None) -> Response:
        """The 2xx answer of ``method url``, after up to ``retries`` (default: the client's)
        further attempts on a retriable failure; else the last :class:`HTTPFailure`, its
        ``attempts`` set. ``json``: a value (not None) sent as the JSON body (``Content-Type:
        application/json``); ``body``: raw bytes. ``timeout_s`` and ``max_bytes`` override the
        client's for this request."""
        tries = 1 + (self.retries if retries is None else retries)
        wait = self.backoff_s
        for attempt in range(1, tries + 1):
            try:
                return self.attempt(method, url, body=body, json=json, headers=headers, timeout_s=timeout_s,
                                    max_bytes=max_bytes)
            except HTTPFailure as failure:
                failure.attempts = attempt
                if not failure.retriable or attempt == tries:
                    raise
            time.sleep(min(wait, self.backoff_max_s))
            wait *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def attempt(self, method: str, url: str, *, body: bytes | None = None, json: Any = None,
                headers: Mapping[str, str] | None = None, timeout_s: float | None = None,
                max_bytes: int | None = None) -> Response:
        """One attempt of ``method url`` within ``timeout_s`` in all; its 2xx answer or an
        :class:`HTTPFailure`."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        _check_duration("timeout_s", timeout, positive=True)
        limit = self.max_bytes if max_bytes is None else max_bytes
        sent = dict(self.headers)
        if json is not None:
            body = jsonlib.dumps(json, allow_nan=False).encode("utf-8")
            sent.setdefault("Content-Type", "application/json")
        sent.update(headers or {})
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"HTTPClient: {url!r} is not an http:// or https:// URL")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        status, phrase, answer_headers, data = _exchange(method, url, parts, target, body, sent, timeout, limit)
        if 200 <= status < 300:
            return Response(method, url, status, phrase, answer_headers, data)
        if 300 <= status < 400:
            raise Redirected(method, url, status, phrase, answer_headers.get("location"))
        raise StatusError(method, url, status, phrase, data)


class _Watchdog:
    """Shuts a socket when the deadline passes, from a timer thread: a blocked read then
    returns at once."""

    def __init__(self) -> None:
        self.fired = False
        self._timer: threading.Timer | None = None

    def arm(self, sock: socket.socket, seconds: float) -> None:
        self._timer = threading.Timer(max(0.0, seconds), self._fire, args=(sock,))
        self._timer.daemon = True
        self._timer.start()

    def _fire(self, sock: socket.socket) -> None:
        self.fired = True
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _exchange(method: str, url: str, parts: urllib.parse.SplitResult, target: str, body: bytes | None,
              headers: dict[str, str], timeout: float, limit: int) -> tuple[int, str, dict[str, str], bytes]:
    """Connect, send, read the status, headers and body (at most ``limit`` bytes), all
    before ``timeout`` seconds have passed; a :class:`Unreachable` or :class:`TooLarge` if not."""
    deadline = time.monotonic() + timeout
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=timeout)
    watchdog = _Watchdog()
    timed_out = Unreachable(method, url, f"timed out after {timeout:g} s", timed_out=True)
    try:
        conn.connect()
        watchdog.arm(conn.sock, deadline - time.monotonic())
        conn.request(method, target, body=body, headers=headers)
        answer = conn.getresponse()
        data = _read(answer, method, url, limit)
    except (OSError, http.client.HTTPException) as exc:
        if watchdog.fired or isinstance(exc, (TimeoutError, socket.timeout)):
            raise timed_out from None
        raise Unreachable(method, url, f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
    finally:
        watchdog.cancel()
        conn.close()
    if watchdog.fired:  # a body read until the socket closed may be cut short
        raise timed_out
    return answer.status, answer.reason, {k.lower(): v for k, v in answer.getheaders()}, data


def _read(answer: http.client.HTTPResponse, method: str, url: str, limit: int) -> bytes:
    """The body, refused beyond ``limit`` bytes: at once when ``Content-Length`` says so, else
    once ``limit + 1`` bytes have arrived."""
    declared = answer.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise TooLarge(method, url, limit, int(declared))
    chunks, size = [], 0
    while size <= limit:
        chunk = answer.read(min(_CHUNK, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
    raise TooLarge(method, url, limit)
