"""The ``remote`` reward: scores from an HTTP endpoint (a reward-model or sandbox server).

Wire format, one request per batch of completions (``batch_size`` of them at most)::

    POST <url>
    Content-Type: application/json
    {"prompts": [...], "completions": [...], "columns": {"answer": [...], ...}}

    200 OK
    {"rewards": [0.0, 1.0, null, ...]}

``prompts`` and ``completions`` have one entry per completion, as a reward function gets
them (strings, or lists of chat messages for conversational data); ``columns`` holds the
dataset columns named in ``columns`` (default: every column of the batch), one entry per
completion; ``completion_ids`` (token id lists) is added when ``send_completion_ids`` is
on. The answer's ``rewards`` has one number, or ``null`` (unscorable), per completion, in
order. Other keys of the answer are ignored.

Failures: a connection error, a timeout, or an answer with status 408, 429 or 5xx is
retried ``retries`` times, waiting ``backoff`` seconds, then twice that, and so on (at most
``backoff_max``); any other 4xx, or an answer that is not the JSON above, is not retried.
``timeout`` is a deadline for a whole attempt (connect, send, read every byte of the
answer), not for each socket read. Redirects (3xx) are not followed: they are an error,
so the request and its headers never go to a host other than ``url``'s. An answer longer
than ``max_response_bytes`` is an error. Reward values follow the engine's one rule
(:func:`grpo_core.contracts.reward_value`): a finite number (``true``/``false`` count
as 1 and 0) or ``null``. Connections go straight to ``url``'s host (proxy environment
variables are not used).
Every failure ends as a :class:`~grpo_core.errors.RunError` for the whole batch, naming the
URL: with ``train.reward_errors: raise`` the run stops there (checkpointing the last
completed step), with ``none`` the batch is scored None and counted.

Secrets never go in the spec: ``headers_from_env`` names, per header, the environment
variable holding its value (e.g. ``{Authorization: RM_AUTH}`` with
``RM_AUTH="Bearer ..."`` exported).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from typing import Any

from pydantic import Field, field_validator

from grpo_core import hookimpl
from grpo_core.contracts import reward_value
from grpo_core.errors import RunError
from grpo_core.options import Options

__all__ = ["RemoteOptions", "RemoteReward"]

RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CHUNK = 1 << 16


class RemoteOptions(Options):
    """Options of the ``remote`` reward."""

    url: str = Field(description="Endpoint that scores completions: an http:// or https:// URL.")
    timeout: float = Field(
        30.0, gt=0, description="Seconds one HTTP request may take in all (connect, send, and reading the whole "
        "answer), a deadline per attempt: retries get their own."
    )
    retries: int = Field(
        3, ge=0, description="Further attempts after a connection error, a timeout, or status "
        "408, 429 or 5xx."
    )
    backoff: float = Field(0.5, ge=0, description="Seconds before the first retry; doubled at each next one.")
    backoff_max: float = Field(8.0, ge=0, description="Longest wait between two attempts, in seconds.")
    batch_size: int | None = Field(
        None, ge=1, description="Completions per request; default: the whole batch in one request "
        "(the slot's `concurrency` sends chunks of the batch in parallel)."
    )
    headers: dict[str, str] = Field(
        default_factory=dict, description="HTTP headers sent as they are (no secrets: see headers_from_env)."
    )
    headers_from_env: dict[str, str] = Field(
        default_factory=dict, description="HTTP header name -> name of the environment variable "
        "holding its value, e.g. {Authorization: RM_AUTH}; a variable that is not set is an error."
    )
    columns: list[str] | None = Field(
        None, description="Dataset columns sent under `columns`; default: every column of the batch."
    )
    send_completion_ids: bool = Field(False, description="Also send each completion's token ids as `completion_ids`.")
    max_response_bytes: int = Field(
        8 << 20, ge=1, description="Longest answer read, in bytes (default 8 MiB); a longer one is an error "
        "naming the function, so that a server streaming without end cannot grow the trainer's memory."
    )

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {v!r}")
        return v


def _jsonable(value: Any) -> Any:
    """numpy/torch scalars and arrays as plain lists and numbers."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class _Retriable(Exception):
    """A failure worth another attempt: a connection error, a timeout, status 408/429/5xx."""


class _Watchdog:
    """Shuts a socket when the request's deadline passes, from a timer thread: a blocked
    read then returns at once (a per-read timeout alone lets a server that drips one byte
    at a time hold the call for ever)."""

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


class RemoteReward:
    """POSTs each batch to ``options.url`` and returns the ``rewards`` of the answer."""

    def __init__(self, options: RemoteOptions):
        self.options = options
        self.__name__ = "remote"
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **options.headers}
        for header, var in options.headers_from_env.items():
            if var not in os.environ:
                raise RunError(
                    f"reward function 'remote' ({options.url}): header '{header}' takes its value from "
                    f"the environment variable {var}, which is not set"
                )
            self.headers[header] = os.environ[var]

    def __repr__(self) -> str:
        return f"remote(url={self.options.url!r})"

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float | None]:
        size = self.options.batch_size or max(1, len(completions))
        ids = columns.pop("completion_ids", None)
        out: list[float | None] = []
        for start in range(0, len(completions), size):
            stop = min(start + size, len(completions))
            body = self._body(prompts[start:stop], completions[start:stop], columns, ids, start, stop)
            out.extend(self._rewards(self._post(body), stop - start))
        return out

    def _body(self, prompts: list, completions: list, columns: dict[str, Any], ids: list | None,
              start: int, stop: int) -> bytes:
        names = self.options.columns if self.options.columns is not None else sorted(columns)
        missing = [n for n in names if n not in columns]
        if missing:
            raise RunError(
                f"reward function 'remote' ({self.options.url}): columns {missing} are not in the batch; "
                f"columns available: {', '.join(sorted(columns)) or '(none)'}"
            )
        payload: dict[str, Any] = {
            "prompts": prompts, "completions": completions,
            "columns": {n: list(columns[n])[start:stop] for n in names},
        }
        if self.options.send_completion_ids and ids is not None:
            payload["completion_ids"] = [list(map(int, row)) for row in ids[start:stop]]
        try:
            return json.dumps(payload, default=_jsonable).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise RunError(
                f"reward function 'remote' ({self.options.url}): the request cannot be sent as JSON: {exc}; "
                "leave such columns out with the `columns` option"
            ) from None

    def _post(self, body: bytes) -> bytes:
        """The answer's body, after retries; a RunError naming the URL when none succeeded."""
        opts, attempt, wait = self.options, 0, self.options.backoff
        while True:
            try:
                return self._attempt(body)
            except _Retriable as exc:
                detail = str(exc)
            if attempt >= opts.retries:
                raise RunError(
                    f"reward function 'remote': POST {opts.url} failed after {attempt + 1} attempt(s): {detail}"
                )
            time.sleep(min(wait, opts.backoff_max))
            attempt, wait = attempt + 1, wait * 2

    def _attempt(self, body: bytes) -> bytes:
        """One POST within ``timeout`` seconds in all (connect, send, every read): at the
        deadline a watchdog shuts the socket, which ends any read. Redirects are answers
        like any other status (not followed); the body is read up to ``max_response_bytes``."""
        opts = self.options
        deadline = time.monotonic() + opts.timeout
        parts = urllib.parse.urlsplit(opts.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.hostname, parts.port, timeout=opts.timeout)
        watchdog = _Watchdog()
        try:
            conn.connect()
            watchdog.arm(conn.sock, deadline - time.monotonic())
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("POST", target, body=body, headers=self.headers)
            answer = conn.getresponse()
            data = self._read(answer, opts.max_response_bytes)
        except (OSError, http.client.HTTPException) as exc:
            if watchdog.fired or isinstance(exc, (TimeoutError, socket.timeout)):
                raise _Retriable(f"timed out after {opts.timeout:g} s") from None
            raise _Retriable(str(exc) or type(exc).__name__) from None
        finally:
            watchdog.cancel()
            conn.close()
        if watchdog.fired:  # a body read until the socket closed may be cut short
            raise _Retriable(f"timed out after {opts.timeout:g} s")
        return self._checked_status(answer, data)

    def _read(self, answer: http.client.HTTPResponse, limit: int) -> bytes:
        """The body, refused (a RunError naming the function) beyond ``limit`` bytes."""
        declared = answer.getheader("Content-Length")
        chunks, size = [], 0
        if declared is not None and declared.isdigit() and int(declared) > limit:
            size = int(declared)
        while size <= limit:
            chunk = answer.read(min(_CHUNK, limit + 1 - size))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise RunError(
            f"reward function 'remote': the answer of {self.options.url} is longer than max_response_bytes "
            f"({limit} bytes); the server must answer one number per completion, or raise max_response_bytes"
        )

    def _checked_status(self, answer: http.client.HTTPResponse, data: bytes) -> bytes:
        """``data`` of a 2xx answer; 408, 429 and 5xx are retried, anything else (a redirect
        included: its headers would go to another host) is a RunError."""
        opts = self.options
        if 200 <= answer.status < 300:
            return data
        detail = f"HTTP {answer.status} {answer.reason}: {data[:200].decode('utf-8', 'replace')!r}"
        if answer.status in RETRIED_STATUS:
            raise _Retriable(detail)
        if 300 <= answer.status < 400:
            raise RunError(
                f"reward function 'remote': POST {opts.url} answered HTTP {answer.status} {answer.reason}, a "
                f"redirect to {answer.getheader('Location')!r}; redirects are not followed (the request and its "
                "headers go only to the url of the spec): set url to the address that answers"
            )
        raise RunError(f"reward function 'remote': POST {opts.url} answered {detail}")

    def _rewards(self, raw: bytes, size: int) -> list[float | None]:
        """The ``rewards`` list of an answer, checked: ``size`` numbers or nulls."""
        where = f"reward function 'remote': the answer of {self.options.url}"
        try:
            answer = json.loads(raw)
        except ValueError:
            raise RunError(f"{where} is not JSON: {raw[:200].decode('utf-8', 'replace')!r}; "
                           'expected {"rewards": [...]}') from None
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list) or len(rewards) != size:
            got = f"a list of {len(rewards)}" if isinstance(rewards, list) else repr(answer)[:200]
            raise RunError(f'{where} has no "rewards" list of {size} entries (one per completion); got {got}')
        out = []
        for i, value in enumerate(rewards):
            try:  # the engine's one rule for reward values
                out.append(reward_value(value))
            except ValueError:
                raise RunError(f"{where}: reward {i} is {value!r}; expected a finite number or null") from None
        return out


@hookimpl
def register_reward_functions(register) -> None:
    register.add("remote", RemoteReward, options=RemoteOptions)
