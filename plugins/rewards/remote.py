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
than ``max_response_bytes`` is an error. (All of this is the project's one HTTP client,
:mod:`grpo_core.http`.) Reward values follow the engine's one rule
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

import json
import os
from typing import Any

from pydantic import Field, field_validator

from grpo_core import hookimpl
from grpo_core.contracts import reward_value
from grpo_core.errors import RunError
from grpo_core.http import HTTPClient, HTTPFailure, TooLarge
from grpo_core.options import Options, Seconds

__all__ = ["RemoteOptions", "RemoteReward"]

class RemoteOptions(Options):
    """Options of the ``remote`` reward."""

    url: str = Field(description="Endpoint that scores completions: an http:// or https:// URL.")
    timeout: Seconds = Field(
        30.0, gt=0, description="Seconds one HTTP request may take in all (connect, send, and reading the whole "
        "answer), a deadline per attempt: retries get their own."
    )
    retries: int = Field(
        3, ge=0, description="Further attempts after a connection error, a timeout, or status "
        "408, 429 or 5xx."
    )
    backoff: Seconds = Field(0.5, ge=0, description="Seconds before the first retry; doubled at each next one.")
    backoff_max: Seconds = Field(8.0, ge=0, description="Longest wait between two attempts, in seconds.")
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


class RemoteReward:
    """POSTs each batch to ``options.url`` and returns the ``rewards`` of the answer."""

    def __init__(self, options: RemoteOptions):
        self.options = options
        self.__name__ = "remote"
        headers = {"Content-Type": "application/json", "Accept": "application/json", **options.headers}
        for header, var in options.headers_from_env.items():
            if var not in os.environ:
                raise RunError(
                    f"reward function 'remote' ({options.url}): header '{header}' takes its value from "
                    f"the environment variable {var}, which is not set"
                )
            headers[header] = os.environ[var]
        self.client = HTTPClient(
            timeout_s=options.timeout, max_bytes=options.max_response_bytes, retries=options.retries,
            backoff_s=options.backoff, backoff_max_s=options.backoff_max, headers=headers,
        )

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
        """The answer's body, after retries; a RunError naming the function and the URL when
        none succeeded (:mod:`grpo_core.http`: no redirects, the cap, the deadline)."""
        try:
            return self.client.request("POST", self.options.url, body=body).body
        except TooLarge:
            raise RunError(
                f"reward function 'remote': the answer of {self.options.url} is longer than max_response_bytes "
                f"({self.options.max_response_bytes} bytes); the server must answer one number per completion, "
                "or raise max_response_bytes"
            ) from None
        except HTTPFailure as exc:
            raise RunError(f"reward function 'remote': {exc}") from None

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
