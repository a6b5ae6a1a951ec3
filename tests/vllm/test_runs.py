"""``grpo-run`` with ``rollout.name: vllm`` on a real vLLM engine, in real subprocesses.

Every run checks its weight pushes by log-probs: at each step the rollout correction logs
``rollout_correction/logp_diff/max``, the largest ``|logp_trainer - logp_sampler|`` over the
step's completion tokens, where the sampler is the engine (holding the weights pushed after
the previous update) and the trainer the policy being updated. A push that missed the
engine's compute would leave it sampling with older weights: the updates here (lr 1e-2)
move a token's log-prob by far more than the tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_core.testing import save_tiny_model

from .conftest import HIDDEN

pytestmark = pytest.mark.vllm

GAP = 1e-4  # float32 engine and trainer: sampler/trainer log-prob gap of any token, any step
ENGINE = {"name": "vllm", "dtype": "float32", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 32}
SPEC: dict[str, Any] = {
    "data": {"name": "arithmetic", "train_size": 16, "eval_size": 0},
    "rollout": {"group_size": 4, "max_new_tokens": 6, **ENGINE},
    "rewards": [{"name": "accuracy"}, {"name": "format", "pattern": "^\\s*\\d+", "weight": 0.5}],
    "train": {"steps": 2, "prompts_per_step": 2, "lr": 1.0e-2, "progress": False, "threads": 1,
              "log_completions_every": 0, "seed": 0, "output_dir": "out"},
    "eval": {"at_start": False, "at_end": False},
    "tracking": [],
}
CHILD_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
             "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("vllm-model") / "model", hidden_size=HIDDEN)


def write_spec(folder: Path, model_dir: Path, **changes: Any) -> Path:
    spec = json.loads(json.dumps(SPEC))
    spec["model"] = {"path": str(model_dir)}
    for section, values in changes.items():
        spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


def grpo_run(args: list, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # set by an in-process engine of this pytest process
    done = subprocess.run([sys.executable, "-m", "grpo_core.cli", "run", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def step_rows(out: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "rollout_correction/logp_diff/max" in r]


def assert_pushes_reached_the_engine(out: Path, steps: list[int]) -> None:
    rows = step_rows(out)
    assert [r["step"] for r in rows] == steps
    for row in rows:
        assert row["rollout_correction/logp_diff/max"] <= GAP, (row["step"], row["rollout_correction/logp_diff/max"])
        assert row["completions/mean_length"] > 0


def max_change(out: Path, model_dir: Path) -> float:
    from safetensors.torch import load_file

    after, before = load_file(out / "final" / "model.safetensors"), load_file(model_dir / "model.safetensors")
    return max(float((after[k].float() - before[k].float()).abs().max()) for k in before)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_dir) -> Path:
    """Three steps, a checkpoint after each."""
    folder = tmp_path_factory.mktemp("vllm-run")
    spec = write_spec(folder, model_dir, train={"steps": 3}, checkpoint={"every": 1, "keep": 3})
    done = grpo_run([spec], folder)
    (folder / "stderr.txt").write_text(done.stderr, encoding="utf-8")
    return folder


def test_a_finished_run_ends_without_a_traceback(trained):
    """vLLM's own shutdown destroys the process group it made in a one-process run; the
    engine leaves that group to it (it printed ``ValueError: Invalid process group
    specified`` after "finished" when the engine destroyed it first)."""
    stderr = (trained / "stderr.txt").read_text(encoding="utf-8")
    assert "grpo-run: finished 3 steps" in stderr
    assert "Traceback" not in stderr and "Invalid process group" not in stderr, stderr[-3000:]


def test_a_training_run_pushes_every_update_into_the_engine(trained, model_dir):
    assert_pushes_reached_the_engine(trained / "out", [1, 2, 3])
    assert max_change(trained / "out", model_dir) > 1e-2  # the updates moved the weights


def test_a_resumed_runs_engine_holds_the_resumed_weights(trained):
    """The engine is built from the checkpoint's base model and gets the resumed weights by
    the push after loading: without it, step 4 would sample with the untrained weights."""
    done = grpo_run([trained / "spec.yaml", "--set", "train.steps=5", "--resume"], trained)
    assert "resuming from" in done.stderr and "(step 3)" in done.stderr
    rows = step_rows(trained / "out")
    assert [r["step"] for r in rows][-2:] == [4, 5]
    assert all(r["rollout_correction/logp_diff/max"] <= GAP for r in rows[-2:]), rows[-2:]


COUNTDOWN = """
from grpo_core import hookimpl
from grpo_core.contracts import Observation


class Countdown:
    tools = []
    stop = (" ",)  # a turn ends at a space

    def reset(self, row):
        return {"turns": 0}

    def step(self, state, text):
        state["turns"] += 1
        if state["turns"] >= 2:
            return Observation(done=True, reward=float(len(text)))
        return Observation(messages=[{"role": "user", "content": "go on"}])


@hookimpl
def register_environments(register):
    register.add("countdown", Countdown())
"""


def test_a_multi_turn_lora_run_pushes_the_adapter(tmp_path, model_dir):
    """Two-turn episodes (the engine generates each turn after the environment's message)
    with a LoRA policy: each push is the adapter alone (lora_push: auto), and the sampler's
    log-probs of the model's tokens match the trainer's at every step."""
    (tmp_path / "countdown.py").write_text(COUNTDOWN)
    spec = write_spec(
        tmp_path, model_dir,
        model={"path": str(model_dir), "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        plugins=["countdown.py"],
        rollout={"environment": {"name": "countdown", "max_turns": 3, "max_total_tokens": 48}},
        rewards=[{"name": "env_reward"}],
        train={"lr": 5.0e-2},
    )
    grpo_run([spec], tmp_path)
    assert_pushes_reached_the_engine(tmp_path / "out", [1, 2])
    for row in step_rows(tmp_path / "out"):
        assert row["env/turns_per_episode"] == 2.0 and row["env/env_tokens"] > 0


LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"]}


def test_a_lora_run_pushes_adapters_across_a_resume(tmp_path, model_dir):
    """A LoRA policy with lora_push: auto: the engine gets the base weights at setup and the
    adapter alone after each update, and samples with the trainer's log-probs at every step,
    before and after a resume (which builds a new engine, pushes the base, then the resumed
    adapter). Each push's bytes are logged: the adapter's, far below the merged push of the
    same run with lora_push: merged (whose log-probs match the trainer's as well)."""
    runs = {}
    for push in ("auto", "merged"):
        folder = tmp_path / push
        spec = write_spec(folder, model_dir, model={"path": str(model_dir), "lora": LORA},
                          rollout={"lora_push": push}, train={"steps": 3, "lr": 5.0e-2},
                          checkpoint={"every": 1, "keep": 3})
        grpo_run([spec], folder)
        runs[push] = folder
    done = grpo_run([runs["auto"] / "spec.yaml", "--set", "train.steps=5", "--resume"], runs["auto"])
    assert "(step 3)" in done.stderr
    for push, steps in (("auto", 5), ("merged", 3)):
        rows = [json.loads(line) for line in (runs[push] / "out" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "sync/push_bytes" in r]
        assert [r["step"] for r in rows] == list(range(1, steps + 1))
        # a step with nothing to train (every advantage 0) logs no correction: the others do
        checked = [r["step"] for r in rows if "rollout_correction/logp_diff/max" in r]
        assert min(checked) <= 3 and (push == "merged" or max(checked) > 3), checked
        assert all(r["rollout_correction/logp_diff/max"] <= GAP for r in rows if r["step"] in checked), rows
        runs[push] = [r["sync/push_bytes"] for r in rows]
    adapter, merged = runs["auto"], runs["merged"]
    print(f"bytes per push: adapter {adapter}, merged {merged}")
    assert len(set(adapter)) == 1 and len(set(merged)) == 1 and adapter[0] < merged[0] / 10


@pytest.mark.parametrize(("strategy", "tp"), [("ddp", 1), ("fsdp2", 2)])
def test_two_processes_each_push_into_their_engine(tmp_path, model_dir, strategy, tp):
    """``--nproc 2``. ddp: one engine per process (data parallel), each loaded by its own
    push. fsdp2 with ``tensor_parallel_size: 2``: one engine split over both processes, each
    holding half of it; the push first gathers the sharded policy (every process takes part)
    and each process loads its half of every weight. The split engine's shared-memory segments
    are gone after the run (their fixed names would make the next such run fail)."""
    shm = Path("/dev/shm")
    before = {p.name for p in shm.glob("*-cpushm_*")}
    spec = write_spec(tmp_path, model_dir, train={"parallel": {"strategy": strategy}},
                      rollout={"tensor_parallel_size": tp})
    grpo_run([spec, "--nproc", "2"], tmp_path, timeout=300)
    assert_pushes_reached_the_engine(tmp_path / "out", [1, 2])
    assert max_change(tmp_path / "out", model_dir) > 1e-2
    assert {p.name for p in shm.glob("*-cpushm_*")} <= before


def test_an_asynchronous_run_samples_each_batch_from_the_version_its_staleness_says(tmp_path, model_dir):
    """rollout.max_staleness: 1 with the engine in the actor's thread. The weights crossing
    through the snapshot are well formed (with lr 1e-12, below float32 resolution, every version is the same policy: the
    engine matches the trainer at every step), and with updates a batch sampled at the
    learner's own version (staleness 0: the first step, and the step after the evaluation at
    step 2 restarted the pipeline with the current weights) matches the trainer, while one
    sampled a version earlier does not (the rollout correction sees the lag)."""
    still = write_spec(tmp_path / "still", model_dir, rollout={"max_staleness": 1}, train={"steps": 3, "lr": 1.0e-12})
    grpo_run([still], tmp_path / "still")
    rows = step_rows(tmp_path / "still" / "out")
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    assert all(r["rollout_correction/logp_diff/max"] <= GAP for r in rows), rows

    moving = write_spec(tmp_path / "moving", model_dir, rollout={"max_staleness": 1}, train={"steps": 4},
                        data={"eval_size": 2}, eval={"every": 2, "at_start": False, "at_end": False})
    grpo_run([moving], tmp_path / "moving")
    out = tmp_path / "moving" / "out"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["async/staleness"] for r in rows if "async/staleness" in r] == [0, 1, 0, 1]
    # a step whose advantages are all 0 takes no forward, so logs no gap: check those that do
    gaps = {r["step"]: (r["async/staleness"], r["rollout_correction/logp_diff/max"]) for r in step_rows(out)}
    assert 3 in gaps and any(staleness == 1 for staleness, _ in gaps.values()), gaps
    for step, (staleness, gap) in gaps.items():
        assert (gap <= GAP) if staleness == 0 else (gap > 1e-3), (step, gap)
