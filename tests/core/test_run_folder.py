"""Nothing lost, nothing crossed: a run folder holding another run is refused (``--resume``
continues it, ``--overwrite`` moves it aside), pruning and ``--resume`` keep to the current
trajectory, any exception before a step's update checkpoints the last completed step, a
time-based checkpoint bounds lost work, and a signal during the final evaluation is handled."""

from __future__ import annotations

import signal

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main
from grpo_core.spec.models import CheckpointSection


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _steps(folder) -> list[int]:
    return [int(f.name[len(ckpt.PREFIX):]) for f in ckpt.list_checkpoints(folder)]


# --------------------------------------------------------------------------- a reused folder
def test_a_fresh_run_in_a_used_folder_is_refused_and_overwrite_moves_it_aside(tmp_path, write_spec, kit, capsys):
    spec = write_spec(tmp_path, train={"steps": 3}, checkpoint={"every": 1, "keep": 5})
    out = tmp_path / "out"
    assert main([str(spec)]) == 0
    before = {p.name: ckpt.verify(p) for p in ckpt.list_checkpoints(out / "checkpoints")}
    metrics = (out / "metrics.jsonl").read_text()
    capsys.readouterr()

    assert main([str(spec), "--set", "train.seed=7"]) == 2
    err = capsys.readouterr().err
    assert f"the run folder {out} holds another run (checkpoints/, metrics.jsonl, final/)" in err
    assert "--resume" in err and "--overwrite" in err and "Traceback" not in err
    assert {p.name: ckpt.verify(p) for p in ckpt.list_checkpoints(out / "checkpoints")} == before
    assert (out / "metrics.jsonl").read_text() == metrics  # not appended to

    assert main([str(spec), "--set", "train.seed=7", "--overwrite"]) == 0
    err = capsys.readouterr().err
    (aside,) = (out / "overwritten").iterdir()
    assert f"moved to {aside}" in err
    assert (aside / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == sorted(before)
    assert [r["step"] for r in kit.read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert _steps(out / "checkpoints") == [1, 2, 3]


def test_pruning_and_resume_keep_to_the_current_trajectory(tmp_path, write_spec, kit, capsys):
    """A resume from an older checkpoint branches: the branch's steps 4-5 must not be pruned
    because the abandoned line has a step 6, and ``--resume`` must pick the branch's step 5,
    not step 6 of the other line."""
    spec = write_spec(tmp_path, train={"steps": 6}, checkpoint={"every": 3, "keep": 2})
    root = tmp_path / "out" / "checkpoints"
    assert main([str(spec)]) == 0
    assert _steps(root) == [3, 6]
    old = ckpt.load_state(root / "step-000006" / ckpt.STATE)
    capsys.readouterr()

    branch = ["--set", "train.steps=5", "--set", "checkpoint.every=1"]
    assert main([str(spec), *branch, "--resume", str(root / "step-000003")]) == 0
    assert _steps(root) == [3, 4, 5, 6]  # the branch kept its newest two; the other line untouched
    new = ckpt.load_state(root / "step-000005" / ckpt.STATE)
    assert new["trajectory"] != old["trajectory"]
    # One row per step in metrics.jsonl (steps 4-6 of the abandoned line set aside, not lost).
    assert [r["step"] for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in kit.read_metrics(tmp_path / "out" / "metrics.superseded.jsonl")] == [4, 5, 6]
    capsys.readouterr()

    assert main([str(spec), "--set", "train.steps=6", "--set", "checkpoint.every=1", "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"resuming from {root / 'step-000005'} (step 5)" in err
    assert "ignoring 2 checkpoint(s) of another run" in err
    assert ckpt.load_state(root / "step-000006" / ckpt.STATE)["trajectory"] == new["trajectory"]


# --------------------------------------------------------------------------- crashes
FLAKY = '''
import errno, os
import torch
from grpo_core import hookimpl
from grpo_plugins.advantages.grpo import GRPOAdvantage, GRPOOptions

calls = []

def flaky(inputs):
    """GRPO advantages; the third call raises what FLAKY_RAISES names (before the update)."""
    calls.append(1)
    kind = os.environ.get("FLAKY_RAISES", "")
    if len(calls) == 3 and kind:
        raise {
            "oom": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            "disk-full": OSError(errno.ENOSPC, "No space left on device"),
            "bug": ZeroDivisionError("division by zero"),
        }[kind]
    return GRPOAdvantage(GRPOOptions())(inputs)

@hookimpl
def register_advantage_estimators(register):
    register.add("flaky-grpo", flaky)
'''


@pytest.mark.parametrize("kind, shown", [
    ("oom", "OutOfMemoryError: CUDA out of memory"),
    ("disk-full", "No space left on device"),
    ("bug", "ZeroDivisionError: division by zero"),
])
def test_any_exception_before_the_update_checkpoints_the_last_completed_step(
    tmp_path, write_spec, kit, capsys, monkeypatch, kind, shown
):
    (tmp_path / "flaky.py").write_text(FLAKY)
    # The default checkpoint section: no periodic checkpoint in 4 steps.
    spec = write_spec(tmp_path, plugins=["flaky.py"], algorithm={"advantage": {"name": "flaky-grpo"}})
    monkeypatch.setenv("FLAKY_RAISES", kind)
    assert main([str(spec)]) == 1
    err = capsys.readouterr().err
    assert shown in err and "step 3 failed before its update; checkpoint of step 2" in err, err
    (folder,) = ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")
    assert folder.name == "step-000002" and ckpt.verify(folder) is None
    state = ckpt.load_state(folder / ckpt.STATE)
    assert state["step"] == 2 and state["data"]["position"] == 4  # step 3's prompts not consumed
    if kind != "oom":
        return
    monkeypatch.setenv("FLAKY_RAISES", "")
    assert main([str(spec), "--resume"]) == 0
    assert [r["step"] for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert main([str(spec), "--set", "train.output_dir=ref"]) == 0  # the run that never failed
    ref, got = kit.load_weights(tmp_path / "ref" / "final"), kit.load_weights(tmp_path / "out" / "final")
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_the_default_bounds_lost_work_by_steps_and_minutes(tmp_path, write_spec):
    default = CheckpointSection()
    assert default.every == 100 and default.every_minutes == 30
    spec = write_spec(tmp_path, train={"steps": 3}, checkpoint={"every": 0, "every_minutes": 1e-6, "keep": 5})
    assert main([str(spec)]) == 0
    assert _steps(tmp_path / "out" / "checkpoints") == [1, 2, 3]  # the clock was due at every step


GATE = '''
import json, os, time
from pathlib import Path
from grpo_core import hookimpl

def gate(prompts, completions, **kwargs):
    """At the final evaluation (every training step logged), tells the test and waits."""
    folder = Path(os.environ["GATE_DIR"])
    metrics = folder / "out" / "metrics.jsonl"
    rows = metrics.read_text().splitlines() if metrics.exists() else []
    if rows and json.loads(rows[-1])["step"] == 3 and not (folder / "go").exists():
        (folder / "at-final-eval").touch()
        deadline = time.monotonic() + 120
        while not (folder / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return [float(len(c) % 3) for c in completions]

@hookimpl
def register_reward_functions(register):
    register.add("gate", gate)
'''


@pytest.mark.slow
def test_sigterm_during_the_final_evaluation_finishes_saving_and_exits_143(tmp_path, write_spec, child):
    (tmp_path / "gate.py").write_text(GATE)
    spec = write_spec(
        tmp_path, plugins=["gate.py"], rewards=[{"name": "gate"}], train={"steps": 3},
        data={"name": "arithmetic", "train_size": 16, "eval_size": 4}, eval={"at_start": False, "at_end": True},
    )
    proc = child([spec], cwd=tmp_path, env={"GATE_DIR": str(tmp_path)})
    proc.wait_for(lambda: (tmp_path / "at-final-eval").exists(), 150, "the final evaluation")
    proc.signal(signal.SIGTERM)
    proc.wait_for(lambda: "SIGTERM received" in proc.output(), 30, "the signal to be handled")
    (tmp_path / "go").touch()
    assert proc.wait(120) == 143, proc.output()
    out = tmp_path / "out"
    assert (out / "final" / "model.safetensors").exists()
    (folder,) = ckpt.list_checkpoints(out / "checkpoints")
    assert folder.name == "step-000003" and ckpt.verify(folder) is None
    assert "Traceback" not in proc.output()
