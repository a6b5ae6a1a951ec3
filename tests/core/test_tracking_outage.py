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

    def __init__(self, folder: Path, port: int, db: Path):
        self.folder, self.port, self.db = folder, port, db
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
                "--default-artifact-root",
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

    def make(db: Path) -> Server:
        server = Server(tmp_path, _free_port(), db)
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
