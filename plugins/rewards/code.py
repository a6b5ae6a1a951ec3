"""Reward function ``code_tests``: the completion's code run against the row's tests, in a
sandbox; the score is the fraction of tests passed (or 1/0 with ``all_or_nothing``).

The code is the completion's last (or first) fenced block (```` ```python ````, ```` ```py ````
or an untagged fence), or the whole completion with ``code_block: none``; a completion
without one scores 0. The row's tests (column ``tests_column``) take one of these shapes,
or a JSON string holding one:

- a list of strings: statements run after the code in its namespace, one test each
  (MBPP's ``test_list``: ``assert add(1, 2) == 3``); a string alone is one test (HumanEval's
  ``check`` function and its call);
- a list of ``{"input": ..., "output": ...}`` objects, or ``{"inputs": [...], "outputs":
  [...]}`` (APPS, CodeContests): the code runs as a program once per test with the input on
  stdin, and passes when its stdout matches the output (trailing blanks of each line and
  trailing blank lines aside) and it exits 0.

Statement tests run in one process: a harness (:mod:`grpo_plugins.rewards.code_harness`)
runs the code, then each test within ``test_timeout``, and reports each verdict with a token
the code never sees, so neither printing ``PASS`` nor ``sys.exit(0)`` before the tests earns
anything. But the code runs in the harness's process, so one line (``sys._getframe(1).f_locals``)
reaches the token and the report file and forges every verdict, which a policy under RL
pressure can learn: prefer input/output tests, whose expected output never enters the process.

Where the code runs: locally in :class:`~grpo_plugins.rewards.sandbox.Sandbox` (a root of its
own holding no host file, socket or secret, no network, its own processes, limits, a deadline;
``workers`` at a time), or on a
Sandbox Fusion server (``sandbox_url``; :mod:`grpo_plugins.rewards.fusion`). A run the code
hangs, crashes or floods ends at its limits and its tests fail: the score is 0 for that
completion, never an error of the run. A sandbox that cannot run anything (no namespaces, an
unreachable service) is a :class:`~grpo_core.errors.RunError` for the batch.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from grpo_plugins.rewards.common import column
from grpo_plugins.rewards.fusion import FusionClient
from grpo_plugins.rewards.sandbox import Limits, Outcome, Sandbox
from pydantic import Field, field_validator

from grpo_core import hookimpl
from grpo_core.contracts import completion_text
from grpo_core.errors import RunError
from grpo_core.options import Options, Seconds, WholeSeconds

__all__ = ["CodeTestsOptions", "CodeTests", "extract_code", "parse_tests"]

HARNESS = Path(__file__).with_name("code_harness.py")
_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


class CodeTestsOptions(Options):
    """Options of the ``code_tests`` reward."""

    tests_column: str = Field("tests", min_length=1, description="Dataset column holding each row's tests "
                              "(a list of statements, a script, or input/output pairs; see the module doc).")
    code_block: Literal["last", "first", "none"] = Field(
        "last", description="Which fenced code block of the completion is the code (```python, ```py or ```); "
        "none: the whole completion. A completion without a block scores 0."
    )
    all_or_nothing: bool = Field(False, description="Score 1 when every test passes, else 0 (default: the "
                                 "fraction of tests passed).")
    timeout: Seconds = Field(10.0, gt=0, description="Wall-clock seconds one run may take (a completion's "
                             "statement tests, or one input/output test); then its whole process tree is killed.")
    test_timeout: WholeSeconds = Field(5, ge=1, description="Seconds one statement test may take before it "
                                       "fails (the next one runs).")
    cpu_seconds: WholeSeconds = Field(10, ge=1, description="CPU seconds per process of the code.")
    memory_mb: int = Field(1024, ge=64, description="Address space per process of the code, in MiB.")
    max_processes: int = Field(16, ge=1, description="Processes and threads the code may run at once.")
    max_file_mb: int = Field(16, ge=1, description="Largest file the code may write, in MiB.")
    disk_mb: int = Field(64, ge=1, description="Size of its private working directory, in MiB.")
    max_output_bytes: int = Field(65536, ge=1024, description="Output (stdout and stderr) read per run; "
                                  "beyond it the pipe is closed and an input/output test fails.")
    workers: int | None = Field(None, ge=1, le=64, description="Completions run at once; default: the CPU "
                                "count (at most 64).")
    python: str | None = Field(None, description="Interpreter the code runs with; default: the trainer's "
                               "(or the system's python3 when the sandbox user cannot run it).")
    trusted_host: bool = Field(False, description="Where namespaces cannot be made, run the code without "
                               "them (network, processes and files not isolated) instead of refusing to start.")
    uid_base: int = Field(1_900_000_000, ge=1000, le=2_000_000_000, description="When the trainer runs as root: "
                          "the code runs as this user id plus an offset per trainer process and worker (ids of no "
                          "real user).")
    sandbox_url: str | None = Field(None, description="A Sandbox Fusion server's base URL (http:// or "
                                    "https://): the code runs there (POST <url>/run_code) instead of locally.")
    sandbox_headers_from_env: dict[str, str] = Field(
        default_factory=dict, description="With sandbox_url: HTTP header -> environment variable holding its "
        "value (e.g. {Authorization: SANDBOX_TOKEN}).")
    sandbox_retries: int = Field(2, ge=0, description="With sandbox_url: further attempts after a connection "
                                 "error, a timeout or status 408, 429 or 5xx.")

    @field_validator("sandbox_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"sandbox_url must start with http:// or https://, got {v!r}")
        return v

    def limits(self) -> Limits:
        return Limits(wall_s=self.timeout, cpu_s=self.cpu_seconds, memory_bytes=self.memory_mb << 20,
                      processes=self.max_processes, file_bytes=self.max_file_mb << 20,
                      disk_bytes=self.disk_mb << 20, output_bytes=self.max_output_bytes)


def extract_code(text: str, which: str) -> str | None:
    """The code of ``text``: its ``which`` (``last``/``first``) fenced Python block, the whole
    text for ``none``; None when there is no block (or nothing but blanks)."""
    if which == "none":
        return text if text.strip() else None
    blocks = [m.group(2) for m in _FENCE.finditer(text)]
    if not blocks:
        return None
    code = blocks[-1] if which == "last" else blocks[0]
    return code if code.strip() else None


def parse_tests(value: Any, where: str) -> tuple[str, list]:
    """``("statements", [str, ...])`` or ``("io", [(input, output), ...])`` from a row's
    tests (module doc); a RunError naming ``where`` and the valid shapes otherwise."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            value = json.loads(value)
        except ValueError:
            pass  # a script that starts with a bracket
    if hasattr(value, "tolist") and not isinstance(value, str):  # a numpy array from a Parquet file
        value = value.tolist()
    if isinstance(value, str):
        return "statements", [value]
    if isinstance(value, dict) and isinstance(value.get("inputs"), list) and isinstance(value.get("outputs"), list) \
            and len(value["inputs"]) == len(value["outputs"]):
        value = [{"input": i, "output": o} for i, o in zip(value["inputs"], value["outputs"])]
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(t, str) for t in value):
            return "statements", list(value)
        if all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in value):
            return "io", [(_text(t["input"]), _text(t["output"])) for t in value]
    raise RunError(
        f"reward function 'code_tests': {where} is {type(value).__name__} {str(value)[:80]!r}; expected a non-empty "
        'list of test statements, a test script, a list of {"input", "output"} objects or {"inputs": [...], '
        '"outputs": [...]} (or a JSON string of one)'
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def same_output(got: str, expected: str) -> bool:
    """Outputs compared line by line without trailing blanks, trailing blank lines aside."""
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out
    return lines(got) == lines(expected)


class CodeTests:
    """The fraction of the row's tests the completion's code passes, run in a sandbox."""

    def __init__(self, options: CodeTestsOptions):
        self.options = options
        self.__name__ = "code_tests"
        self.required_columns = [options.tests_column]
        self.workers = options.workers or min(64, os.cpu_count() or 1)
        if options.sandbox_url is not None:
            self.backend: Any = FusionClient(options.sandbox_url, options.sandbox_headers_from_env,
                                             options.limits(), retries=options.sandbox_retries)
        else:
            self.backend = Sandbox(options.limits(), workers=self.workers, python=options.python,
                                   trusted_host=options.trusted_host, uid_base=options.uid_base)

    def __repr__(self) -> str:
        return f"code_tests(workers={self.workers})"

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float | None]:
        tests = column("code_tests", columns, self.options.tests_column, len(completions))
        jobs: dict[tuple, int] = {}  # (code, tests) -> first row: a group's repeats run once
        rows: list[tuple | None] = []
        for i, (completion, row_tests) in enumerate(zip(completions, tests)):
            code = extract_code(completion_text(completion), self.options.code_block)
            key = None if code is None else (code, parse_tests(row_tests, f"column '{self.options.tests_column}' "
                                                               f"of completion {i}"))
            rows.append(key)
            if key is not None:
                jobs.setdefault(_hashable(key), i)
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="code-tests") as pool:
            keys = list(jobs)
            scores = dict(zip(keys, pool.map(lambda k: self.score(rows[jobs[k]]), keys)))
        return [0.0 if key is None else scores[_hashable(key)] for key in rows]

    def score(self, job: tuple[str, tuple[str, list]]) -> float:
        """One completion's score: its code against its tests."""
        code, (kind, tests) = job
        passed = self._statements(code, tests) if kind == "statements" else self._io(code, tests)
        if self.options.all_or_nothing:
            return float(passed == len(tests))
        return passed / len(tests)

    def _statements(self, code: str, tests: list[str]) -> int:
        token = secrets.token_hex(16)
        job = {"token": token, "tests": tests, "test_timeout": self.options.test_timeout}
        files = {"solution.py": code, "harness.py": HARNESS.read_text(encoding="utf-8"), "job.json": json.dumps(job)}
        outcome = self.backend.run(files, ["{python}", "-I", "harness.py"])
        return _passed(outcome, token, len(tests))

    def _io(self, code: str, tests: list[tuple[str, str]]) -> int:
        passed = 0
        for stdin, expected in tests:
            outcome = self.backend.run({"solution.py": code}, ["{python}", "-I", "solution.py"], stdin=stdin)
            ok = outcome.exit_code == 0 and not outcome.output_cut
            passed += ok and same_output(outcome.output.decode("utf-8", "replace"), expected)
        return passed


def _hashable(key: tuple) -> tuple:
    code, (kind, tests) = key
    return code, kind, json.dumps(tests)


def _passed(outcome: Outcome, token: str, count: int) -> int:
    """Tests reported passed with ``token`` (on the report descriptor, or in the output of a
    service that has none), each counted once."""
    found = set()
    for line in (outcome.report + b"\n" + outcome.output).decode("utf-8", "replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == token and parts[2] == "pass" and parts[1].isdigit():
            index = int(parts[1])
            if index < count:
                found.add(index)
    return len(found)


@hookimpl
def register_reward_functions(register) -> None:
    register.add("code_tests", CodeTests, options=CodeTestsOptions)
