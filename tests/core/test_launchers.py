"""Launchers, the plugin kind that starts a run's processes (``grpo-run run --launcher``):
an example launcher from a plugin file trains a real two-process run, importing only public
names; unknown launchers and options are usage errors naming what is valid."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_core.contracts import RunArguments

from .conftest import CHILD_ENV, read_metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "launchers" / "hosts_launcher.py"
PUBLIC_MODULES = {"grpo_core", "grpo_core.contracts", "grpo_core.launching"}

SPEC = {
    "data": {"name": "arithmetic", "train_size": 8, "eval_size": 2},
    "rollout": {"group_size": 2, "max_new_tokens": 4},
    "train": {"steps": 2, "prompts_per_step": 2, "seed": 1},
    "checkpoint": {"every": 1},
}


def _grpo_run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "grpo_core.cli", "run", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_example_launcher_imports_no_private_name():
    tree = ast.parse(EXAMPLE.read_text(encoding="utf-8"))
    engine = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              and (node.module or "").split(".")[0] == "grpo_core"]
    assert engine, "the example imports nothing of grpo-core"
    for node in engine:
        assert node.module in PUBLIC_MODULES, node.module
        assert not [a.name for a in node.names if a.name.startswith("_")], node.module


@pytest.mark.slow
def test_a_launcher_plugin_file_places_and_trains_a_two_process_run(tmp_path, write_spec):
    record = tmp_path / "placed.json"
    spec = write_spec(tmp_path, plugins=[str(EXAMPLE)], **SPEC)
    done = _grpo_run([spec, "--launcher", "hosts", "--nproc", "2", "--launcher-option", "hosts=2",
                      "--launcher-option", f"record={record}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    placed = json.loads(record.read_text())
    assert [(p["host"], p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"], p["LOCAL_WORLD_SIZE"]) for p in placed] == [
        (0, "0", "0", "2", "1"), (1, "1", "0", "2", "1")]
    assert placed[0]["command"][1:4] == ["-m", "grpo_core.cli", "run"]
    folder = tmp_path / placed[0]["run_folder"]
    metrics = read_metrics(folder / "metrics.jsonl")
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert (folder / "final").is_dir()


def test_an_unknown_launcher_is_refused_naming_the_available_ones(tmp_path, write_spec):
    spec = write_spec(tmp_path, **SPEC)
    done = _grpo_run([spec, "--launcher", "slurmm"], tmp_path)
    assert done.returncode == 2
    assert "unknown launcher 'slurmm'; available: local, ray, slurm" in done.stderr


def test_a_launcher_option_it_does_not_take_is_refused_naming_its_options(tmp_path, write_spec):
    spec = write_spec(tmp_path, plugins=[str(EXAMPLE)], **SPEC)
    done = _grpo_run([spec, "--launcher", "hosts", "--launcher-option", "hostz=2"], tmp_path)
    assert done.returncode == 2
    assert "--launcher-option for launcher 'hosts': hostz" in done.stderr
    assert "its options: hosts, record" in done.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_a_launcher_option_without_a_launcher_is_a_usage_error(tmp_path, write_spec):
    spec = write_spec(tmp_path, **SPEC)
    done = _grpo_run([spec, "--launcher-option", "threads=1"], tmp_path)
    assert done.returncode == 2
    assert "--launcher-option needs --launcher NAME" in done.stderr


def test_run_arguments_give_the_command_and_rank_variables_of_a_process():
    run = RunArguments(spec="s.yaml", overrides=("train.lr=1e-5",), resume="latest", nproc=4, run_folder="runs/s")
    assert run.command("py") == ["py", "-m", "grpo_core.cli", "run", "s.yaml", "--set", "train.lr=1e-5",
                                 "--resume", "latest"]
    assert run.environment(3, 4, "10.0.0.1", 29500, local_rank=1, local_world_size=2) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert run.environment(1, 2, "127.0.0.1", 1)["LOCAL_RANK"] == "1"


def test_a_rank_ended_by_the_launchers_own_sigterm_is_not_the_root_failure(monkeypatch, capsys):
    """Rank 0 fails (exit 3); rank 1 waits and dies of the SIGTERM the launcher sends after the
    grace period, before any handler of its own: the run's code is rank 0's, not 143, and the
    launcher does not report its own signal as a kill."""
    import subprocess
    import sys

    from grpo_core import launching

    monkeypatch.setattr(launching, "GRACE_S", 0.2)
    procs = [subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]),
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    try:
        assert launching.supervise(procs) == 3
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[1].returncode == -15
    assert "killed by SIGTERM" not in capsys.readouterr().err
