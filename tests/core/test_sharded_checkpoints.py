"""Sharded checkpoints (``checkpoint.format``): a real run of ``grpo-run --nproc 2`` under fsdp2
(gloo on CPU) whose processes each write their own shards with ``torch.distributed.checkpoint``,
killed while saving, then resumed on 2 processes and on 3, compared with the uninterrupted run's
weights and optimizer state. ``test_fsdp2.py`` resumes a sharded checkpoint on one process and
under ddp, and a gathered one under fsdp2."""

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
    "data": {"name": "arithmetic", "train_size": 12, "eval_size": 0},
    "rollout": {"group_size": 2, "max_new_tokens": 4, "prompts_per_generate": 1},
    "algorithm": {"advantage": {"name": "grpo", "std_scope": "batch"}, "kl": {"name": "low_var_kl", "beta": 0.0},
                  "aggregation": {"name": "token-mean"}},
    # 6 prompts: whole groups for 1, 2 and 3 processes
    "train": {"steps": 2, "prompts_per_step": 6, "seed": 3, "parallel": {"strategy": "fsdp2"}},
    "checkpoint": {"every": 1, "keep": 5},
}
#: A plugin file that kills process 1 (SIGKILL, as the out-of-memory killer does) once every
#: process has written its shards of step 2 (and the main one their metadata), before the
#: checkpoint is complete: the latest moment a kill can cut a save off.
KILLER = """
import os, signal
from grpo_core.train.learner import sharding

_save = sharding.save_shards

def save_shards(model, optimizer, folder, group=None):
    _save(model, optimizer, folder, group)
    if os.environ.get("RANK") == "1" and "step-000002" in str(folder):
        os.kill(os.getpid(), signal.SIGKILL)

sharding.save_shards = save_shards
"""


def _run(cwd: Path, out: str, *args: str, nproc: int = 2, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "grpo_core.cli", "run", "spec.yaml", "--set", f"train.output_dir={out}",
               "--nproc", str(nproc), *args]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode == 0) == ok, done.stderr[-3000:]
    return done


def _read(shards: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint's ``shards/`` (whole weights and optimizer state),
    read in this process, by a flat name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = shards.parent / "whole.pt"
    dcp_to_torch_save(shards, whole)
    state = torch.load(whole, weights_only=False)
    whole.unlink()
    out = {f"model/{k}": v for k, v in state["model"].items()}
    for name, moments in state["optimizer"]["state"].items():
        out.update({f"optimizer/{name}/{k}": v for k, v in moments.items()})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Under fsdp2 on 2 processes, 2 steps, process 1 killed while the checkpoint of step 2 is
    written (``killed/``: the folder as the kill left it); then its step 1 resumed on 2
    processes (``run/``) and on 3 (``to-three/``)."""
    from grpo_core.testing import save_tiny_model

    root = tmp_path_factory.mktemp("sharded")
    model = save_tiny_model(root / "model")
    spec = merge({"model": {"path": str(model)}, **BASE_SPEC}, SPEC)
    (root / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (root / "killer.py").write_text(KILLER)
    killed = _run(root, "run", "--set", "plugins=[killer.py]", ok=False)
    (root / "killed.err").write_text(killed.stderr)
    for name in ("killed", "to-three"):
        shutil.copytree(root / "run", root / name)
    _run(root, "run", "--resume")
    _run(root, "to-three", "--resume", nproc=3)
    return root


def _partial(root: Path) -> Path:
    """The temporary folder of the save the kill cut off."""
    found = [p for p in (root / "killed" / "checkpoints").iterdir() if p.name.startswith(".step-000002.tmp-")]
    assert len(found) == 1
    return found[0]


@pytest.mark.slow
def test_a_save_cut_off_by_a_kill_is_not_taken_and_the_resume_is_bitwise_the_straight_run(runs):
    assert "process 1 was killed by SIGKILL" in (runs / "killed.err").read_text()
    assert [p.name for p in ckpt.list_checkpoints(runs / "killed" / "checkpoints")] == ["step-000001"]
    partial = _partial(runs)
    assert sorted(p.name for p in (partial / ckpt.SHARDS).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (partial / ckpt.MANIFEST).exists() and not (partial / ckpt.STATE).exists()
    # The cut-off save's shards are whole (the kill came after them): they are the state of
    # the run that was not interrupted until after its step 2.
    straight = _read(partial / ckpt.SHARDS)
    assert any("exp_avg_sq" in k for k in straight)

    resumed = runs / "run" / "checkpoints"
    assert not [p for p in resumed.iterdir() if p.name.startswith(".")]  # the leftover is removed
    step2 = resumed / "step-000002"
    assert ckpt.verify(step2) is None and not (step2 / "model").exists()
    assert sorted(p.name for p in (step2 / ckpt.SHARDS).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    state = ckpt.load_state(step2 / ckpt.STATE)
    assert state["optimizer_format"] == "sharded" and state["optimizer"] is None and state["step"] == 2
    got = _read(step2 / ckpt.SHARDS)
    assert got.keys() == straight.keys()
    assert [k for k in got if not torch.equal(got[k], straight[k])] == []
    final = load_weights(runs / "run" / "final")  # final/ is a plain save_pretrained model
    assert all(torch.equal(final[k], straight[f"model/{k}"]) for k in final)


@pytest.mark.slow
def test_a_sharded_checkpoint_of_two_processes_resumes_on_three_to_the_same_state(runs):
    straight = _read(_partial(runs) / ckpt.SHARDS)
    before = _read(runs / "killed" / "checkpoints" / "step-000001" / ckpt.SHARDS)
    step2 = runs / "to-three" / "checkpoints" / "step-000002"
    assert ckpt.verify(step2) is None
    assert sorted(p.name for p in (step2 / ckpt.SHARDS).glob("__*")) == [f"__{r}_0.distcp" for r in range(3)]
    got = _read(step2 / ckpt.SHARDS)
    assert got.keys() == straight.keys()
    assert max(float((got[k] - before[k]).abs().max()) for k in got if "model/" in k) > 1e-4  # step 2 moved
    # The shards of 2 processes are loaded into 3 (other, uneven bounds); step 2 then sums three
    # processes' gradients instead of two, a rounding apart, which Adam's normalisation carries
    # into the weights (the tolerance of test_fsdp2's resumes)
    for k in got:
        torch.testing.assert_close(got[k], straight[k], rtol=1e-4, atol=2e-5, msg=k)


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


def test_one_process_writes_every_shard_and_reads_them_back_into_a_fresh_model(tmp_path):
    from grpo_core.testing import build_model, build_tokenizer
    from grpo_core.train.learner import sharding

    tokenizer = build_tokenizer()
    model, fresh = build_model(tokenizer, seed=1), build_model(tokenizer, seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    sharding.save_shards(model, optimizer, tmp_path / "shards")
    blank = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sharding.load_shards(fresh, blank, tmp_path / "shards")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    for p, q in zip(model.parameters(), fresh.parameters()):
        saved, loaded = optimizer.state[p], blank.state[q]
        assert all(torch.equal(saved[k], loaded[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
