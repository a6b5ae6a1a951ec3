"""MLflow outages never stop training, and lose nothing: a real ``mlflow server`` is killed
mid-run and restarted on the same port and store while training goes on; every step's
metrics end up in the MLflow run and in metrics.jsonl. A server that is down for the whole
run still gives exit 0 and a complete metrics.jsonl."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from grpo_core.cli import main

HOST = "127.0.0.1"
VOLATILE = ("time/", "perf/tokens_per_second")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _refuses(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((HOST, port)) != 0


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


class Server:
    """``mlflow server`` on 127.0.0.1 with a SQLite store, in its own process group."""

    def __init__(self, folder: Path, port: int, db: Path, serve_artifacts: bool = False):
        self.folder, self.port, self.db = folder, port, db
        self.serve_artifacts = serve_artifacts  # artifacts uploaded over HTTP, not written by the client
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 120) -> None:
        self.starts += 1
        log = (self.folder / f"server-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{self.db}",
                "--artifacts-destination" if self.serve_artifacts else "--default-artifact-root",
                str(self.folder / "artifacts"),
            ],
            cwd=self.folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # No async job runner (seven extra processes, unrelated to tracking).
            env={**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        log.close()
        deadline = time.monotonic() + timeout
        while not _answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                text = (self.folder / f"server-{self.starts}.log").read_text(errors="replace")
                raise AssertionError(
                    f"mlflow server did not answer /health on port {self.port}:\n{text[-3000:]}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """Kill the server and its workers (SIGKILL to the process group: a crash, not a shutdown)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.proc = None
        _wait(lambda: _refuses(self.port), 30, f"port {self.port} to be released")  # workers die too


@pytest.fixture
def server_factory(tmp_path):
    servers: list[Server] = []

    def make(db: Path, serve_artifacts: bool = False) -> Server:
        server = Server(tmp_path, _free_port(), db, serve_artifacts)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


GATE = '''
import json, os, time
from pathlib import Path
from grpo_core import hookimpl

def gate(prompts, completions, **kwargs):
    """Scores by length; at chosen steps, tells the test where it is and waits for its go."""
    folder = Path(os.environ["GATE_DIR"])
    logged = folder / "out" / "metrics.jsonl"
    lines = logged.read_text().splitlines() if logged.exists() else []
    step = 1 + max((json.loads(line)["step"] for line in lines), default=0)
    waits = {3: "server-up", 4: "server-killed", 6: "interrupted", 8: "server-back"}
    if step in waits:
        (folder / f"at-step-{step}").touch()
        deadline = time.monotonic() + 180
        while not (folder / waits[step]).exists():
            if time.monotonic() > deadline:
                raise RuntimeError("gate: the test never said go")
            time.sleep(0.05)
    return [float(len(c) % 3) for c in completions]

@hookimpl
def register_reward_functions(register):
    register.add("gate", gate)
'''

STEPS = 10


@pytest.mark.slow
def test_server_killed_and_restarted_mid_run_loses_nothing(
    tmp_path, write_spec, child, kit, _mlflow_template, server_factory
):
    """Steps 1-2: no server yet (the run cannot even be created). Step 3: the server is
    started (and answers /health). Step 4: it is killed (SIGKILL). Steps 4-6 train without
    it; SIGINT at step 6 ends the process while it is still down; ``--resume`` trains step 7
    without it too; then it comes back on the same port and store for steps 8-10. One MLflow
    run ends FINISHED, with the params and every step's metrics exactly once."""
    import shutil

    db = tmp_path / "db.sqlite"
    shutil.copy(_mlflow_template, db)
    server = server_factory(db)
    (tmp_path / "gate.py").write_text(GATE)
    uri = f"http://{HOST}:{server.port}"
    spec = write_spec(
        tmp_path,
        plugins=["gate.py"],
        rewards=[{"name": "gate"}],
        train={"steps": STEPS},
        tracking=[
            {
                "name": "mlflow",
                "experiment": "outage",
                "tracking_uri": uri,
                "retry_every": 0.5,
                # A dead server refuses at once; a busy one may be slow, and a create_run whose
                # answer times out would be sent again (a second run).
                "request_timeout": 30,
            }
        ],
    )
    metrics_file = tmp_path / "out" / "metrics.jsonl"
    env = {"GATE_DIR": str(tmp_path)}
    first = child([spec], cwd=tmp_path, env=env)
    first.wait_for(lambda: (tmp_path / "at-step-3").exists(), 150, "step 3")
    assert kit.last_step(metrics_file) == 2 and _refuses(server.port)
    server.start()
    (tmp_path / "server-up").touch()
    first.wait_for(lambda: (tmp_path / "at-step-4").exists(), 60, "step 4")
    assert kit.last_step(metrics_file) == 3
    server.stop()
    assert _refuses(server.port)
    (tmp_path / "server-killed").touch()

    first.wait_for(lambda: (tmp_path / "at-step-6").exists(), 60, "step 6")
    first.signal(signal.SIGINT)
    (tmp_path / "interrupted").touch()
    assert first.wait() == 130, first.output()
    out = first.output()
    assert "MLflow start failed" in out and "metrics are kept and retried" in out
    assert "3 metric rows were not sent" in out  # steps 4-6: kept in the checkpoint
    assert "stopped at step 6" in out

    second = child([spec, "--resume"], cwd=tmp_path, env=env)
    second.wait_for(lambda: (tmp_path / "at-step-8").exists(), 150, "step 8")
    assert kit.last_step(metrics_file) == 7 and _refuses(server.port)
    server.start()
    (tmp_path / "server-back").touch()
    assert second.wait(150) == 0, second.output()
    out = second.output()
    assert "resuming from" in out and "metric rows were not sent" not in out
    state = torch.load(tmp_path / "out" / "checkpoints" / "step-000006" / "state.pt", weights_only=False)

    rows = kit.read_metrics(metrics_file)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("outage")
    (mlrun,) = client.search_runs([exp.experiment_id])
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_id == state["run_id"]
    assert mlrun.data.params["train.steps"] == str(STEPS)  # logged at start, sent once it existed
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    assert "spec.resolved.yaml" in artifacts, artifacts
    keys = {k for r in rows for k in r if k != "step"}
    assert keys == set(mlrun.data.metrics)
    for key in sorted(keys):
        history = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, key))
        want = sorted((r["step"], r[key]) for r in rows if key in r)
        assert history == want, key  # every step exactly once, with the value in metrics.jsonl


def test_server_down_for_the_whole_run(tmp_path, write_spec, kit, capsys, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    port = _free_port()
    spec = write_spec(
        tmp_path,
        train={"steps": 4, "log_completions_every": 2},
        tracking=[
            {
                "name": "mlflow",
                "experiment": "down",
                "tracking_uri": f"http://{HOST}:{port}",
                "retry_every": 0.0,
                "request_timeout": 1,
            }
        ],
    )
    started = time.monotonic()
    assert main([str(spec)]) == 0
    assert time.monotonic() - started < 60  # never waits on the dead server for long
    err = capsys.readouterr().err
    assert "grpo-run: finished 4 steps." in err
    assert "Traceback" not in err
    assert "MLflow start failed" in caplog.text
    rows = kit.read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and "reward" in r and "time/step" in r for r in rows)
    assert (tmp_path / "out" / "final" / "model.safetensors").exists()


# --------------------------------------------------------------------------- the tracker alone
class Proxy:
    """An HTTP proxy on 127.0.0.1 in front of a real server: ``mode`` "up" forwards, "down"
    drops every connection unanswered (a server gone), "slow-create" forwards a run creation
    but answers it only after ``delay`` seconds (the server made the run; the client timed out)."""

    def __init__(self, upstream: int, delay: float = 4.0):
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        proxy = self
        self.mode, self.delay, self.seen = "up", delay, []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.seen.append((proxy.mode, self.command, self.path))
                if proxy.mode == "down":
                    self.close_connection = True
                    return
                conn = http.client.HTTPConnection(HOST, upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                if proxy.mode == "slow-create" and self.path.endswith("/runs/create"):
                    proxy.mode = "up"
                    time.sleep(proxy.delay)
                try:
                    self.send_response(reply.status)
                    for k, v in reply.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.port = self.server.server_address[1]
        import threading

        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _tracker(uri: str, **options):
    from grpo_plugins.trackers.mlflow import MLflowOptions, MLflowTracker

    return MLflowTracker(MLflowOptions(experiment="t", tracking_uri=uri, retry_every=0, **options))


@pytest.mark.slow
def test_one_run_and_nothing_dropped_through_a_timeout_and_an_outage(
    tmp_path, _mlflow_template, server_factory, monkeypatch
):
    """The run's creation times out after the server made it: the next attempt finds that
    run instead of making a second. Then the server is unreachable while params, a table,
    an artifact and metrics are logged: all of them arrive once it answers again."""
    import shutil

    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    shutil.copy(_mlflow_template, tmp_path / "db.sqlite")
    server = server_factory(tmp_path / "db.sqlite", serve_artifacts=True)
    server.start()
    proxy = Proxy(server.port)
    try:
        tracker = _tracker(f"http://{HOST}:{proxy.port}")
        proxy.mode = "slow-create"
        assert tracker.start("timeout") is None  # timed out: no run id yet
        tracker.log_metrics({"loss": 1.0}, 1)  # creates (or finds) the run, then sends
        proxy.mode = "down"
        spec = tmp_path / "spec.resolved.yaml"
        spec.write_text("train: {steps: 2}\n")
        tracker.log_params({"train.steps": 2})
        tracker.log_table("completions", [{"prompt": "1+1", "completion": "2", "reward": 1.0}], 2)
        tracker.log_artifact(str(spec))
        tracker.log_metrics({"loss": 0.5}, 2)
        assert ("down", "POST", "/api/2.0/mlflow/runs/log-batch") in proxy.seen  # it tried
        state = tracker.state_dict()  # a checkpoint now holds all of it
        assert [k for k, _ in state["unsent"]] == ["params", "table", "artifact"] and len(state["pending"]) == 1
        proxy.mode = "up"
        tracker.finish("FINISHED")
    finally:
        proxy.close()
    client = MlflowClient(f"http://{HOST}:{server.port}")
    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    (run,) = runs
    assert run.info.run_id == tracker.run_id and run.info.status == "FINISHED"
    assert run.data.params == {"train.steps": "2"}
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [1, 2]
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"spec.resolved.yaml", "completions"} <= names, names
    (table,) = client.list_artifacts(run.info.run_id, "completions")
    assert table.path == "completions/step_000002.json"


def test_steps_redone_after_a_crash_are_logged_once(tmp_path, mlflow_db):
    """Steps 4-5 were sent, then the process died; the run resumes from its step-3
    checkpoint and redoes them: MLflow keeps one value per step (the first)."""
    uri = mlflow_db(tmp_path)
    first = _tracker(uri)
    run_id = first.start("redo")
    state = None
    for step in range(1, 6):
        first.log_metrics({"loss": 1.0 / step, "reward": float(step)}, step)
        if step == 3:
            state = first.state_dict()  # the checkpoint of step 3
    # killed here: no finish
    second = _tracker(uri)
    second.load_state_dict(state)
    assert second.start("redo", resume_id=run_id) == run_id
    for step in (4, 5, 6):
        second.log_metrics({"loss": 2.0 / step, "reward": float(step) + 0.5}, step)
    second.finish("FINISHED")
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert loss == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.25), (5, 0.2), (6, 2 / 6)]
    reward = sorted(client.get_metric_history(run_id, "reward"), key=lambda m: m.step)
    assert [m.step for m in reward] == [1, 2, 3, 4, 5, 6]
    assert len(client.search_runs([client.get_experiment_by_name("t").experiment_id])) == 1
