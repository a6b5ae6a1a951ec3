"""A client for a Sandbox Fusion server (bytedance/SandboxFusion), the second place the
``code_tests`` reward can run code: one ``POST <url>/run_code`` per run, through the
project's one HTTP client (:mod:`grpo_core.http`: no redirects, a body cap, a deadline per
attempt, retries of connection errors, timeouts and 408/429/5xx).

The request (Sandbox Fusion's ``RunCodeRequest``)::

    {"code": "<the entry file>", "language": "python", "run_timeout": <s>, "compile_timeout": <s>,
     "memory_limit_MB": <MiB>, "stdin": "...", "files": {"<name>": "<base64>"}, "fetch_files": []}

and its answer (``RunCodeResponse``)::

    {"status": "Success" | "Failed" | "SandboxError", "message": "...",
     "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code": 0,
                    "stdout": "...", "stderr": "...", ...}, ...}

``Success`` and ``Failed`` are the code's outcome (``Failed``: a non-zero exit or the time
limit); ``SandboxError``, a missing ``run_result`` or a ``run_result`` status ``Error`` is the
server's failure, a :class:`~grpo_core.errors.RunError` naming the URL, as is an answer that
is not this shape. The server's own limits are its business: this client sends the run's
timeout and memory, and reads at most ``output_bytes`` of each stream.
"""

from __future__ import annotations

import base64
import os

from grpo_plugins.rewards.sandbox import Limits, Outcome

from grpo_core.errors import RunError
from grpo_core.http import HTTPClient, HTTPFailure

__all__ = ["FusionClient"]

MAX_ANSWER_BYTES = 8 << 20


class FusionClient:
    """Runs programs on the Sandbox Fusion server at ``url`` (its base URL); ``headers_from_env``
    maps a header to the environment variable holding its value."""

    def __init__(self, url: str, headers_from_env: dict[str, str], limits: Limits, *, retries: int = 2):
        self.url = url.rstrip("/") + "/run_code"
        self.limits = limits
        headers = {"Accept": "application/json"}
        for header, var in headers_from_env.items():
            if var not in os.environ:
                raise RunError(f"reward function 'code_tests' ({self.url}): header '{header}' takes its value from "
                               f"the environment variable {var}, which is not set")
            headers[header] = os.environ[var]
        # The server runs the code within run_timeout; the answer may take a little longer.
        self.client = HTTPClient(timeout_s=limits.wall_s + 30.0, max_bytes=MAX_ANSWER_BYTES, retries=retries,
                                 headers=headers)

    def __repr__(self) -> str:
        return f"FusionClient({self.url!r})"

    def run(self, files: dict[str, str], argv: list[str], stdin: str | None = None) -> Outcome:
        """Run the file ``argv[-1]`` of ``files`` with Python (the rest go along as files)."""
        entry = argv[-1]
        request = {
            "code": files[entry], "language": "python", "run_timeout": self.limits.wall_s, "compile_timeout": 10,
            "memory_limit_MB": self.limits.memory_bytes >> 20, "stdin": stdin or "",
            "files": {name: base64.b64encode(text.encode("utf-8")).decode("ascii")
                      for name, text in files.items() if name != entry},
            "fetch_files": [],
        }
        try:
            answer = self.client.request("POST", self.url, json=request).json()
        except HTTPFailure as exc:
            raise RunError(f"reward function 'code_tests': {exc}") from None
        return self._outcome(answer)

    def _outcome(self, answer: object) -> Outcome:
        where = f"reward function 'code_tests': the answer of {self.url}"
        if not isinstance(answer, dict) or answer.get("status") not in ("Success", "Failed", "SandboxError"):
            raise RunError(f"{where} is not a Sandbox Fusion RunCodeResponse: {str(answer)[:200]!r}")
        run = answer.get("run_result")
        if answer["status"] == "SandboxError" or not isinstance(run, dict) or run.get("status") == "Error":
            message = str(answer.get("message") or (run or {}).get("stderr") or "")[:300]
            raise RunError(f"{where} says the sandbox failed (status {answer['status']}): {message!r}")
        if run.get("status") not in ("Finished", "TimeLimitExceeded"):
            raise RunError(f"{where} has a run_result status {run.get('status')!r}; expected Finished or "
                           "TimeLimitExceeded")
        limit = self.limits.output_bytes
        out = str(run.get("stdout") or "").encode("utf-8", "replace")
        err = str(run.get("stderr") or "").encode("utf-8", "replace")
        code = run.get("return_code")
        exit_code = None if run["status"] == "TimeLimitExceeded" else code if isinstance(code, int) else 1
        return Outcome(exit_code, out[:limit], err[:limit], b"", len(out) > limit)
