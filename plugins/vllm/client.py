"""The learner's side of one vLLM rollout server (``grpo-run serve``): vLLM's own HTTP
routes, called with the standard library's ``urllib``, and the weight channel of
:mod:`grpo_plugins.vllm.channel`. The requests it sends are made by
:func:`grpo_plugins.vllm.io.completion_body`.

Routes used (vLLM 0.32): ``/v1/models``; ``/v1/completions`` (OpenAI's, prompts as token ids,
vLLM's sampling extras, ``return_token_ids``); ``/collective_rpc`` (the worker extension's
``grpo_server_info``); ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/weight_info`` (vLLM's weight-transfer API);
``/reset_prefix_cache``. Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from grpo_plugins.vllm.channel import local_address, open_group, send_tensors, update_info
from torch import Tensor

__all__ = ["Completion", "ServerClient", "ServerFault", "local_address", "to_outputs"]


class ServerFault(Exception):
    """A server did not answer (refused, timed out, an HTTP error, a broken weight channel)."""


@dataclasses.dataclass
class Completion:
    """One completion of a server's answer, with the attributes
    :func:`~grpo_plugins.vllm.io.outputs_to_batch` reads from vLLM's own outputs."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str
    logprobs: list[dict[int, float]] | None


@dataclasses.dataclass
class Output:
    outputs: list[Completion]


def to_outputs(answer: dict[str, Any], where: str) -> Output:
    """A ``/v1/completions`` answer as one prompt's output for ``outputs_to_batch``."""
    completions = []
    for choice in answer.get("choices") or []:
        ids = choice.get("token_ids")
        if ids is None:
            raise ServerFault(f"{where}: the answer has no token_ids (a vLLM older than 0.10.2?)")
        logps = (choice.get("logprobs") or {}).get("token_logprobs")
        entries = None if logps is None else [{int(t): float(v)} for t, v in zip(ids, logps, strict=True)]
        completions.append(
            Completion(int(choice.get("index", 0)), [int(t) for t in ids], choice.get("finish_reason"),
                       choice.get("text") or "", entries)
        )
    return Output(completions)


class ServerClient:
    """One rollout server at ``url``: requests bounded by ``timeout_s``, retried
    ``retries`` times (``backoff_s`` apart, doubling) before a :class:`ServerFault`."""

    def __init__(self, url: str, timeout_s: float, retries: int, backoff_s: float = 0.5):
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.group: Any = None
        self.model = ""
        self.dtype = "float32"
        self.workers = 1

    # ------------------------------------------------------------------ HTTP
    def call(self, method: str, path: str, body: Any = None, *, retries: int | None = None,
             timeout_s: float | None = None) -> Any:
        """The JSON answer of ``method path``; retried on a refused or timed-out connection
        and on a server error (5xx), not on a refused request (4xx). One connection per call
        (the standard library's ``urllib``): calls come from several threads at once."""
        tries = 1 + (self.retries if retries is None else retries)
        delay, last = self.backoff_s, ""
        for attempt in range(tries):
            try:
                return _request(method, self.url + path, body, timeout_s or self.timeout_s)
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
                if exc.code < 500:
                    break  # the request is wrong: retrying cannot help
            except (OSError, ValueError) as exc:  # refused, reset, timed out; an answer that is not JSON
                cause = exc.reason if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, Exception) \
                    else exc
                last = f"{type(cause).__name__}: {cause}"
            if attempt + 1 < tries:
                time.sleep(delay)
                delay *= 2
        raise ServerFault(f"{method} {self.url}{path} failed after {tries} attempt(s): {last}")

    def connect(self) -> None:
        """Check the server is up and ``grpo-run serve``'s; learn its model name, dtype and
        worker count."""
        models = self.call("GET", "/v1/models")
        try:
            infos = self.call("POST", "/collective_rpc", {"method": "grpo_server_info"}, retries=0)
        except ServerFault as exc:
            raise ServerFault(f"{exc} (is it a grpo-run serve server? a plain vllm serve has no weight channel)") \
                from exc
        try:
            self.model = models["data"][0]["id"]
            infos = infos.get("results", infos) if isinstance(infos, dict) else infos
            engines = [i.get("engine") for i in infos]
            dtype = infos[0]["dtype"]
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ServerFault(f"{self.url} gave an answer grpo-run serve does not give ({exc!r})") from exc
        if engines != ["TorchWeightTransferEngine"] * len(engines):
            raise ServerFault(
                f"{self.url} is not a grpo-run serve server (its workers' weight transfer engine: {engines}); "
                "start it with grpo-run serve"
            )
        self.dtype, self.workers = dtype, len(engines)

    def complete(self, body: dict[str, Any]) -> Output:
        return to_outputs(self.call("POST", "/v1/completions", body), self.url)

    # ------------------------------------------------------------------ weights
    def open_channel(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        """Make the weight channel: the server's workers join this process's group."""
        info = {"host": host, "port": port, "world_size": 1 + self.workers, "backend": backend,
                "timeout_s": timeout_s}
        joined = self._background("POST", "/init_weight_transfer_engine", {"init_info": info}, timeout_s)
        try:
            self.group = open_group(host, port, 0, 1 + self.workers, backend, timeout_s)
        except Exception as exc:
            raise ServerFault(f"{self.url}: its workers did not join the weight channel at {host}:{port}: {exc}") \
                from exc
        joined.result()

    def push(self, weights: list[tuple[str, Tensor]], version: str, timeout_s: float) -> None:
        """One push: start, send every tensor while the server receives, finish (weight
        version ``version``), then reset the prefix cache computed with the old weights."""
        self.call("POST", "/start_weight_update", retries=0)
        received = self._background("POST", "/update_weights", {"update_info": update_info(weights)}, timeout_s)
        try:
            send_tensors(self.group, (t for _, t in weights))
        except Exception as exc:
            raise ServerFault(f"{self.url}: the weight channel broke during a push: {exc}") from exc
        received.result()
        self.call("POST", "/finish_weight_update", {"weight_version": version}, retries=0)
        self.call("POST", "/reset_prefix_cache")

    def wait_for_version(self, version: str, timeout_s: float, poll_s: float = 0.05) -> None:
        """Wait until the server's weight version (vLLM's ``/weight_info``) is ``version``:
        another process's push has reached it."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = (self.call("GET", "/weight_info") or {}).get("weight_version")
            if seen == version:
                return
            if time.monotonic() > deadline:
                raise ServerFault(
                    f"{self.url} still holds weight version {seen!r}, not {version!r}, after {timeout_s:g} s"
                )
            time.sleep(poll_s)

    def _background(self, method: str, path: str, body: Any, timeout_s: float) -> _Pending:
        """Send a request that returns only once the collective it starts is over, on a
        daemon thread (a hung server cannot keep the learner from exiting)."""
        pending = _Pending(self.url + path)

        def run() -> None:
            try:
                pending.value = self.call(method, path, body, retries=0, timeout_s=timeout_s)
            except BaseException as exc:  # handed to the caller by result()
                pending.error = exc
            pending.done.set()

        threading.Thread(target=run, name=f"grpo-server{path}", daemon=True).start()
        pending.timeout_s = timeout_s
        return pending


def _request(method: str, url: str, body: Any, timeout_s: float) -> Any:
    """One HTTP request with a JSON body (or none); its JSON answer, or None when empty."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        content = answer.read()
    return json.loads(content) if content else None


class _Pending:
    def __init__(self, what: str):
        self.what, self.value, self.error = what, None, None
        self.done, self.timeout_s = threading.Event(), 0.0

    def result(self) -> Any:
        if not self.done.wait(self.timeout_s + 5):
            raise ServerFault(f"{self.what} did not answer within {self.timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return self.value
