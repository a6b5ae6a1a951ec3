"""Shared fixtures of the fault tests (test_faults, test_resume, test_tracking_outage):
a tiny model, MLflow stores, specs written to disk, and ``grpo-run`` in a real subprocess;
and of the plugin-loading tests (test_plugin_manager, test_commands): an installed
distribution with an entry point (``fake_dist``)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_core.testing import save_tiny_model

# One torch thread everywhere: the machine's cores are shared, and oversubscription makes
# tiny-model steps a hundred times slower.
CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PYTHONUNBUFFERED": "1",
}

BASE_SPEC: dict[str, Any] = {
    "data": {"name": "arithmetic", "train_size": 16, "eval_size": 0},
    "rollout": {"group_size": 4, "max_new_tokens": 6},
    "rewards": [{"name": "accuracy"}, {"name": "format", "pattern": "^\\s*\\d+", "weight": 0.5}],
    "train": {
        "steps": 4,
        "prompts_per_step": 2,
        "lr": 1.0e-2,
        "progress": False,
        "threads": 1,
        "log_completions_every": 0,
        "output_dir": "out",
    },
    "eval": {"at_start": False, "at_end": False},
    "tracking": [],
}


def merge(base: dict, changes: dict) -> dict:
    """``base`` updated recursively with ``changes`` (a None value deletes the key)."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("faults-model") / "model")


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory) -> Path:
    """An initialised MLflow SQLite store (creating the tables takes seconds: do it once)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "db.sqlite"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_db(_mlflow_template) -> Callable[[Path], str]:
    """``mlflow_db(folder)``: a fresh copy of the initialised store in ``folder``; its URI."""

    def make(folder: Path) -> str:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(_mlflow_template, folder / "db.sqlite")
        return f"sqlite:///{folder / 'db.sqlite'}"

    return make


@pytest.fixture
def write_spec(tiny_model_dir) -> Callable[..., Path]:
    """``write_spec(folder, **sections)``: BASE_SPEC on the tiny model, merged with ``sections``,
    written to ``folder/spec.yaml`` (relative paths in it resolve against ``folder``)."""

    def write(folder: Path, name: str = "spec.yaml", **sections: Any) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        spec = merge({"model": {"path": str(tiny_model_dir)}, **BASE_SPEC}, sections)
        path = folder / name
        path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
        return path

    return write


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics.jsonl (a torn last line, from a killed writer, is dropped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def last_step(path: Path) -> int:
    return max((r["step"] for r in read_metrics(path)), default=-1)


class Child:
    """``grpo-run`` in a real subprocess (``python -m grpo_core.cli``), stderr to a file."""

    def __init__(self, args: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None):
        self.log = log
        self._fh = log.open("wb")
        # MLflow's HTTP settings come from the spec's tracker options, not from this process.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_HTTP_REQUEST_")}
        full_env = {**inherited, **CHILD_ENV, **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_core.cli", *args],
            cwd=cwd,
            env=full_env,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.02) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"grpo-run exited ({self.proc.returncode}) before {what}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{self.output()}")
            time.sleep(poll)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"grpo-run still running after {timeout}s:\n{self.output()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self._fh.close()

    def output(self) -> str:
        if not self._fh.closed:
            self._fh.flush()
        return self.log.read_text(encoding="utf-8", errors="replace")


@pytest.fixture
def child(tmp_path) -> Callable[..., Child]:
    """``child(args, cwd)``: start grpo-run in a subprocess; killed at teardown if still running."""
    started: list[Child] = []

    def start(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> Child:
        log = tmp_path / f"child-{len(started)}.log"
        proc = Child([str(a) for a in args], cwd or tmp_path, log, env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def load_weights(folder: Path) -> dict:
    """The tensors of the safetensors files in ``folder`` (a final model or a checkpoint's)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    out: dict = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


@pytest.fixture
def kit():
    """Helpers for the test modules (conftest modules cannot be imported under importlib mode)."""
    import types

    return types.SimpleNamespace(
        read_metrics=read_metrics, last_step=last_step, merge=merge, load_weights=load_weights
    )


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """``fake_dist(dist, entry_point, source)``: an installed distribution ``dist`` whose
    entry point ``entry_point`` (group ``grpo``) is a module with ``source``."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def make(dist: str, entry_point: str, source: str, version: str = "1.2.3") -> str:
        module = f"fake_grpo_{dist.replace('-', '_')}_{abs(hash(str(tmp_path))) % 10**8}"
        (site / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n", encoding="utf-8"
        )
        (info / "entry_points.txt").write_text(f"[grpo]\n{entry_point} = {module}\n", encoding="utf-8")
        modules.append(module)
        return module

    yield make
    for module in modules:
        sys.modules.pop(module, None)


def tagged_processes(tag: str) -> dict[int, int]:
    """pid -> RANK (-1 before a process has one: an srun task not yet the trainer) of the live
    processes whose environment carries ``GRPO_TEST_TAG=tag``: what a launcher test finds of a
    run's processes on this host, zombies left out."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if f"GRPO_TEST_TAG={tag}".encode() in env and stat[stat.rindex(")") + 2] != "Z":
            found[int(entry.name)] = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), -1)
    return found
