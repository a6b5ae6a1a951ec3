"""The test harness the ``code_tests`` reward runs inside the sandbox (copied into the working
directory as ``harness.py``; standard library only, never imported by the trainer).

It reads ``job.json`` (the token, the tests, the per-test time limit) and deletes it, runs
``solution.py`` as module ``solution``, then each test in the solution's namespace, one
after the other, each within ``test_timeout`` seconds (``SIGALRM``). After each test it
writes ``<token> <index> pass`` or ``<token> <index> fail`` on the report descriptor
(``GRPO_REPORT_FD``; on a sandbox service, a copy of stdout taken before the code runs); a
test that was not reported (the program exited, hung or was killed first) counts as failed.
The token is random per run and the code never sees the job file, so what the code prints
cannot pass for a result (an exit before the tests, ``sys.exit(0)`` among them, passes
nothing).
"""

import json
import os
import signal
import sys


class TestTimeout(BaseException):
    """A test ran past its time (a BaseException: ``except Exception`` in the code does not stop it)."""


def _alarm(signum, frame):
    raise TestTimeout()


def main():
    with open("job.json", encoding="utf-8") as fh:
        job = json.load(fh)
    os.remove("job.json")
    token, tests, limit = job["token"], job["tests"], job["test_timeout"]
    fd = os.environ.pop("GRPO_REPORT_FD", None)  # none on a sandbox service: a copy of stdout, taken now
    report = os.fdopen(int(fd) if fd else os.dup(1), "w", buffering=1)
    namespace = {"__name__": "solution"}
    signal.signal(signal.SIGALRM, _alarm)
    try:
        signal.alarm(limit)
        with open("solution.py", encoding="utf-8") as fh:
            exec(compile(fh.read(), "solution.py", "exec"), namespace)  # noqa: S102 - the sandboxed program
        signal.alarm(0)
    except BaseException:  # noqa: BLE001 - a solution that does not load passes nothing
        signal.alarm(0)
        report.write(f"{token} load fail\n")
        return
    for index, test in enumerate(tests):
        verdict = "fail"
        try:
            signal.alarm(limit)
            exec(compile(test, f"test_{index}", "exec"), namespace)  # noqa: S102
            verdict = "pass"
        except BaseException:  # noqa: BLE001 - an assertion, an exception, SystemExit, the alarm
            pass
        finally:
            signal.alarm(0)
        report.write(f"{token} {index} {verdict}\n")
    report.write(f"{token} done\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
