"""Training rows that stream (hf with ``streaming: true``, a ``datasets.IterableDataset``, a
generator of rows): each row drawn once per epoch over the processes, through a seeded shuffle
buffer, and a resume continues from the exact row."""

from __future__ import annotations

import json
import re
import signal

import pytest
import torch
import yaml

from grpo_core import checkpoint as ckpt
from grpo_core.contracts import RowStream
from grpo_core.errors import RunError, SpecError
from grpo_core.spec import load_spec
from grpo_core.spec.data import DataSlot
from grpo_core.testing import build_tokenizer
from grpo_core.train.actor.stream import StreamingPromptSource

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "i": i} for i in range(23)]


def _source(rank=0, world=1, rows=ROWS, buffer=5, shuffle=True, seed=3):
    slot = DataSlot(shuffle=shuffle, shuffle_buffer=buffer)
    stream = RowStream(lambda: iter(rows), "test rows")
    return StreamingPromptSource(stream, build_tokenizer(), slot, seed=seed, max_tokens=64, rank=rank, world=world,
                                 buffer_size=buffer)


def _ids(prompts) -> list[int]:
    return [p.row["i"] for p in prompts]


def test_each_row_is_drawn_once_per_epoch_over_two_processes():
    rows = ROWS[:22]  # 11 per process
    ranks = [_source(rank, 2, rows) for rank in (0, 1)]
    epochs = []
    for _ in range(2):
        drawn = [_ids(source.next(11)) for source in ranks]
        assert set(drawn[0]).isdisjoint(drawn[1])
        assert sorted(drawn[0] + drawn[1]) == list(range(22))  # every row once, over the two processes
        assert all(i % 2 == rank for rank, ids in enumerate(drawn) for i in ids)  # row i is process i % 2's
        epochs.append(drawn)
    assert epochs[0] != epochs[1]  # each epoch is shuffled anew
    assert epochs[0][0] != sorted(epochs[0][0])  # and shuffled at all


def test_without_shuffle_the_rows_come_in_stream_order():
    assert _ids(_source(shuffle=False).next(25)) == list(range(23)) + [0, 1]


@pytest.mark.parametrize("after", [0, 3, 12, 23, 30])
def test_a_restored_source_draws_what_the_uninterrupted_one_does(after):
    straight = _source()
    straight.next(after)
    state = straight.state_dict()
    want = _ids(straight.next(30))
    # through a checkpoint file, as a resume reads it (plain data only)
    path = ckpt.STATE
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        torch.save({"data": state}, Path(folder) / path)
        loaded = ckpt.load_state(Path(folder) / path)["data"]
    resumed = _source()
    resumed.load_state_dict(loaded)
    assert _ids(resumed.next(30)) == want


def test_restoring_the_current_state_reads_nothing_again():
    opened = []

    def rows():
        opened.append(1)
        return iter(ROWS)

    source = StreamingPromptSource(RowStream(rows, "rows"), build_tokenizer(), DataSlot(), seed=0, max_tokens=64,
                                   buffer_size=4)
    source.next(3)
    source.load_state_dict(source.state_dict())  # what the loop does around an evaluation
    source.next(3)
    assert len(opened) == 1


def test_a_generator_holds_one_epoch_and_says_so():
    stream = RowStream.of((dict(r) for r in ROWS[:4]), "train_dataset")
    source = StreamingPromptSource(stream, build_tokenizer(), DataSlot(), seed=0, max_tokens=64, buffer_size=2)
    assert sorted(_ids(source.next(4))) == [0, 1, 2, 3]
    with pytest.raises(RunError, match="is a generator, read once"):
        source.next(1)


# --------------------------------------------------------------------------- a run
def _saved_dataset(folder):
    import datasets

    path = folder / "ds"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"prompt": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(40)]),
        "test": datasets.Dataset.from_list([{"prompt": f"What is {i} + 3?", "answer": str(i + 3)} for i in range(4)]),
    }).save_to_disk(str(path))
    return path


STREAMED = {
    "data": {"name": "hf", "path": "ds", "eval_split": "test", "streaming": True, "shuffle_buffer": 8,
             "train_size": None, "eval_size": None},  # None: drop the arithmetic options of the base spec
    "train": {"steps": 6, "seed": 2},
    "checkpoint": {"every": 1, "keep": 2},
    "rewards": [{"name": "accuracy"}],
}


def test_hf_streaming_reads_a_saved_dataset_lazily(tmp_path):
    from grpo_plugins.datasets import HFDataset, HFOptions

    path = _saved_dataset(tmp_path)
    dataset = HFDataset(HFOptions(path=str(path), eval_split="test", streaming=True))
    stream = dataset.load("train")
    assert isinstance(stream, RowStream)
    assert [r["answer"] for r in stream.open()][:3] == ["2", "3", "4"] and len(list(stream.open())) == 40
    assert len(dataset.load("eval")) == 4  # held-out rows stay in memory


def test_a_streamed_run_resumes_at_the_exact_row(tmp_path, write_spec, child, kit):
    """A real grpo-run streaming a saved dataset, SIGTERM mid-epoch, --resume: the same rows are
    drawn (the completions table's prompts) and the same weights come out as without the stop."""
    runs = {}
    for name in ("straight", "broken"):
        folder = tmp_path / name
        folder.mkdir()
        _saved_dataset(folder)
        runs[name] = (folder, write_spec(folder, **STREAMED, eval={"at_start": False, "at_end": False}))
    straight = child([runs["straight"][1]], cwd=runs["straight"][0])
    folder, spec = runs["broken"]
    broken = child([spec], cwd=folder)
    broken.wait_for(lambda: kit.last_step(folder / "out" / "metrics.jsonl") >= 2, 300, "step 2")
    broken.signal(signal.SIGTERM)
    assert broken.wait() == 143, broken.output()
    stopped = kit.last_step(folder / "out" / "metrics.jsonl")
    assert 2 <= stopped < 6
    state = torch.load(ckpt.step_folder(folder / "out" / "checkpoints", stopped) / ckpt.STATE, weights_only=False)
    assert state["data"]["stream"] and state["data"]["read"] > 0 and state["data"]["buffer"]
    resumed = child([spec, "--resume"], cwd=folder)
    assert resumed.wait(300) == 0, resumed.output()
    assert straight.wait(300) == 0, straight.output()
    a, b = kit.load_weights(runs["straight"][0] / "out" / "final"), kit.load_weights(folder / "out" / "final")
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    want = {r["step"]: r.get("reward") for r in kit.read_metrics(runs["straight"][0] / "out" / "metrics.jsonl")}
    got = {r["step"]: r.get("reward") for r in kit.read_metrics(folder / "out" / "metrics.jsonl")}
    assert got == want


def test_a_streamed_split_refuses_a_sampler_by_name_at_validation(tmp_path, write_spec, capsys):
    """``grpo-run validate`` refuses it (exit 2, a spec error at its path), as the run would."""
    from grpo_core.cli import main

    _saved_dataset(tmp_path)
    spec = write_spec(tmp_path, **{**STREAMED, "data": {**STREAMED["data"], "sampler": {"name": "curriculum"}}})
    assert main(["validate", str(spec)]) == 2
    assert re.search(r"spec\.data\.sampler \(line \d+\): dataset 'hf' streams its training rows.*data.sampler "
                     r"'curriculum' draws rows by index.*set data.streaming: false", capsys.readouterr().err)


def test_a_streamed_split_refuses_a_mixture_at_validation(tmp_path, write_spec):
    _saved_dataset(tmp_path)
    more = {"name": "arithmetic", "source": "sums"}
    spec = write_spec(tmp_path, **{**STREAMED, "data": {**STREAMED["data"], "more_sources": [more],
                                                        "source_column": "source", "source": "saved"}})
    with pytest.raises(SpecError, match=r"spec.data.more_sources .*a mixture \(data.more_sources\) joins rows in "
                                        r"memory: drop data.more_sources, or set data.streaming: false"):
        load_spec(spec)


def test_the_python_trainer_streams_an_iterable_dataset(tmp_path, write_spec):
    import datasets

    from grpo_core import Trainer

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(12)]
    iterable = datasets.Dataset.from_list(rows).to_iterable_dataset()
    spec = write_spec(tmp_path, train={"steps": 3})
    trainer = Trainer(spec, train_dataset=iterable, overrides={"data.shuffle_buffer": 4})
    assert trainer.train().status == "finished"
    record = json.loads((trainer.run_dir / "python_objects.json").read_text())
    assert record["dataset"]["python"]["rows"] == "stream"
    # A function that returns a new iterator each epoch streams too (6 steps x 2 prompts: two epochs).
    trainer = Trainer(write_spec(tmp_path / "fn", train={"steps": 6}), train_dataset=lambda: iter(rows[:6]))
    assert trainer.train().status == "finished"
    assert yaml.safe_load((trainer.run_dir / "spec.resolved.yaml").read_text())["data"]["name"] == "python"


# --------------------------------------------------------------------------- files that stream
FILE_ROWS = [{"prompt": f"What is {i} + 2?", "answer": str(i + 2), "i": i} for i in range(40)]


def _write_file(folder, fmt: str, rows=FILE_ROWS):
    """``rows`` as a file of ``fmt`` (jsonl, json, csv, parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / f"train.{fmt}"
    if fmt in ("jsonl", "json"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "csv":
        path.write_text("prompt,answer,i\n" + "".join(f"\"{r['prompt']}\",{r['answer']},{r['i']}\n" for r in rows),
                        encoding="utf-8")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_a_file_streams_and_a_restored_source_draws_what_the_uninterrupted_one_does(tmp_path, fmt):
    from grpo_plugins.datasets import FileDataset, FileOptions

    train = _write_file(tmp_path, fmt)
    (tmp_path / "held").mkdir()
    evals = _write_file(tmp_path / "held", fmt, FILE_ROWS[:3])
    dataset = FileDataset(FileOptions(train=str(train), eval=str(evals), streaming=True))
    stream = dataset.load("train")
    assert isinstance(stream, RowStream)
    assert [int(r["i"]) for r in stream.open()] == list(range(40))  # every row, in the file's order
    assert isinstance(dataset.load("eval"), list) and len(dataset.load("eval")) == 3  # held-out rows in memory

    def source():
        return StreamingPromptSource(FileDataset(FileOptions(train=str(train), streaming=True)).load("train"),
                                     build_tokenizer(), DataSlot(shuffle_buffer=7), seed=4, max_tokens=64,
                                     buffer_size=7)

    straight = source()
    straight.next(17)
    state = straight.state_dict()
    want = [int(p.row["i"]) for p in straight.next(40)]  # the rest of epoch 0, then into epoch 1
    resumed = source()  # a new process: the file opened again, the rows read skipped
    resumed.load_state_dict(state)
    assert [int(p.row["i"]) for p in resumed.next(40)] == want


def test_a_file_that_streams_names_itself_when_a_row_cannot_be_read(tmp_path):
    from grpo_plugins.datasets import FileDataset, FileOptions

    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n', encoding="utf-8")
    stream = FileDataset(FileOptions(train=str(path), streaming=True)).load("train")
    with pytest.raises(RunError, match=f"could not read dataset file {path} as json"):
        list(stream.open())


def test_a_streamed_file_refuses_a_sampler_naming_its_streaming_option(tmp_path, write_spec):
    _write_file(tmp_path, "jsonl")
    spec = write_spec(tmp_path, data={"name": "file", "train": "train.jsonl", "streaming": True,
                                      "sampler": {"name": "curriculum"}, "train_size": None, "eval_size": None},
                      rewards=[{"name": "accuracy"}])
    with pytest.raises(SpecError, match="data.sampler 'curriculum' draws rows by index.*data.streaming: false"):
        load_spec(spec)  # refused at validation


def test_a_run_streaming_a_file_resumes_at_the_exact_row(tmp_path, write_spec, kit):
    """A real run streaming a JSON Lines file: 2 steps, then resumed to 5, ends with the weights
    and rewards of the run that took the 5 steps at once (the stream's position and buffer are
    in the checkpoint)."""
    from grpo_core.cli import main

    _write_file(tmp_path, "jsonl")
    spec = write_spec(tmp_path, data={"name": "file", "train": "train.jsonl", "streaming": True, "shuffle_buffer": 6,
                                      "train_size": None, "eval_size": None},
                      rewards=[{"name": "accuracy"}], train={"steps": 5, "seed": 2, "progress": False},
                      eval={"at_start": False, "at_end": False}, checkpoint={"every": 1, "keep": 2},
                      tracking=[])
    assert main([str(spec), "--set", "train.output_dir=straight"]) == 0
    assert main([str(spec), "--set", "train.output_dir=broken", "--set", "train.steps=2"]) == 0
    state = torch.load(ckpt.step_folder(tmp_path / "broken" / "checkpoints", 2) / ckpt.STATE, weights_only=False)
    assert state["data"]["stream"] and state["data"]["read"] > 0
    assert main([str(spec), "--set", "train.output_dir=broken", "--resume"]) == 0
    a, b = kit.load_weights(tmp_path / "straight" / "final"), kit.load_weights(tmp_path / "broken" / "final")
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    want = {r["step"]: r.get("reward") for r in kit.read_metrics(tmp_path / "straight" / "metrics.jsonl")}
    got = {r["step"]: r.get("reward") for r in kit.read_metrics(tmp_path / "broken" / "metrics.jsonl")}
    assert got == want and sorted(want) == [1, 2, 3, 4, 5]


def test_a_streamed_file_in_a_mixture_is_refused_by_its_place(tmp_path, write_spec):
    _write_file(tmp_path, "jsonl")
    more = {"name": "file", "train": "train.jsonl", "streaming": True, "source": "files"}
    spec = write_spec(tmp_path, data={"more_sources": [more], "source_column": "source", "source": "sums",
                                      "sampler": {"name": "mixture", "weights": {"sums": 1, "files": 1}}},
                      rewards=[{"name": "accuracy"}])
    with pytest.raises(SpecError, match=r"spec.data.more_sources.0.streaming \(line \d+\): dataset 'file' would "
                                        r"stream .*set its streaming: false"):
        load_spec(spec)
