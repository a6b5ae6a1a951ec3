"""Sharded checkpoints (``checkpoint.format``): real runs of ``grpo-run --nproc`` (gloo on
CPU) whose processes each write their own shards with ``torch.distributed.checkpoint``, a save
killed half-way, and resumes under other process counts and strategies, compared with the
uninterrupted run's weights and optimizer state."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from grpo_core import checkpoint as ckpt
from grpo_core.errors import SpecError
from grpo_core.spec import load_spec

from .conftest import BASE_SPEC, CHILD_ENV, load_weights, merge

SPEC = {
    "data": {"name": "arithmetic", "train_size": 18, "eval_size": 0},
    "rollout": {"group_size": 2, "max_new_tokens": 4, "prompts_per_generate": 1},
    "algorithm": {"advantage": {"name": "grpo", "std_scope": "batch"}, "kl": {"name": "low_var_kl", "beta": 0.04},
                  "aggregation": {"name": "token-mean"}},
    # 6 prompts: whole groups for 1, 2 and 3 processes
    "train": {"steps": 3, "prompts_per_step": 6, "seed": 3, "parallel": {"strategy": "fsdp2"}},
    "checkpoint": {"every": 1, "keep": 5},
    "eval": {"at_start": False, "at_end": False},
}
#: A plugin file that kills process 1 (SIGKILL, as the out-of-memory killer does) once it has
#: written its shards of step 3, before the checkpoint is complete.
KILLER = """
import os, signal
from grpo_core.train.learner import sharding

_save = sharding.save_shards

def save_shards(model, optimizer, folder, group=None):
    _save(model, optimizer, folder, group)
    if os.environ.get("RANK") == "1" and "step-000003" in str(folder):
        os.kill(os.getpid(), signal.SIGKILL)

sharding.save_shards = save_shards
"""


def _run(cwd: Path, out: str, *args: str, nproc: int = 2, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "grpo_core.cli", "run", "spec.yaml", "--set", f"train.output_dir={out}", *args]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode == 0) == ok, done.stderr[-3000:]
    return done


def _read(folder: Path) -> dict:
    """A sharded checkpoint's whole weights and optimizer state, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder / ckpt.SHARDS, folder.parent / f"{folder.name}.pt")
    return torch.load(folder.parent / f"{folder.name}.pt", weights_only=False)


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a read checkpoint, by a flat name."""
    out = {f"model/{k}": v for k, v in state["model"].items()}
    for name, moments in state["optimizer"]["state"].items():
        out.update({f"optimizer/{name}/{k}": v for k, v in moments.items()})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Under fsdp2 on 2 processes: 3 steps straight; the same run killed while saving step 3,
    resumed on 2 processes; the straight run's step 2 resumed on 1 process and on 3."""
    from grpo_core.testing import save_tiny_model

    root = tmp_path_factory.mktemp("sharded")
    model = save_tiny_model(root / "model")
    spec = merge({"model": {"path": str(model)}, **BASE_SPEC}, SPEC)
    (root / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (root / "killer.py").write_text(KILLER)
    _run(root, "straight")
    killed = _run(root, "killed", "--set", "plugins=[killer.py]", ok=False)
    (root / "killed.err").write_text(killed.stderr)
    shutil.copytree(root / "killed", root / "killed-before")
    _run(root, "killed", "--resume")
    for name in ("to-one", "to-three"):
        shutil.copytree(root / "straight", root / name)
        ckpt.remove_checkpoint(root / name / "checkpoints" / "step-000003")
        shutil.rmtree(root / name / "final")
    _run(root, "to-one", "--resume", "--set", "checkpoint.format=sharded", nproc=1)
    _run(root, "to-three", "--resume", nproc=3)
    return root


@pytest.mark.slow
def test_each_process_writes_its_shards_and_a_resume_under_another_count_reaches_the_same_state(runs):
    step3 = runs / "straight" / "checkpoints" / "step-000003"
    assert ckpt.verify(step3) is None
    shards = sorted(p.name for p in (step3 / ckpt.SHARDS).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (step3 / "model").exists()
    state = ckpt.load_state(step3 / ckpt.STATE)
    assert state["optimizer_format"] == "sharded" and state["optimizer"] is None and state["step"] == 3
    straight = _tensors(_read(step3))
    assert any("exp_avg_sq" in k for k in straight)
    # final/ is a plain save_pretrained model: the step-3 weights
    final = load_weights(runs / "straight" / "final")
    assert all(torch.equal(final[k], straight[f"model/{k}"]) for k in final)
    before = _tensors(_read(runs / "straight" / "checkpoints" / "step-000002"))
    for name in ("to-one", "to-three"):
        resumed = runs / name / "checkpoints" / "step-000003"
        assert ckpt.verify(resumed) is None
        got = _tensors(_read(resumed))
        assert got.keys() == straight.keys()
        assert max(float((got[k] - before[k]).abs().max()) for k in got if "model/" in k) > 1e-4  # step 3 moved
        # Loaded exactly; step 3 then sums the processes' gradients in another order (one process
        # sums all rows at once, three sum three partial sums), a rounding apart, which Adam's
        # normalisation carries into the weights (the tolerance of test_fsdp2's resumes)
        for k in got:
            torch.testing.assert_close(got[k], straight[k], rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")


@pytest.mark.slow
def test_a_save_cut_off_by_a_kill_is_not_taken_and_the_resume_is_bitwise_the_straight_run(runs):
    err = (runs / "killed.err").read_text()
    assert "killed by SIGKILL" in err
    left = runs / "killed-before" / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(left)] == ["step-000001", "step-000002"]
    partial = [p for p in left.iterdir() if p.name.startswith(".step-000003.tmp-")]
    assert len(partial) == 1 and (partial[0] / ckpt.SHARDS / "__1_0.distcp").is_file()  # its shards were written
    assert not (partial[0] / ckpt.MANIFEST).exists()

    resumed = runs / "killed" / "checkpoints"
    assert not [p for p in resumed.iterdir() if p.name.startswith(".")]  # the leftover is removed
    straight = _tensors(_read(runs / "straight" / "checkpoints" / "step-000003"))
    got = _tensors(_read(resumed / "step-000003"))
    assert got.keys() == straight.keys()
    assert [k for k in got if not torch.equal(got[k], straight[k])] == []


def test_checkpoint_format_is_validated_and_refuses_shards_of_an_adapter(tmp_path):
    base = merge(BASE_SPEC, {"model": {"path": "m"}})
    with pytest.raises(SpecError) as exc:
        load_spec(merge(base, {"checkpoint": {"format": "per-process"}}), external_plugins=False, base_dir=tmp_path)
    problems = "\n".join(exc.value.problems)
    assert "checkpoint.format" in problems and "'sharded'" in problems and "'gathered'" in problems
    with pytest.raises(SpecError) as exc:
        load_spec(merge(base, {"checkpoint": {"format": "sharded"}, "model": {"lora": {"r": 4}}}),
                  external_plugins=False, base_dir=tmp_path)
    problems = "\n".join(exc.value.problems)
    assert "checkpoint.format: sharded" in problems and "model.lora" in problems
