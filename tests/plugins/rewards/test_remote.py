"""The ``remote`` reward against a real HTTP server on 127.0.0.1 (http.server in a thread):
the wire format, headers from the environment, retries after 503, timeouts, malformed
answers, and how the engine turns its failures into None or an error."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from grpo_plugins.rewards.remote import RemoteOptions, RemoteReward

from grpo_core.errors import RunError
from grpo_core.plugin_manager import load_plugins
from grpo_core.train.actor.scoring import RewardFn, score


class Server:
    """Answers POSTs as scripted: each entry of ``script`` is consumed by one request
    (``"ok"`` scores each completion by its length; an int is that HTTP status;
    ``"sleep"`` answers after 2 s; ``"garbage"``/``"short"``/``"nan"`` are malformed);
    when the script is empty, ``"ok"``. Every request is recorded."""

    def __init__(self):
        self.script: list = []
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                action = server.script.pop(0) if server.script else "ok"
                rewards = [float(len(c)) for c in body["completions"]]
                if action == "sleep":
                    time.sleep(2)
                if isinstance(action, int):
                    return self._send(action, b'{"error": "busy"}')
                payload = {
                    "garbage": b"<html>oops</html>",
                    "short": json.dumps({"rewards": rewards[:-1]}).encode(),
                    "nan": b'{"rewards": ["high"' + b", 1" * (len(rewards) - 1) + b"]}",
                }.get(action, json.dumps({"rewards": rewards, "extra": "ignored"}).encode())
                self._send(200, payload)

            def _send(self, status, payload):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def remote(server, **options) -> RemoteReward:
    return RemoteReward(RemoteOptions(url=server.url, backoff=0.01, **options))


PROMPTS = ["What is 1+1?", "What is 1+1?", "Name a prime.", "Name a prime."]
COMPLETIONS = ["2", "two", "7", "seven!"]


def test_scores_come_from_the_server_in_the_documented_format(server, monkeypatch):
    monkeypatch.setenv("RM_AUTH", "Bearer s3cret")
    fn = remote(server, headers={"X-Run": "test"}, headers_from_env={"Authorization": "RM_AUTH"})
    out = fn(PROMPTS, COMPLETIONS, answer=["2", "2", "7", "7"], completion_ids=[[1], [2, 3], [4], [5]])
    assert out == [1.0, 3.0, 1.0, 6.0]
    (request,) = server.requests
    assert request["path"] == "/score"
    columns = {"answer": ["2", "2", "7", "7"]}
    assert request["body"] == {"prompts": PROMPTS, "completions": COMPLETIONS, "columns": columns}
    assert request["headers"]["Authorization"] == "Bearer s3cret" and request["headers"]["X-Run"] == "test"
    assert request["headers"]["Content-Type"] == "application/json"
    assert "s3cret" not in repr(fn.options)  # the secret is not part of the spec


def test_batch_size_columns_and_completion_ids(server):
    fn = remote(server, batch_size=3, columns=["answer"], send_completion_ids=True)
    ids = [[1], [2, 3], [4], [5]]
    out = fn(PROMPTS, COMPLETIONS, answer=["a", "b", "c", "d"], other=[1, 2, 3, 4], completion_ids=ids)
    assert out == [1.0, 3.0, 1.0, 6.0]
    first, second = (r["body"] for r in server.requests)
    assert first["completions"] == COMPLETIONS[:3] and second["completions"] == COMPLETIONS[3:]
    assert first["columns"] == {"answer": ["a", "b", "c"]} and second["columns"] == {"answer": ["d"]}
    assert first["completion_ids"] == [[1], [2, 3], [4]] and second["completion_ids"] == [[5]]
    with pytest.raises(RunError, match=r"columns \['answer'\] are not in the batch; columns available: other"):
        fn(PROMPTS, COMPLETIONS, other=[1, 2, 3, 4])


def test_a_503_is_retried_with_backoff(server):
    server.script = [503, 503]
    assert remote(server, retries=2)(PROMPTS, COMPLETIONS) == [1.0, 3.0, 1.0, 6.0]
    assert len(server.requests) == 3
    server.script = [503, 503]
    with pytest.raises(RunError, match=r"POST http://127.0.0.1:\d+/score failed after 2 attempt\(s\): HTTP 503"):
        remote(server, retries=1)(PROMPTS, COMPLETIONS)


def test_a_client_error_is_not_retried(server):
    server.script = [401]
    with pytest.raises(RunError, match=r"answered HTTP 401 Unauthorized: .*busy"):
        remote(server, retries=3)(PROMPTS, COMPLETIONS)
    assert len(server.requests) == 1


def test_a_timeout_is_none_or_an_error_as_reward_errors_says(server):
    fns = [RewardFn.of("remote", 1.0, remote(server, timeout=0.3, retries=1))]
    server.script = ["sleep", "sleep"]
    started = time.monotonic()
    with pytest.raises(RunError, match=r"failed after 2 attempt\(s\): timed out after 0.3 s"):
        score(fns, PROMPTS, COMPLETIONS, {}, [[1]] * 4, "raise")
    assert time.monotonic() - started < 1.9  # did not wait for the server's answer
    server.script = ["sleep", "sleep"]
    out = score(fns, PROMPTS, COMPLETIONS, {}, [[1]] * 4, "none")
    assert out.failed == 4 and out.total.isnan().all()
    assert len(server.requests) == 4  # two attempts per batch, no per-completion retries


@pytest.mark.parametrize(
    "action, message",
    [
        ("garbage", r"is not JSON: '<html>oops</html>'; expected \{\"rewards\": \[...\]\}"),
        ("short", r'has no "rewards" list of 4 entries \(one per completion\); got a list of 3'),
        ("nan", r"reward 0 is 'high'; expected a finite number or null"),
    ],
)
def test_a_malformed_answer_is_a_clear_error(server, action, message):
    server.script = [action]
    with pytest.raises(RunError, match=message):
        remote(server)(PROMPTS, COMPLETIONS)
    assert len(server.requests) == 1


def test_a_missing_secret_variable_and_a_bad_url_are_clear_errors(monkeypatch):
    monkeypatch.delenv("RM_AUTH", raising=False)
    message = "header 'Authorization' takes its value from the environment variable RM_AUTH, which is not set"
    with pytest.raises(RunError, match=message):
        RemoteReward(RemoteOptions(url="http://127.0.0.1:1/", headers_from_env={"Authorization": "RM_AUTH"}))
    with pytest.raises(ValueError, match="url must start with http:// or https://"):
        RemoteOptions(url="127.0.0.1:8000/score")


def test_remote_is_a_registered_reward(server):
    component = load_plugins().registry.find("reward_function", "remote")
    assert component.plugin == "grpo_plugins.rewards.remote"
    fn = component.build(RemoteOptions(url=server.url))
    assert fn(["p"], ["four"]) == [4.0]


def test_a_training_run_scores_with_the_remote_reward(server, tmp_path, monkeypatch):
    """Two steps of the tiny spec, the remote reward next to accuracy, two requests at once."""
    from grpo_core.cli import main
    from grpo_core.testing import save_tiny_model

    monkeypatch.chdir(tmp_path)
    spec = Path(__file__).resolve().parents[3] / "specs" / "tiny.yaml"
    model = save_tiny_model(tmp_path / "model")
    remote_slot = json.dumps({"name": "remote", "url": server.url, "concurrency": 2, "call_timeout": 30, "weight": 0.1})
    code = main([str(spec), "--set", f"model.path={model}", "--set", f"train.output_dir={tmp_path / 'out'}",
                 "--set", "tracking=[]", "--set", "train.steps=2", "--set", "train.threads=1",
                 "--set", "eval.every=0", "--set", "eval.at_start=false",
                 "--set", "eval.at_end=false", "--set", f"rewards=[{{name: accuracy}}, {remote_slot}]"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rewards/remote/mean"] >= 0 and r["reward/failed"] == 0 for r in rows)
    assert len(server.requests) == 4  # 2 steps x 2 chunks of 4 completions
    assert all(len(r["body"]["completions"]) == 4 and set(r["body"]["columns"]) >= {"answer"} for r in server.requests)
