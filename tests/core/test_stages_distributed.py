"""Real two-process runs (``grpo-run --nproc 2``, gloo on CPU) of the SFT stage and of a
streamed training split: the SFT stage takes the same steps on two processes as on one (DDP, and
FSDP2 with its optimizer sharded), and a stream's rows are each trained once per epoch over the
two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import CHILD_ENV, load_weights

# A reward that records, on each process, the rows it scores (the `i` column), then scores 0.
RECORDER = '''
import json, os
from grpo_core import hookimpl

def seen(prompts, completions, i, **columns):
    with open(f"seen-{os.environ.get('RANK', '0')}.jsonl", "a") as fh:
        fh.write(json.dumps(sorted(set(i))) + "\\n")
    return [0.0] * len(completions)

@hookimpl
def register_reward_functions(register):
    register.add("seen", seen)
'''


def _grpo_run(args: list, cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "grpo_core.cli", "run", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_sft_on_two_processes_matches_one_and_a_stream_is_read_once_per_epoch(tmp_path, write_spec):
    import datasets

    rows = [{"prompt": f"What is {i} + 2?", "answer": str(i + 2), "i": i} for i in range(16)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "recorder.py").write_text(RECORDER)
    spec = write_spec(
        tmp_path,
        plugins=["recorder.py"],
        data={"name": "hf", "path": "ds", "streaming": True, "shuffle_buffer": 3, "train_size": None,
              "eval_size": None},
        rewards=[{"name": "seen"}],
        # 16 rows, 4 prompts a step: 4 steps are one epoch, 8 are two
        train={"steps": 8, "prompts_per_step": 4, "seed": 1},
        sft={"data": {"name": "arithmetic", "train_size": 16, "eval_size": 4, "solutions": True},
             "completion_column": "solution", "steps": 3, "batch_size": 4, "lr": 1.0e-2, "eval_every": 3},
    )
    for name, extra in (("one", []), ("two", ["--nproc", "2"])):
        folder = tmp_path / name
        folder.mkdir()
        done = _grpo_run([spec, *extra, "--set", f"train.output_dir={folder / 'out'}"], folder)
        assert done.returncode == 0, done.stderr[-3000:]
    # The SFT stage: the same held-out losses and weights (up to float rounding of the summed gradients).
    one = [json.loads(line) for line in (tmp_path / "one" / "out" / "sft" / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(line) for line in (tmp_path / "two" / "out" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in two] == [0, 1, 2, 3]
    for a, b in zip(one, two):
        for key in ("sft/loss", "sft/eval_loss", "sft/tokens"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4), (a["step"], key)
    w1 = load_weights(tmp_path / "one" / "out" / "sft" / "final")
    w2 = load_weights(tmp_path / "two" / "out" / "sft" / "final")
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-4
    # The stream: each process scored its own rows (i % 2 == rank); each epoch (4 steps) every row once.
    two_dir = tmp_path / "two"
    per_rank = [[json.loads(line) for line in (two_dir / f"seen-{rank}.jsonl").read_text().splitlines()]
                for rank in (0, 1)]
    for rank, steps in enumerate(per_rank):
        assert len(steps) == 8 and all(i % 2 == rank for ids in steps for i in ids)
    for epoch in (range(0, 4), range(4, 8)):
        drawn = [i for rank in (0, 1) for s in epoch for i in per_rank[rank][s]]
        assert sorted(drawn) == list(range(16)), drawn


@pytest.mark.slow
def test_sft_sharded_with_fsdp2_on_two_processes_matches_one(tmp_path, write_spec):
    """The SFT stage under FSDP2 (train.parallel.strategy: fsdp2): each process trains half of
    every batch on its shards, and the stage ends at the one-process weights; GRPO goes on from
    them (a sharded KL reference reset to the SFT result)."""
    spec = write_spec(
        tmp_path,
        train={"steps": 1, "prompts_per_step": 2, "seed": 1, "parallel": {"strategy": "fsdp2"}},
        algorithm={"kl": {"beta": 0.04}},
        sft={"data": {"name": "arithmetic", "train_size": 16, "eval_size": 4, "solutions": True},
             "completion_column": "solution", "steps": 3, "batch_size": 4, "micro_batch_size": 1, "lr": 1.0e-2,
             "eval_every": 3},
    )
    for name, extra in (("one", []), ("two", ["--nproc", "2"])):
        folder = tmp_path / name
        folder.mkdir()
        done = _grpo_run([spec, *extra, "--set", f"train.output_dir={folder / 'out'}"], folder)
        assert done.returncode == 0, done.stderr[-3000:]
    rows = {name: [json.loads(line) for line in (tmp_path / name / "out" / "sft" / "metrics.jsonl").read_text()
                   .splitlines()] for name in ("one", "two")}
    assert [r["step"] for r in rows["two"]] == [0, 1, 2, 3]
    for a, b in zip(rows["one"], rows["two"]):
        for key in ("sft/loss", "sft/eval_loss", "sft/tokens", "sft/grad_norm"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4), (a["step"], key)
    w1 = load_weights(tmp_path / "one" / "out" / "sft" / "final")
    w2 = load_weights(tmp_path / "two" / "out" / "sft" / "final")
    assert w1.keys() == w2.keys() and max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-4
    from grpo_core import checkpoint as ckpt

    last = ckpt.list_checkpoints(tmp_path / "two" / "out" / "sft" / "checkpoints")[-1]
    # Under fsdp2 on two processes the SFT stage's checkpoints are written in shards too
    # (checkpoint.format: auto), each process its part of the weights and the optimizer.
    assert ckpt.is_sharded(last) and ckpt.load_state(last / ckpt.STATE)["optimizer_format"] == "sharded"
    grpo = [json.loads(line) for line in (tmp_path / "two" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in grpo] == [1] and "kl" in grpo[0]
