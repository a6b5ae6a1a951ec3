"""The learner's side of one vLLM rollout server (``grpo-run serve``): vLLM's own HTTP
routes, called through the project's one HTTP client (:mod:`grpo_core.http`: no redirects, a
cap on every answer, a deadline per attempt), and the weight channel of
:mod:`grpo_plugins.rollout.channel`. The requests it sends are made by
:func:`grpo_plugins.vllm.io.completion_body`; every answer to one is checked against it
(:func:`to_outputs`) before it reaches a batch.

Routes used (vLLM 0.32): ``/v1/models``; ``/v1/completions`` (OpenAI's, prompts as token ids,
vLLM's sampling extras, ``return_token_ids``); ``/collective_rpc`` (the worker extension's
``grpo_server_info``); ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/weight_info`` (vLLM's weight-transfer API);
``/reset_prefix_cache``; a push is one start, one ``/update_weights`` per bucket (its
tensors broadcast over the weight channel meanwhile) and one finish; for adapter-only LoRA
pushes, ``/collective_rpc`` (the worker extension's ``grpo_receive_adapter``, once per bucket,
fed over the weight channel), ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's runtime LoRA routes). With a shared secret every request
carries ``Authorization: Bearer <secret>`` (what ``grpo-run serve``'s guard and vLLM's own
``--api-key`` check). Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import threading
import time
from typing import Any

from grpo_plugins.rollout.channel import delta_info, local_address, open_group, send_deltas, send_tensors, update_info
from grpo_plugins.rollout.outputs import Completion, Output
from grpo_plugins.rollout.servers import ServerFault
from torch import Tensor

from grpo_core.http import BadAnswer, HTTPClient, HTTPFailure, StatusError, TooLarge

__all__ = ["Completion", "Expected", "InvalidAnswer", "ServerClient", "ServerFault", "local_address", "to_outputs"]

#: The longest answer read from a route other than ``/v1/completions`` (model list, worker
#: info, weight version): they are a few hundred bytes.
SMALL_ANSWER_BYTES = 1 << 20
#: What a ``/v1/completions`` answer may hold per token of each completion (its id, log-prob,
#: text and vLLM's extras, generously), on top of :data:`SMALL_ANSWER_BYTES`.
BYTES_PER_TOKEN = 512


class InvalidAnswer(ValueError):
    """What is wrong with an answer to ``/v1/completions`` (the caller names the server)."""


@dataclasses.dataclass(frozen=True)
class Expected:
    """What an answer to one ``/v1/completions`` request must be: ``n`` completions, each of
    at most ``max_tokens`` token ids in ``0 .. vocab_size - 1``, with one finite log-prob
    ``<= 0`` per token; the prompt had ``prompt_tokens`` tokens (vLLM may echo them)."""

    n: int
    max_tokens: int
    vocab_size: int
    prompt_tokens: int = 0

    @property
    def max_bytes(self) -> int:
        """The longest answer read: :data:`SMALL_ANSWER_BYTES` plus :data:`BYTES_PER_TOKEN`
        per token the answer may hold (prompt and completion, each of ``n``)."""
        return SMALL_ANSWER_BYTES + self.n * (self.prompt_tokens + self.max_tokens) * BYTES_PER_TOKEN


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_completion(k: int, choice: Any, expected: Expected) -> Completion:
    """Completion ``k`` of an answer, checked against ``expected``; an :class:`InvalidAnswer` if not."""
    if not isinstance(choice, dict):
        raise InvalidAnswer(f"completion {k} is {type(choice).__name__}, not an object")
    ids = choice.get("token_ids")
    if ids is None:
        raise InvalidAnswer(f"completion {k} has no token_ids (a vLLM older than 0.10.2?)")
    if not _ints(ids):
        raise InvalidAnswer(f"completion {k}: token_ids is not a list of integers: {str(ids)[:80]}")
    if len(ids) > expected.max_tokens:
        raise InvalidAnswer(f"completion {k} has {len(ids)} tokens, more than the {expected.max_tokens} asked for")
    outside = [(t, i) for t, i in enumerate(ids) if not 0 <= i < expected.vocab_size]
    if outside:
        t, i = outside[0]
        raise InvalidAnswer(f"completion {k} has token id {i} at position {t}, outside the policy's vocabulary "
                            f"(0 .. {expected.vocab_size - 1}); is the server serving another model?")
    logprobs = choice.get("logprobs")
    logps = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(logps, list):
        raise InvalidAnswer(f"completion {k} has no token_logprobs (the request asked for each token's log-prob)")
    if len(logps) != len(ids):
        raise InvalidAnswer(f"completion {k} has {len(logps)} log-probs for {len(ids)} tokens")
    for t, value in enumerate(logps):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value > 0:
            raise InvalidAnswer(f"completion {k} has log-prob {value!r} at position {t}; a log-prob is a finite "
                                "number <= 0")
    text, finish = choice.get("text"), choice.get("finish_reason")
    if not isinstance(text, (str, type(None))) or not isinstance(finish, (str, type(None))):
        raise InvalidAnswer(f"completion {k}: text and finish_reason must be strings or null")
    return Completion(choice.get("index"), list(ids), finish, text or "",
                      [{i: float(v)} for i, v in zip(ids, logps, strict=True)])


def to_outputs(answer: Any, expected: Expected) -> Output:
    """A ``/v1/completions`` answer as one prompt's output for ``outputs_to_batch``, after
    checking it against the request (:class:`Expected`): the number of completions, their
    indices ``0 .. n - 1`` once each, token ids within the vocabulary and no more than asked,
    one finite log-prob ``<= 0`` per token. An :class:`InvalidAnswer` says what is wrong."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        raise InvalidAnswer(f"the answer has no list of choices: {str(answer)[:120]}")
    if len(choices) != expected.n:
        raise InvalidAnswer(f"{len(choices)} completion(s) for a request of n={expected.n}")
    completions = [_check_completion(k, choice, expected) for k, choice in enumerate(choices)]
    indices = sorted(c.index for c in completions if isinstance(c.index, int) and not isinstance(c.index, bool))
    if indices != list(range(expected.n)):
        raise InvalidAnswer(f"completion indices {[c.index for c in completions]}; expected 0 .. {expected.n - 1} "
                            "once each")
    return Output(completions)


class ServerClient:
    """One rollout server at ``url``: every request bounded by ``timeout_s`` in all (a deadline
    per attempt) and retried ``retries`` times (``backoff_s`` apart, doubling) after a
    connection error, a timeout or a server error (5xx), then a :class:`ServerFault`. With
    ``secret``, every request sends it as ``Authorization: Bearer <secret>``;
    ``secret_env`` names where it came from, for the messages."""

    def __init__(self, url: str, timeout_s: float, retries: int, backoff_s: float = 0.5, *,
                 secret: str | None = None, secret_env: str = "GRPO_SERVE_SECRET"):
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.secret_env, self.sends_secret = secret_env, bool(secret)
        headers = {"Accept": "application/json"}
        if secret:
            headers["Authorization"] = f"Bearer {secret}"
        self.http = HTTPClient(timeout_s=timeout_s, max_bytes=SMALL_ANSWER_BYTES, retries=retries,
                               backoff_s=backoff_s, backoff_max_s=max(backoff_s, 8.0), headers=headers)
        self.group: Any = None
        self.model = ""
        self.dtype = "float32"
        self.workers = 1
        self.lora: dict[str, Any] | None = None  # the server's LoRA settings (grpo_server_info)

    # ------------------------------------------------------------------ HTTP
    def call(self, method: str, path: str, body: Any = None, *, retries: int | None = None,
             timeout_s: float | None = None, text: bool = False) -> Any:
        """The JSON answer of ``method path`` (None when empty; ``text``: the body as text, for
        vLLM's LoRA routes, which answer a sentence); retried on a refused or timed-out
        connection and on a server error (5xx), not on a refused request (4xx) nor a redirect
        (an error: it is not followed). One connection per call: calls come from several
        threads at once."""
        try:
            answer = self.http.request(method, self.url + path, json=body, retries=retries, timeout_s=timeout_s)
            return answer.body.decode("utf-8", "replace") if text else answer.json()
        except HTTPFailure as exc:
            raise ServerFault(self._explain(exc)) from None

    def complete(self, body: dict[str, Any], expected: Expected) -> Output:
        """The answer to one ``/v1/completions`` request, checked against ``expected``
        (:func:`to_outputs`). An answer that fails the check, is not JSON or exceeds
        :attr:`Expected.max_bytes` is the server's fault like a failed connection: retried,
        then a :class:`ServerFault` saying what was wrong."""
        url, wait = self.url + "/v1/completions", self.backoff_s
        for attempt in range(1, self.retries + 2):
            try:
                answer = self.http.attempt("POST", url, json=body, max_bytes=expected.max_bytes)
                try:
                    return to_outputs(answer.json(), expected)
                except InvalidAnswer as exc:
                    raise BadAnswer("POST", url, f"gave an answer the request cannot have produced: {exc}") from None
            except HTTPFailure as exc:
                exc.attempts = attempt
                if not (exc.retriable or isinstance(exc, (BadAnswer, TooLarge))) or attempt > self.retries:
                    raise ServerFault(self._explain(exc)) from None
            time.sleep(min(wait, 8.0))
            wait *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _explain(self, exc: HTTPFailure) -> str:
        """``exc``'s message (method, URL, attempts, what failed), plus what to do about a
        refused credential."""
        text = str(exc)
        if exc.attempts > 1 and not exc.retriable:
            text = f"{exc.method} {exc.url} failed after {exc.attempts} attempt(s): {exc.reason}"
        if isinstance(exc, StatusError) and exc.status in (401, 403):
            if self.sends_secret:
                text += f"; the secret in {self.secret_env} is not the one this server was started with"
            else:
                text += (f"; the server wants a shared secret: set {self.secret_env} in the learner's environment "
                         "to the value grpo-run serve was started with (its GRPO_SERVE_SECRET or --api-key)")
        return text

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
            self.lora = infos[0].get("lora")
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ServerFault(f"{self.url} gave an answer grpo-run serve does not give ({exc!r})") from exc
        if engines != ["TorchWeightTransferEngine"] * len(engines):
            raise ServerFault(
                f"{self.url} is not a grpo-run serve server (its workers' weight transfer engine: {engines}); "
                "start it with grpo-run serve"
            )
        self.dtype, self.workers = dtype, len(engines)

    # ------------------------------------------------------------------ weights
    def open_channel(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        """Make the weight channel: the server's workers join this process's group, whose keys
        carry a random token that only the server (told through its guarded route) knows."""
        token = secrets.token_hex(16)
        info = {"host": host, "port": port, "world_size": 1 + self.workers, "backend": backend,
                "timeout_s": timeout_s, "token": token}
        joined = self._background("POST", "/init_weight_transfer_engine", {"init_info": info}, timeout_s)
        try:
            self.group = open_group(host, port, 0, 1 + self.workers, backend, timeout_s, token)
        except Exception as exc:
            raise ServerFault(f"{self.url}: its workers did not join the weight channel at {host}:{port}: {exc}") \
                from exc
        joined.result()

    def start_push(self) -> None:
        """Begin a push (vLLM's ``/start_weight_update``: the workers' layerwise reload): its
        buckets follow (:meth:`push_bucket`, :meth:`push_delta_bucket`), then :meth:`finish_push`."""
        self.call("POST", "/start_weight_update", retries=0)

    def push_bucket(self, weights: list[tuple[str, Tensor]], timeout_s: float) -> None:
        """One bucket of a push: its payload to ``/update_weights`` while its tensors are
        broadcast over the channel; the workers load each as it arrives."""
        received = self._background("POST", "/update_weights", {"update_info": update_info(weights)}, timeout_s)
        try:
            send_tensors(self.group, (t for _, t in weights))
        except Exception as exc:
            raise ServerFault(f"{self.url}: the weight channel broke during a push: {exc}") from exc
        received.result()

    def push_delta_bucket(self, deltas: list, timeout_s: float) -> None:
        """One bucket of a delta push (:mod:`grpo_plugins.rollout.delta`): only the changed
        elements of each tensor (or the whole tensor) are broadcast, and the server's workers
        rebuild each tensor from their copy and check its checksum."""
        received = self._background("POST", "/update_weights", {"update_info": delta_info(deltas)}, timeout_s)
        try:
            send_deltas(self.group, deltas)
        except Exception as exc:
            raise ServerFault(f"{self.url}: the weight channel broke during a push: {exc}") from exc
        received.result()

    def finish_push(self, version: str) -> None:
        """End a push as weight version ``version`` (``/finish_weight_update``), then reset the
        prefix cache computed with the old weights."""
        self.call("POST", "/finish_weight_update", {"weight_version": version}, retries=0)
        self.call("POST", "/reset_prefix_cache")

    def push(self, weights: list[tuple[str, Tensor]], version: str, timeout_s: float) -> None:
        """A push of ``weights`` in one bucket: start, send every tensor while the server
        receives, finish (weight version ``version``)."""
        self.start_push()
        self.push_bucket(weights, timeout_s)
        self.finish_push(version)

    def push_deltas(self, deltas: list, version: str, timeout_s: float) -> None:
        """:meth:`push` of a delta push in one bucket."""
        self.start_push()
        self.push_delta_bucket(deltas, timeout_s)
        self.finish_push(version)

    def push_adapter_part(self, tensors: list[tuple[str, Tensor]], config: dict[str, Any], version: int,
                          drop: dict[int, str], last: bool, timeout_s: float) -> str | None:
        """One bucket of an adapter-only push: the server's workers receive ``tensors`` (peft's
        names) over the channel and hold them; with ``last`` they write every part with
        ``config`` as adapter version ``version`` and remove the folders of the versions in
        ``drop``. The folder written (None before the last part)."""
        info = {**update_info(tensors), "version": version, "config": config, "drop": sorted(drop), "last": last}
        body = {"method": "grpo_receive_adapter", "args": [json.dumps(info)], "timeout": timeout_s}
        received = self._background("POST", "/collective_rpc", body, timeout_s)
        try:
            send_tensors(self.group, (t for _, t in tensors))
        except Exception as exc:
            raise ServerFault(f"{self.url}: the weight channel broke during an adapter push: {exc}") from exc
        answer = received.result()
        if not last:
            return None
        try:
            folder = answer["results"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerFault(f"{self.url} answered grpo_receive_adapter with {str(answer)[:200]!r}") from exc
        if not isinstance(folder, str):
            raise ServerFault(f"{self.url} answered the last part of an adapter push with {str(folder)[:200]!r}, "
                              "not a folder")
        return folder

    def load_adapter(self, name: str, folder: str, drop: dict[int, str]) -> None:
        """Load the adapter written in ``folder`` as the LoRA adapter ``name`` (vLLM's
        ``/v1/load_lora_adapter``), then unload the versions in ``drop`` (version: name)."""
        self.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder}, retries=0, text=True)
        for old in drop.values():
            self.unload_adapter(old)

    def push_adapter(self, name: str, tensors: list[tuple[str, Tensor]], config: dict[str, Any], version: int,
                     drop: dict[int, str], timeout_s: float) -> None:
        """An adapter-only push in one part: ``tensors`` written as version ``version``, loaded
        as the LoRA adapter ``name``, the versions in ``drop`` unloaded and removed."""
        folder = self.push_adapter_part(tensors, config, version, drop, True, timeout_s)
        self.load_adapter(name, folder, drop)

    def unload_adapter(self, name: str) -> None:
        """Unload the LoRA adapter ``name`` (vLLM's ``/v1/unload_lora_adapter``)."""
        self.call("POST", "/v1/unload_lora_adapter", {"lora_name": name}, retries=0, text=True)

    def adapters(self) -> list[str]:
        """The names of the LoRA adapters the server has loaded (``/v1/models``'s entries
        whose ``parent`` is the base model)."""
        models = self.call("GET", "/v1/models") or {}
        return [m.get("id") for m in models.get("data", []) if isinstance(m, dict) and m.get("parent")]

    def wait_for_adapter(self, name: str, timeout_s: float, poll_s: float = 0.05) -> None:
        """Wait until the server lists the adapter ``name``: another process's push loaded it."""
        deadline = time.monotonic() + timeout_s
        while name not in self.adapters():
            if time.monotonic() > deadline:
                raise ServerFault(f"{self.url} has not loaded the adapter {name!r} after {timeout_s:g} s")
            time.sleep(poll_s)

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
