"""The ``wandb`` and ``tensorboard`` trackers (grpo_plugins.trackers_ext), for real and
offline: W&B in offline mode writes its run folder, read back record by record from the
``.wandb`` file; TensorBoard's event files are read back with its own EventAccumulator."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from grpo_plugins.trackers_ext import (
    TensorBoardOptions,
    TensorBoardTracker,
    WandbOptions,
    WandbTracker,
    markdown_table,
)

from grpo_core.errors import SpecError
from grpo_core.spec import load_spec

ROWS = [
    {"prompt": "What is 2 + 3?", "completion": "5 | five\nyes", "reward": 1.0},
    {"prompt": "What is 2 + 3?", "completion": "6", "reward": 0.0},
]


def _events(tracker, spec_file: Path) -> None:
    """The events a run sends, in a run's order."""
    assert tracker.start("unit-run") is None  # no run id to mix up with MLflow's
    tracker.log_params({"train.lr": 0.001, "model.path": "tiny"})
    tracker.log_artifact(str(spec_file))
    tracker.log_metrics({"reward": 0.25, "kl": 0.5}, 1)
    tracker.log_metrics({"reward": 0.75, "kl": 0.25}, 2)
    tracker.log_table("completions", ROWS, 2)
    tracker.finish("FINISHED")


# --------------------------------------------------------------------------- W&B
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
    _events(tracker, spec_file)
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


# --------------------------------------------------------------------------- TensorBoard
def test_tensorboard_event_files_read_back_with_its_own_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec_file = tmp_path / "spec.resolved.yaml"
    spec_file.write_text("train:\n  lr: 0.001\n", encoding="utf-8")
    tracker = TensorBoardTracker(TensorBoardOptions(log_dir=tmp_path / "tb"))
    _events(tracker, spec_file)
    assert tracker.failures == 0

    acc = EventAccumulator(str(tmp_path / "tb" / "unit-run"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("kl")] == [(1, 0.5), (2, 0.25)]

    def text(tag: str) -> tuple[int, str]:
        (event,) = acc.Tensors(tag)
        return event.step, event.tensor_proto.string_val[0].decode()

    step, table = text("completions/text_summary")
    assert step == 2 and "| prompt | completion | reward |" in table and "5 \\| five<br>yes" in table
    assert "    train:" in text("files/spec.resolved.yaml/text_summary")[1]
    assert "| train.lr | 0.001 |" in text("params/text_summary")[1]
    assert text("status/text_summary")[1] == "FINISHED"


def test_markdown_table_escapes_cells_and_cuts_long_ones():
    table = markdown_table([{"a": "x|y\nz", "b": "w" * 20}], limit=5)
    assert table.splitlines() == ["| a | b |", "|---|---|", "| x\\|y<br>z | wwwww |"]
    assert markdown_table([]) == ""


# --------------------------------------------------------------------------- lean core
@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_a_tracker_without_its_package_fails_validation_naming_the_install(package, monkeypatch, tmp_path):
    # sys.modules[name] = None is Python's own way of making a package absent.
    monkeypatch.setitem(sys.modules, package, None)
    spec = {"model": {"path": "m"}, "rewards": [{"name": "accuracy"}], "tracking": [{"name": package}]}
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    assert f"spec.tracking.0: tracker '{package}' needs the {package} package" in str(err.value)
    assert f"pip install 'grpo-core[{package}]'" in str(err.value)


def test_importing_the_plugins_imports_neither_package():
    import subprocess

    code = ("import sys; from grpo_core.plugin_manager import load_plugins; load_plugins(); "
            "print(sorted(m for m in ('wandb', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
