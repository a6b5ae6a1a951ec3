"""Runs never cross (issue 26, items 8-10): a live run holds a lock on its folder (a second
launch, a real ``grpo-run`` subprocess, exits 2 naming its pid and host; a SIGKILLed run
leaves no stale lock); a checkpoint write never replaces another trajectory's step; each
fresh run gets its own TensorBoard run and ``--overwrite`` moves ``environment.json`` aside;
a fixed KL beta comes from the spec on ``--resume``."""

from __future__ import annotations

import json
import socket

import pytest

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main
from grpo_core.errors import UsageError
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner.kl import KLTerm


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


# --------------------------------------------------------------------------- the lock
def _holder_pid(out) -> int | None:
    try:
        return json.loads((out / "run.lock").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def test_a_second_launch_on_a_live_run_exits_2_and_a_sigkilled_run_leaves_no_lock(tmp_path, write_spec, child, kit):
    spec = write_spec(tmp_path, train={"steps": 100_000})
    out = tmp_path / "out"
    first = child([spec])
    first.wait_for(lambda: (out / "metrics.jsonl").is_file() and kit.last_step(out / "metrics.jsonl") >= 1,
                   timeout=240, what="the first run to log a step")

    second = child([spec, "--overwrite", "--set", "train.steps=1"])  # --overwrite would move the live run aside
    assert second.wait(240) == 2, second.output()
    assert _holder_pid(out) == first.proc.pid
    err = second.output()
    host = socket.gethostname()
    assert f"the run folder {out} is in use by a live run: pid {first.proc.pid} on host {host} (since " in err
    assert "Traceback" not in err
    assert not (out / "overwritten").exists() and first.proc.poll() is None  # nothing moved, the first runs on
    resumed = child([spec, "--resume"])  # a resume is refused too: it would write the same steps
    assert resumed.wait(240) == 2 and f"pid {first.proc.pid}" in resumed.output()

    first.kill()  # SIGKILL: no handler runs, the kernel drops the lock with the process
    assert first.proc.returncode == -9
    third = child([spec, "--overwrite", "--set", "train.steps=1"])
    assert third.wait(240) == 0, third.output()
    assert (out / "overwritten").is_dir()
    assert [r["step"] for r in kit.read_metrics(out / "metrics.jsonl")] == [1]


def test_the_lock_is_held_while_the_block_runs_and_released_after(tmp_path):
    from grpo_core.runlock import LOCK_FILE, hold_run_folder

    folder = tmp_path / "run"
    with hold_run_folder(folder):
        info = json.loads((folder / LOCK_FILE).read_text())
        assert info["host"] == socket.gethostname() and isinstance(info["pid"], int)
        with pytest.raises(UsageError, match=rf"the run folder {folder} is in use by a live run: pid \d+ on host"):
            with hold_run_folder(folder):  # another open file description: refused, even in this process
                pass
    with hold_run_folder(folder):  # released: taken again
        pass


# --------------------------------------------------------------------------- trajectories
def test_a_checkpoint_write_never_replaces_another_trajectorys_step(tmp_path, capsys):
    model = build_model(build_tokenizer())
    root = tmp_path / "checkpoints"
    theirs = ckpt.write_checkpoint(root, 3, model, {"step": 3, "who": "theirs"}, keep=5, trajectory="theirs")
    mine = ckpt.write_checkpoint(root, 3, model, {"step": 3, "who": "mine"}, keep=5, trajectory="mine")
    assert mine == theirs == root / "step-000003"
    assert ckpt.load_state(mine / ckpt.STATE)["who"] == "mine"
    aside = root / "superseded" / "step-000003-theirs"
    assert ckpt.verify(aside) is None and ckpt.load_state(aside / ckpt.STATE)["who"] == "theirs"
    assert f"belongs to another line of steps (trajectory theirs); moved to {aside}" in capsys.readouterr().err
    again = ckpt.write_checkpoint(root, 3, model, {"step": 3, "who": "mine, again"}, keep=5, trajectory="mine")
    assert ckpt.load_state(again / ckpt.STATE)["who"] == "mine, again"  # its own step: replaced in place
    assert [p.name for p in (root / "superseded").iterdir()] == ["step-000003-theirs"]
    assert ckpt.list_checkpoints(root) == [again]
    broken = ckpt.write_checkpoint(root, 4, model, {"step": 4}, keep=5, trajectory="theirs")
    (broken / ckpt.STATE).write_bytes(b"torn")  # a corrupt checkpoint of another line is replaced, not kept
    ckpt.write_checkpoint(root, 4, model, {"step": 4, "who": "mine"}, keep=5, trajectory="mine")
    assert [p.name for p in (root / "superseded").iterdir()] == ["step-000003-theirs"]
    assert ckpt.load_state(broken / ckpt.STATE)["who"] == "mine"


# --------------------------------------------------------------------------- TensorBoard and --overwrite
def _tb_rewards(folder) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars("reward")]


def test_each_fresh_run_gets_its_own_tensorboard_run_and_overwrite_moves_environment_json(
    tmp_path, write_spec, capsys
):
    spec = write_spec(tmp_path, tracking=[{"name": "tensorboard", "log_dir": "tb", "flush_secs": 1}],
                      train={"steps": 2}, checkpoint={"every": 1})
    out = tmp_path / "out"
    assert main([str(spec)]) == 0
    first_env = (out / "environment.json").read_text()
    assert main([str(spec), "--overwrite"]) == 0
    runs = sorted((tmp_path / "tb").iterdir())
    assert [_tb_rewards(r) for r in runs] == [[1, 2], [1, 2]]  # not 1, 2, 1, 2 in one run
    assert len(runs) == 2 and runs[0].name == "spec" and runs[1].name.startswith("spec-")
    (aside,) = (out / "overwritten").iterdir()
    assert (aside / "environment.json").read_text() == first_env  # moved aside with the other run files

    assert main([str(spec), "--resume", "--set", "train.steps=3"]) == 0  # a resume continues its own
    assert sorted((tmp_path / "tb").iterdir()) == runs
    assert [_tb_rewards(r) for r in runs] == [[1, 2], [1, 2, 3]]


# --------------------------------------------------------------------------- beta on resume
def test_a_fixed_beta_comes_from_the_spec_on_resume_and_an_overridden_lr_is_reported(tmp_path, write_spec, kit,
                                                                                      capsys):
    spec = write_spec(tmp_path, algorithm={"kl": {"beta": 0.04}}, train={"steps": 2}, checkpoint={"every": 1})
    assert main([str(spec)]) == 0
    capsys.readouterr()
    assert main([str(spec), "--resume", "--set", "train.steps=3", "--set", "algorithm.kl.beta=0.5"]) == 0
    rows = {r["step"]: r for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl")}
    assert [rows[s]["kl/beta"] for s in (1, 2, 3)] == [0.04, 0.04, 0.5]
    assert "is not used" not in capsys.readouterr().err  # nothing else changed: nothing to report

    assert main([str(spec), "--resume", "--set", "train.steps=4", "--set", "train.lr=0.5"]) == 0
    assert ("grpo-run: --resume: train.lr = 0.5 is not used: the optimizer and its schedule continue from the "
            "checkpoint's learning rate 0.01" in capsys.readouterr().err)


def test_an_adaptive_beta_is_state_and_a_changed_start_value_is_reported(capsys):
    adaptive = type("Adaptive", (), {"target": 0.1, "horizon": 100})()
    saved = KLTerm(estimator=None, beta=0.04, adaptive=adaptive)
    saved.beta = 0.031  # where the controller had taken it
    resumed = KLTerm(estimator=None, beta=0.5, adaptive=adaptive)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.beta == 0.031
    assert ("the adaptive KL controller continues from the checkpoint's beta 0.031, not algorithm.kl.beta = 0.5"
            in capsys.readouterr().err)
    fixed = KLTerm(estimator=None, beta=0.5)
    fixed.load_state_dict(saved.state_dict())
    assert fixed.beta == 0.5 and capsys.readouterr().err == ""


def test_a_refused_launch_leaves_no_folder_it_created_and_a_used_folder_keeps_its_lock_file(tmp_path):
    from grpo_core.runlock import LOCK_FILE, hold_run_folder

    fresh = tmp_path / "fresh"
    with pytest.raises(UsageError, match="bad usage"):
        with hold_run_folder(fresh):
            raise UsageError("bad usage")  # refused before writing anything
    assert not fresh.exists()
    used = tmp_path / "used"
    with hold_run_folder(used):
        (used / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in used.iterdir()) == sorted([LOCK_FILE, "metrics.jsonl"])
