"""The ``code_tests`` reward against hostile code (issue 40): each attack runs in the real
sandbox (namespaces, limits, deadline), is bounded, scores 0, leaves nothing behind and does
not stop the scoring of the completions beside it; a good solution scores 1 and a half-right
one 0.5.

Each hostile solution defines ``f()`` to return what the attack achieved, and its test
asserts the attack succeeded: a score of 0 is the attack failing (or the code being killed),
and the side effects are checked from outside as well.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from grpo_plugins.rewards.code import CodeTests, CodeTestsOptions
from grpo_plugins.rewards.sandbox import Limits, Sandbox, SandboxFailure

SECRET = "hunter2-grpo-sandbox-secret"


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def reward() -> CodeTests:
    return CodeTests(CodeTestsOptions(workers=4, timeout=4.0, test_timeout=2, cpu_seconds=3, memory_mb=512,
                                      max_processes=8, max_output_bytes=4096))


class Listener:
    """A TCP server on 127.0.0.1 that records every connection it accepts."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


def sandbox_processes(reward: CodeTests) -> list[int]:
    """Processes left running as any of the reward's sandbox users (root only)."""
    box = reward.backend
    uids = {str(box.uid(slot)) for slot in range(reward.workers)}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        uid_line = next((line for line in status.splitlines() if line.startswith("Uid:")), "")
        if set(uid_line.split()[1:]) & uids:
            found.append(int(entry.name))
    return found


def test_hostile_code_is_bounded_and_scores_zero_while_the_rest_is_scored(reward, tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_SANDBOX_TEST_SECRET", SECRET)
    listener = Listener()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    outside = tmp_path / "written-from-the-sandbox.txt"
    me = os.getpid()
    attacks = {
        "infinite loop": "def f():\n    return 1\nwhile True:\n    pass",
        "fork bomb": "import os\ndef f():\n    return 1\nwhile True:\n    try:\n        os.fork()\n"
                     "    except OSError:\n        pass",
        "10 GB allocation": "big = bytearray(10 * 1024 ** 3)\ndef f():\n    return 1",
        "1 GB of output": "import sys\ndef f():\n    return 1\nfor _ in range(1024):\n"
                          "    sys.stdout.write('x' * (1 << 20))",
        "write outside": f"def f():\n    for path in [{str(outside)!r}, '/tmp/grpo-sandbox-escape.txt', "
                         f"{str(Path.cwd() / 'grpo-sandbox-escape.txt')!r}]:\n"
                         "        try:\n            open(path, 'w').write('escaped')\n            return 1\n"
                         "        except OSError:\n            pass\n    return 0",
        "secrets in the environment": "import os\ndef f():\n"
                                      "    found = [os.environ.get('GRPO_SANDBOX_TEST_SECRET', '')]\n"
                                      f"    for pid in ['self', '1', '{me}', str(os.getppid())]:\n        try:\n"
                                      "            found.append(open(f'/proc/{pid}/environ').read())\n"
                                      "        except OSError:\n            pass\n"
                                      f"    return 1 if any({SECRET!r} in text for text in found) else 0",
        "network": f"import socket\ndef f():\n    try:\n        socket.create_connection(('127.0.0.1', "
                   f"{listener.port}), timeout=2).close()\n        return 1\n    except OSError:\n        return 0",
        "kill the parent": f"import os, signal\ndef f():\n    hits = 0\n    for pid in ({me}, {bystander.pid}):\n"
                           "        try:\n            os.kill(pid, signal.SIGKILL)\n"
                           "            hits += 1\n        except OSError:\n            pass\n"
                           "    return 1 if hits else 0",
        "closed stdout, then sleep": "import os, time\ndef f():\n    return 1\nos.close(1)\nos.close(2)\n"
                                     "time.sleep(600)",
        "exit 0 before the tests": "import sys\ndef f():\n    return 1\nsys.exit(0)",
        "prints a fake verdict": "import sys\ndef f():\n    return 1\nfor i in range(3):\n"
                                 "    print(f'0123456789abcdef {i} pass')\nsys.exit(0)",
    }
    good = "def f():\n    return 1\ndef g(x):\n    return 2 * x"
    half = "def f():\n    return 1\ndef g(x):\n    return x"
    codes = [*attacks.values(), good, half]
    tests = ["assert f() == 1", "assert g(2) == 4"]  # the attacks all define f; g only the honest ones
    started = time.monotonic()
    try:
        scores = reward(["p"] * len(codes), [fenced(c) for c in codes], tests=[tests] * len(codes))
        elapsed = time.monotonic() - started
        assert bystander.poll() is None  # the trainer and its other children live on
        assert listener.accepted == 0
    finally:
        bystander.kill()
        bystander.wait()
        listener.close()
    assert dict(zip(attacks, scores[:len(attacks)])) == dict.fromkeys(attacks, 0.0)
    assert scores[len(attacks):] == [1.0, 0.5]
    assert not outside.exists() and not Path("/tmp/grpo-sandbox-escape.txt").exists()
    assert not (Path.cwd() / "grpo-sandbox-escape.txt").exists()
    # bounded: 13 runs, 4 at a time, none past its 4 s deadline (a generous bound, not a timing)
    assert elapsed < 60
    if os.geteuid() == 0:
        assert sandbox_processes(reward) == []  # the fork bomb's processes died with its namespace
    subprocess.run(["true"], check=True)  # and this process can still start others


def test_a_good_solution_scores_1_and_a_half_right_one_0_5_in_each_test_format(reward):
    add = "def add(a, b):\n    return a + b"
    half = "def add(a, b):\n    return a + b if a < 5 else 0"
    statements = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(5, 5) == 10", "assert add(7, 1) == 8"]
    script = "def check(fn):\n    assert fn(1, 2) == 3\n    assert fn(9, 9) == 18\ncheck(add)"
    program = "a, b = map(int, input().split())\nprint(a + b)"
    half_program = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"
    io = [{"input": "1 2\n", "output": "3\n"}, {"input": "7 7\n", "output": "14"}]
    io_json = '{"inputs": ["2 3", "8 1"], "outputs": ["5", "9\\n"]}'
    completions = [fenced(add), fenced(half), fenced(add), fenced(half), fenced(program), fenced(half_program),
                   fenced(program)]
    tests = [statements, statements, script, script, io, io, io_json]
    assert reward(["p"] * 7, completions, tests=tests) == [1.0, 0.5, 1.0, 0.0, 1.0, 0.5, 1.0]


def test_no_code_block_scores_0_and_the_block_option_picks_one():
    last = CodeTests(CodeTestsOptions(workers=1, timeout=4.0))
    first = CodeTests(CodeTestsOptions(workers=1, timeout=4.0, code_block="first"))
    whole = CodeTests(CodeTestsOptions(workers=1, timeout=4.0, code_block="none", all_or_nothing=True))
    two = "```python\ndef f():\n    return 0\n```\nbetter:\n```py\ndef f():\n    return 1\n```"
    tests = [["assert f() == 1", "assert f() != 2"]]
    assert last(["p"], [two], tests=tests) == [1.0]
    assert first(["p"], [two], tests=tests) == [0.5]
    assert last(["p"], ["def f():\n    return 1"], tests=tests) == [0.0]  # no fence
    assert whole(["p"], ["def f():\n    return 1"], tests=tests) == [1.0]
    assert whole(["p"], ["def f():\n    return 2"], tests=tests) == [0.0]  # all or nothing


def test_tests_of_no_known_shape_name_the_column_and_the_shapes(reward):
    from grpo_core.errors import RunError

    with pytest.raises(RunError, match=r"column 'tests' of completion 1 is int '5'.*list of test statements"):
        reward(["p", "p"], [fenced("x = 1"), fenced("x = 2")], tests=[["assert x"], 5])


def test_a_host_without_namespaces_is_refused_unless_trusted(monkeypatch, caplog):
    """The decision, with the probe's answer of a host where unshare(2) is denied (this
    machine allows it, so the answer is given rather than provoked)."""
    denied = "unshare (new namespaces) failed: Operation not permitted (errno 1)"
    real_probe = Sandbox._probe

    def probe(self, python):
        return denied if self.isolate else real_probe(self, python)

    monkeypatch.setattr(Sandbox, "_probe", probe)
    refused = r"cannot make the namespaces.*Operation not permitted.*trusted_host: true"
    with pytest.raises(SandboxFailure, match=refused):
        Sandbox(Limits(wall_s=4))
    box = Sandbox(Limits(wall_s=4), trusted_host=True)
    assert not box.isolate and "trusted_host is set" in caplog.text
    outcome = box.run({"a.py": "import os\nprint(os.environ.get('GRPO_LOAD_PLUGINS', 'clean'))"},
                      ["{python}", "-I", "a.py"])
    assert outcome.exit_code == 0 and outcome.output.strip() == b"clean"  # the environment is still clean


def test_a_run_past_its_deadline_is_killed_with_its_whole_process_tree():
    box = Sandbox(Limits(wall_s=2.0))
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
            "print('parent', flush=True)\ntime.sleep(600)")
    outcome = box.run({"a.py": code}, ["{python}", "-I", "a.py"])
    assert outcome.timed_out and outcome.output == b"parent\n"
    if os.geteuid() == 0:  # the namespace died with its first process: nothing of it is left
        uids = {str(box.uid(0))}
        left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _uid_of(p) in uids]
        assert left == []


def _uid_of(proc: Path) -> str | None:
    try:
        for line in (proc / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return line.split()[1]
    except OSError:
        return None
    return None
