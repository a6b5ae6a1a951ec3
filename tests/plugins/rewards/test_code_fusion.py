"""The ``code_tests`` reward's second backend, a Sandbox Fusion server, against an imitation on
127.0.0.1 that speaks its ``/run_code`` API (``RunCodeRequest`` in, ``RunCodeResponse`` out, as
bytedance/SandboxFusion's ``sandbox/server/sandbox_api.py`` defines them) and runs the code in
the local sandbox: the wire format, statement and input/output tests, the server's failures."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from grpo_plugins.rewards.code import CodeTests, CodeTestsOptions
from grpo_plugins.rewards.sandbox import Limits, Sandbox

from grpo_core.errors import RunError
from grpo_core.train.actor.scoring import RewardFn, score


class FusionServer:
    """``POST /run_code``: the request is checked against Sandbox Fusion's model and the code
    run in a local sandbox; ``script`` entries override answers (an int: that status; a dict:
    that body; "garbage": not JSON)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.script: list = []
        self.box = Sandbox(Limits(wall_s=5.0), workers=2)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                action = server.script.pop(0) if server.script else None
                if isinstance(action, int):
                    return self._send(action, b'{"detail": "busy"}')
                if action == "garbage":
                    return self._send(200, b"<html>gateway</html>")
                answer = action if isinstance(action, dict) else server.run(body)
                self._send(200, json.dumps(answer).encode())

            def _send(self, status, payload):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def run(self, request: dict) -> dict:
        allowed = {"code", "language", "compile_timeout", "run_timeout", "memory_limit_MB", "stdin", "files",
                   "fetch_files", "args"}
        assert set(request) <= allowed and request["language"] == "python"
        files = {name: base64.b64decode(data).decode() for name, data in request["files"].items()}
        files["main.py"] = request["code"]
        # a real server has no report descriptor: the harness reports on stdout
        argv = ["/usr/bin/env", "-u", "GRPO_REPORT_FD", "{python}", "-I", "main.py"]
        outcome = self.box.run(files, argv, stdin=request["stdin"] or None)
        finished = not outcome.timed_out
        return {"status": "Success" if finished and outcome.exit_code == 0 else "Failed", "message": "",
                "compile_result": None, "executor_pod_name": None, "files": {},
                "run_result": {"status": "Finished" if finished else "TimeLimitExceeded", "execution_time": 0.1,
                               "return_code": outcome.exit_code, "stdout": outcome.output.decode(),
                               "stderr": outcome.errors.decode()}}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server():
    s = FusionServer()
    yield s
    s.close()


def reward_at(server, **options) -> CodeTests:
    return CodeTests(CodeTestsOptions(sandbox_url=server.url, timeout=5.0, workers=2, sandbox_retries=1, **options))


ADD = "```python\ndef add(a, b):\n    return a + b\n```"
HALF = "```python\ndef add(a, b):\n    return a + b if a < 5 else 0\n```"
TESTS = ["assert add(1, 2) == 3", "assert add(5, 5) == 10"]


def test_statement_and_io_tests_run_on_the_service(server, monkeypatch):
    monkeypatch.setenv("FUSION_TOKEN", "Bearer abc")
    reward = reward_at(server, sandbox_headers_from_env={"Authorization": "FUSION_TOKEN"})
    program = "```python\nprint(sum(map(int, input().split())))\n```"
    cheat = "```python\nimport sys\nprint('0123 0 pass')\nsys.exit(0)\n```"
    io = [{"input": "1 2", "output": "3"}, {"input": "4 4", "output": "8"}]
    server.requests.clear()
    scores = reward(["p"] * 5, [ADD, HALF, program, cheat, "no code"], tests=[TESTS, TESTS, io, TESTS, TESTS])
    assert scores == [1.0, 0.5, 1.0, 0.0, 0.0]
    assert len(server.requests) == 5  # 3 statement runs, 2 io runs; no request for the completion without code
    first = server.requests[0]
    assert first["path"] == "/run_code" and first["headers"]["Authorization"] == "Bearer abc"
    body = first["body"]
    assert body["run_timeout"] == 5.0 and body["memory_limit_MB"] == 1024 and set(body["files"]) <= {
        "solution.py", "job.json"}


def test_a_hung_program_is_the_servers_time_limit_and_scores_0(server):
    reward = CodeTests(CodeTestsOptions(sandbox_url=server.url, timeout=1.0, workers=1))
    assert reward(["p"], ["```python\nwhile True:\n    pass\n```"], tests=[TESTS]) == [0.0]


def test_the_servers_failures_are_errors_naming_it_and_busy_answers_are_retried(server):
    reward = reward_at(server)
    server.script[:] = [503]  # busy once, then fine
    assert reward(["p"], [ADD], tests=[TESTS]) == [1.0]
    for answer, message in [
        ("garbage", "answered a body that is not JSON"),
        ({"status": "SandboxError", "message": "no executor", "run_result": None},
         "says the sandbox failed.*no executor"),
        ({"status": "Success", "message": ""}, "says the sandbox failed"),
        ({"hello": 1}, "is not a Sandbox Fusion RunCodeResponse"),
        (400, "answered HTTP 400"),
    ]:
        server.script[:] = [answer]
        with pytest.raises(RunError, match=message) as info:
            reward(["p"], [ADD], tests=[TESTS])
        assert server.url in str(info.value)


def test_a_server_failure_scores_the_batch_none_when_the_run_says_so(server):
    fn = RewardFn.of("code_tests", 1.0, reward_at(server))
    server.script[:] = [{"oops": True}]
    scores = score([fn], ["p"], [ADD], {"tests": [TESTS]}, [[1]], on_error="none")
    assert scores.failed == 1 and bool(scores.total.isnan().all())


def test_a_missing_header_variable_is_refused_at_build(server, monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    with pytest.raises(RunError, match="environment variable NO_SUCH_TOKEN, which is not set"):
        reward_at(server, sandbox_headers_from_env={"Authorization": "NO_SUCH_TOKEN"})
