"""Interrupted runs resume exactly: a real SIGINT/SIGTERM to a real ``grpo-run`` process,
then ``--resume``, gives the same weights (bit for bit) and the same metrics, in the same
MLflow run, as a run that was never interrupted. Corrupt or incomplete checkpoints are
skipped with a message."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main

STEPS = 8
VOLATILE = ("time/", "perf/tokens_per_second")


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _by_step(rows: list[dict]) -> dict[int, dict]:
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"steps logged out of order or more than once: {steps}"
    return {r["step"]: _stable(r) for r in rows}


def _mlflow_run(uri: str, experiment: str):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} in {uri}"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, f"expected one MLflow run, got {len(runs)}"
    return client, runs[0]


def _histories(client, run) -> dict[str, list[tuple[int, float]]]:
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
        if not key.startswith(VOLATILE)
    }


def _same_weights(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, resume_from",
    [(signal.SIGINT, "hint"), (signal.SIGTERM, "path")],
    ids=["SIGINT-resume-latest", "SIGTERM-resume-path"],
)
def test_signal_then_resume_matches_an_uninterrupted_run(
    tmp_path, write_spec, mlflow_db, child, kit, signum, resume_from
):
    sections = {
        "train": {"steps": STEPS, "seed": 3},
        "checkpoint": {"every": 3, "keep": 2},
        "tracking": [{"name": "mlflow", "experiment": "resume", "tracking_uri": "sqlite:///db.sqlite"}],
    }
    # The same spec text in two folders: each run's relative paths land in its own folder.
    straight_dir, broken_dir = tmp_path / "straight", tmp_path / "broken"
    straight_spec = write_spec(straight_dir, **sections)
    broken_spec = write_spec(broken_dir, **sections)
    assert straight_spec.read_text() == broken_spec.read_text()
    straight_uri, broken_uri = mlflow_db(straight_dir), mlflow_db(broken_dir)
    out = broken_dir / "out"

    straight = child([straight_spec], cwd=straight_dir)
    broken = child([broken_spec], cwd=broken_dir)
    broken.wait_for(lambda: kit.last_step(out / "metrics.jsonl") >= STEPS // 2, 150, f"step {STEPS // 2}")
    broken.signal(signum)
    assert broken.wait() == 128 + signum, broken.output()
    err = broken.output()
    assert f"{signal.Signals(signum).name} received" in err
    stopped = re.search(r"stopped at step (\d+); checkpoint (\S+)", err)
    assert stopped, err
    stop_step = int(stopped.group(1))
    assert STEPS // 2 <= stop_step < STEPS, "the signal must land mid-run for this test to mean anything"
    folder = out / "checkpoints" / f"step-{stop_step:06d}"
    assert stopped.group(2) == str(folder)
    assert ckpt.verify(folder) is None
    assert not (out / "final").exists()
    hint = re.search(r"resume with: (.+)", err)
    assert hint, err
    # Nothing after the stop step was logged; every step up to it was, once.
    assert sorted(_by_step(kit.read_metrics(out / "metrics.jsonl"))) == list(range(1, stop_step + 1))

    client, run = _mlflow_run(broken_uri, "resume")
    assert run.info.status == "KILLED"
    run_id = run.info.run_id
    state = torch.load(folder / ckpt.STATE, weights_only=False)
    assert state["run_id"] == run_id and state["step"] == stop_step
    for key in ("optimizer", "scheduler", "rng", "data"):
        assert state[key], key
    assert state["data"]["position"] > 0

    if resume_from == "hint":  # exactly what the message told the user to run
        argv = shlex.split(hint.group(1))
        assert argv[0] == "grpo-run" and argv[-1] == "--resume", argv
        args = argv[1:]
    else:
        args = [broken_spec, "--resume", folder]
    resumed = child(args, cwd=broken_dir)
    assert resumed.wait() == 0, resumed.output()
    assert f"resuming from {folder} (step {stop_step})" in resumed.output()
    assert straight.wait() == 0, straight.output()

    # Bit-identical final weights.
    changed = _same_weights(kit.load_weights(straight_dir / "out" / "final"), kit.load_weights(out / "final"))
    assert changed == []
    # The same metrics, each step exactly once.
    want = _by_step(kit.read_metrics(straight_dir / "out" / "metrics.jsonl"))
    got = _by_step(kit.read_metrics(out / "metrics.jsonl"))
    assert sorted(want) == list(range(1, STEPS + 1))
    assert got == want
    # The same MLflow run, finished, with each step's metrics exactly once and equal.
    client, run = _mlflow_run(broken_uri, "resume")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    ref_client, ref_run = _mlflow_run(straight_uri, "resume")
    got_hist, want_hist = _histories(client, run), _histories(ref_client, ref_run)
    assert want_hist["reward"] and [s for s, _ in want_hist["reward"]] == list(range(1, STEPS + 1))
    assert got_hist == want_hist


def _flip_byte(path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_and_incomplete_checkpoints_are_skipped(tmp_path, write_spec, kit, capsys):
    spec = write_spec(tmp_path, train={"steps": 5}, checkpoint={"every": 1, "keep": 5})
    out = tmp_path / "out"
    assert main([str(spec)]) == 0
    straight_final = kit.load_weights(out / "final")
    straight_rows = _by_step(kit.read_metrics(out / "metrics.jsonl"))
    folders = ckpt.list_checkpoints(out / "checkpoints")
    assert [f.name for f in folders] == [f"step-{i:06d}" for i in range(1, 6)]
    assert all(ckpt.verify(f) is None for f in folders)
    capsys.readouterr()

    _flip_byte(folders[4] / "model" / "model.safetensors")  # step 5: bit rot
    (folders[3] / ckpt.MANIFEST).unlink()  # step 4: a write that never finished
    (folders[2] / ckpt.STATE).write_bytes((folders[2] / ckpt.STATE).read_bytes()[:100])  # step 3: truncated
    assert "checksum" in ckpt.verify(folders[4])
    assert "no manifest" in ckpt.verify(folders[3])
    assert "bytes, expected" in ckpt.verify(folders[2])

    # Naming a corrupt checkpoint is a clear error, not a fallback.
    assert main([str(spec), "--resume", str(folders[4])]) == 1
    err = capsys.readouterr().err
    assert f"--resume {folders[4]}: not a usable checkpoint" in err and "checksum" in err
    assert "Traceback" not in err
    assert main([str(spec), "--resume", str(tmp_path / "nowhere")]) == 1
    assert "no such folder" in capsys.readouterr().err

    # --resume skips the three broken ones, each with a message, and continues from step 2.
    assert main([str(spec), "--resume"]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"skipping checkpoint {re.escape(str(folders[4]))}: .*checksum", err), err
    assert re.search(rf"skipping checkpoint {re.escape(str(folders[3]))}: no manifest", err), err
    assert re.search(rf"skipping checkpoint {re.escape(str(folders[2]))}: .*bytes, expected", err), err
    assert f"resuming from {folders[1]} (step 2)" in err
    # Steps 3-5 were redone exactly: the same weights and the same metrics as the first time.
    assert _same_weights(straight_final, kit.load_weights(out / "final")) == []
    # metrics.jsonl has each step once: the first rows of steps 3-5 were moved aside.
    rows = kit.read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in kit.read_metrics(out / "metrics.superseded.jsonl")] == [3, 4, 5]
    assert {r["step"]: _stable(r) for r in rows[2:]} == {s: straight_rows[s] for s in (3, 4, 5)}
    # The broken folders were rewritten; every checkpoint now verifies; no temporary folder is left.
    assert all(ckpt.verify(f) is None for f in ckpt.list_checkpoints(out / "checkpoints"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{i:06d}" for i in range(1, 6)]


def test_resume_with_no_usable_checkpoint_is_an_error(tmp_path, write_spec, capsys):
    spec = write_spec(tmp_path, train={"steps": 1}, checkpoint={"every": 1})
    assert main([str(spec), "--resume"]) == 1
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and "Traceback" not in err
    assert main([str(spec)]) == 0
    folder = tmp_path / "out" / "checkpoints" / "step-000001"
    (folder / ckpt.MANIFEST).write_text("{not json")
    capsys.readouterr()
    assert main([str(spec), "--resume"]) == 1
    err = capsys.readouterr().err
    assert f"skipping checkpoint {folder}: unreadable manifest" in err and "no usable checkpoint" in err


def test_leftovers_of_a_killed_writer_are_cleaned_up(tmp_path, write_spec, kit, capsys):
    import subprocess

    spec = write_spec(tmp_path, train={"steps": 3}, checkpoint={"every": 1, "keep": 3})
    assert main([str(spec)]) == 0
    root = tmp_path / "out" / "checkpoints"
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead = int(gone.stdout)  # a process that has exited
    # Killed between the two renames of a replacement: step 3 moved aside, its successor complete.
    (root / "step-000003").rename(root / f".step-000003.old-{dead}")
    (root / f".step-000002.tmp-{dead}").mkdir()  # killed mid-write: half a model
    (root / f".step-000002.tmp-{dead}" / "model.safetensors").write_bytes(b"\0" * 1000)
    alive = root / f".step-000001.tmp-{os.getppid()}"  # a live writer's folder is not touched
    alive.mkdir()
    capsys.readouterr()
    assert main([str(spec), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"resuming from {root / 'step-000003'} (step 3)" in err
    assert f"removing {root / f'.step-000002.tmp-{dead}'}, left by an interrupted checkpoint write" in err
    assert sorted(p.name for p in root.iterdir()) == [alive.name, "step-000001", "step-000002", "step-000003"]
    assert all(ckpt.verify(f) is None for f in ckpt.list_checkpoints(root))


def test_a_metrics_row_torn_by_a_crash_does_not_swallow_the_next(tmp_path, write_spec, capsys):
    import json

    spec = write_spec(tmp_path, train={"steps": 3}, checkpoint={"every": 1, "keep": 3})
    assert main([str(spec)]) == 0
    out = tmp_path / "out"
    # Killed while writing step 3's row, before its checkpoint: half a line, no step-3 folder.
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    for folder in (out / "checkpoints" / "step-000003", out / "final"):
        shutil.rmtree(folder)
    assert main([str(spec), "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().err
    text = metrics.read_text().splitlines()
    # The torn row, alone on its line, was moved aside with the resume; every row is whole.
    assert (out / "metrics.superseded.jsonl").read_text().splitlines() == [lines[2][: len(lines[2]) // 2]]
    assert [json.loads(line)["step"] for line in text] == [1, 2, 3]
    assert json.loads(text[2]) == json.loads(lines[2]) | {
        k: v for k, v in json.loads(text[2]).items() if k.startswith(VOLATILE)
    }


def test_a_kill_while_pruning_leaves_no_listed_checkpoint_half_deleted(tmp_path, monkeypatch):
    """Pruning deletes a checkpoint out of the listing: a kill mid-deletion (here, the deletion
    stops after the manifest, as rmtree would when killed) leaves every listed checkpoint whole,
    and the remains are cleaned by the next write. Deleted in place, the remains stayed listed
    without a manifest, so no later prune took them for the run's own (a SIGKILL test found it)."""
    from grpo_core.testing import build_model, build_tokenizer

    model, root = build_model(build_tokenizer()), tmp_path / "checkpoints"
    for step in (1, 2):
        ckpt.write_checkpoint(root, step, model, {"step": step}, keep=5, trajectory="t")
    real_rmtree = shutil.rmtree

    def killed_mid_way(path, ignore_errors=False):
        (Path(path) / ckpt.MANIFEST).unlink()
        raise KeyboardInterrupt  # stands for the kill: nothing after this line of the writer runs

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_mid_way)
    with pytest.raises(KeyboardInterrupt):
        ckpt.write_checkpoint(root, 3, model, {"step": 3}, keep=2, trajectory="t")  # prunes step 1
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    assert [f.name for f in ckpt.list_checkpoints(root)] == ["step-000002", "step-000003"]
    assert all(ckpt.verify(f) is None for f in ckpt.list_checkpoints(root))
    ckpt.write_checkpoint(root, 4, model, {"step": 4}, keep=2, trajectory="t")  # cleans what the kill left
    assert sorted(p.name for p in root.iterdir()) == ["step-000003", "step-000004"]
