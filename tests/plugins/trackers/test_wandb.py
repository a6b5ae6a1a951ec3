"""The ``wandb`` tracker, for real and offline: W&B in offline mode writes its run folder, read back
record by record from the ``.wandb`` file; a resume continues the checkpointed run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from grpo_plugins.trackers.wandb import WandbOptions, WandbTracker

from .conftest import events


def read_wandb_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file: a ``:W&B`` header (7 bytes), then
    LevelDB-log framed records (4-byte checksum, 2-byte length, 1-byte type) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            payload = chunk
        elif kind in (2, 3):  # first / middle fragment
            pending = chunk if kind == 2 else pending + chunk
            continue
        elif kind == 4:
            payload = pending + chunk
        else:
            break
        record = pb.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def _key(item) -> str:
    """A history item's key (W&B writes it as ``key`` or as ``nested_key`` parts)."""
    return item.key or "/".join(item.nested_key)


def finished_records(path: Path, timeout: float = 60.0) -> list:
    """The records once the run's ``exit`` record is on disk: W&B's service process writes
    the file on its own schedule, after ``finish`` has returned."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_wandb_records(path)
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "wb").mkdir()
    return tmp_path / "wb"


def test_wandb_offline_run_folder_holds_params_metrics_table_and_spec(wandb_env, tmp_path):
    spec_file = tmp_path / "spec.resolved.yaml"
    spec_file.write_text("train:\n  lr: 0.001\n", encoding="utf-8")
    tracker = WandbTracker(WandbOptions(mode="offline", project="unit", dir=wandb_env))
    events(tracker, spec_file)
    assert tracker.failures == 0

    (run_dir,) = (wandb_env / "wandb").glob("offline-run-*")
    assert run_dir.name.endswith(tracker.wandb_id)
    records = finished_records(next(run_dir.glob("run-*.wandb")))
    config = {u.key: json.loads(u.value_json) for r in records if r.HasField("config") for u in r.config.update}
    assert config["train.lr"] == 0.001 and config["model.path"] == "tiny"
    history = {}
    for r in records:
        if r.HasField("history"):
            row = {_key(i): json.loads(i.value_json) for i in r.history.item}
            history[row["_step"]] = row
    assert history[1]["reward"] == 0.25 and history[2]["reward"] == 0.75 and history[2]["kl"] == 0.25
    assert history[2]["completions/_type"] == "table-file" and history[2]["completions/nrows"] == 2
    table = json.loads((run_dir / "files" / history[2]["completions/path"]).read_text(encoding="utf-8"))
    assert table["columns"] == ["prompt", "completion", "reward"]
    assert table["data"][0] == ["What is 2 + 3?", "5 | five\nyes", 1.0]
    saved = [f.path for r in records if r.HasField("files") for f in r.files.files]
    assert "spec.resolved.yaml" in saved
    assert (run_dir / "files" / "spec.resolved.yaml").read_text(encoding="utf-8") == "train:\n  lr: 0.001\n"
    (exit_record,) = [r for r in records if r.HasField("exit")]
    assert exit_record.exit.exit_code == 0


def test_wandb_resume_continues_the_checkpointed_run_id(wandb_env, tmp_path):
    first = WandbTracker(WandbOptions(mode="offline", project="unit", dir=wandb_env))
    first.start("run")
    first.log_metrics({"reward": 1.0}, 1)
    state = first.state_dict()
    first.finish("KILLED")
    again = WandbTracker(WandbOptions(mode="offline", project="unit", dir=wandb_env))
    again.load_state_dict(state)
    again.start("run", resume_id="an-mlflow-run-id")  # the engine's id is not W&B's
    again.log_metrics({"reward": 2.0}, 2)
    again.finish("FINISHED")
    assert again.wandb_id == state["id"] and again.failures == 0
    files = sorted((wandb_env / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files and all(f.name == f"run-{state['id']}.wandb" for f in files)
    records = [r for f in files for r in finished_records(f)]
    runs = [r.run.run_id for r in records if r.HasField("run")]
    steps = {int(i.value_json) for r in records if r.HasField("history") for i in r.history.item if _key(i) == "_step"}
    assert set(runs) == {state["id"]} and len(runs) == 2 and steps == {1, 2}
