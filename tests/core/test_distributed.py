"""Data-parallel training: real multi-process runs (torchrun, gloo on CPU) against one
process, and the pieces of :mod:`grpo_core.train.distributed` that need no process group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from grpo_core import checkpoint as ckpt
from grpo_core.errors import RunError
from grpo_core.train.distributed import Dist, lost_contact, lost_contact_message, pad_cat, reduction

from .conftest import CHILD_ENV, load_weights, merge, read_metrics

# A spec where every part of the step that processes must agree on is exercised: per-prompt
# seeded sampling (so the completions do not depend on the process count), batch-scoped
# advantage statistics (gathered over processes), the KL in the loss (a reference model on
# every process), a token-mean aggregator (its normalizer summed over processes), and
# held-out evaluation split between processes.
DIST_SPEC = {
    "data": {"name": "arithmetic", "train_size": 16, "eval_size": 6},
    "rollout": {"group_size": 4, "max_new_tokens": 6, "prompts_per_generate": 1},
    "algorithm": {
        "advantage": {"name": "grpo", "std_scope": "batch"},
        "kl": {"name": "low_var_kl", "beta": 0.04},
        "aggregation": {"name": "token-mean"},
    },
    "train": {"steps": 2, "prompts_per_step": 4, "seed": 3},
    "checkpoint": {"every": 1, "keep": 5},
    "eval": {"at_start": True, "at_end": True, "n": 2},
}


def _grpo_run(args: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "grpo_core.cli", "run", *map(str, args)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


STABLE = ("loss", "kl", "grad_norm", "reward", "rewards/format/mean", "advantage/abs_max",
          "policy/ratio", "train/updates", "eval/reward", "eval/rewards/format", "eval/prompts")


@pytest.mark.slow
def test_two_processes_take_the_same_steps_as_one_and_resume_with_either(tmp_path, write_spec):
    spec = write_spec(tmp_path, **DIST_SPEC)
    base = load_weights(Path(yaml.safe_load(spec.read_text())["model"]["path"]))

    one = _grpo_run([spec, "--set", "train.output_dir=one"], tmp_path)
    assert one.returncode == 0, one.stderr
    two = _grpo_run([spec, "--nproc", "2", "--set", "train.output_dir=two"], tmp_path)
    assert two.returncode == 0, two.stderr

    # The same weights after the run, to float tolerance (sums in another order), and the
    # update moved them far more than that.
    w1, w2 = load_weights(tmp_path / "one" / "final"), load_weights(tmp_path / "two" / "final")
    assert _max_diff(w1, base) > 1e-3
    assert _max_diff(w1, w2) < 5e-5

    # Only the main process logged: one row per step (plus the two evaluations), and the
    # figures, summed or gathered over processes, are those of the single process.
    rows1, rows2 = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in rows2] == [r["step"] for r in rows1] == [0, 1, 2, 2]
    for r1, r2 in zip(rows1, rows2):
        for key in STABLE:
            if key in r1:
                assert r2[key] == pytest.approx(r1[key], rel=1e-3, abs=1e-6), (r1["step"], key)
    assert rows2[0]["eval/prompts"] == 6  # both halves of the held-out set were scored
    # Sampled evaluation gathers every process's samples (each process seeds its own share,
    # so the draw, unlike the greedy figures, depends on the number of processes).
    for row in (rows2[0], rows2[-1]):
        assert 0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= 1 and row["eval/sampled/mean_length"] > 0
    assert two.stderr.count("grpo-run: finished 2 steps.") == 1  # the summary, from the main process

    # A checkpoint written by two processes resumes in one, and the other way round, and
    # the runs go on as the single-process run does.
    folders = ckpt.list_checkpoints(tmp_path / "two" / "checkpoints")
    assert [f.name for f in folders] == ["step-000001", "step-000002"]
    assert all(ckpt.verify(f) is None for f in folders)
    longer = ["--set", "train.steps=3"]
    straight = _grpo_run([spec, "--set", "train.output_dir=one", *longer, "--resume"], tmp_path)
    assert straight.returncode == 0, straight.stderr
    to_one = _grpo_run([spec, "--set", "train.output_dir=two", *longer, "--resume"], tmp_path)
    assert to_one.returncode == 0, to_one.stderr
    assert "resuming from" in to_one.stderr and "(step 2)" in to_one.stderr
    assert _max_diff(load_weights(tmp_path / "one" / "final"), load_weights(tmp_path / "two" / "final")) < 5e-5

    back = _grpo_run([spec, "--set", "train.output_dir=one", "--set", "train.steps=4", "--resume"], tmp_path)
    assert back.returncode == 0, back.stderr
    to_two = _grpo_run(
        [spec, "--nproc", "2", "--set", "train.output_dir=two", "--set", "train.steps=4", "--resume"], tmp_path
    )
    assert to_two.returncode == 0, to_two.stderr
    assert _max_diff(load_weights(tmp_path / "one" / "final"), load_weights(tmp_path / "two" / "final")) < 5e-5


@pytest.mark.slow
def test_a_batch_that_does_not_split_into_whole_groups_is_refused(tmp_path, write_spec):
    spec = write_spec(tmp_path, **{**DIST_SPEC, "train": {"steps": 1, "prompts_per_step": 3}})
    out = _grpo_run([spec, "--nproc", "2"], tmp_path)
    assert out.returncode == 1
    assert out.stderr.count("train.prompts_per_step = 3 is not a multiple of the 2 processes") == 1
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "out").exists()  # refused before any process started


@pytest.mark.slow
def test_a_failing_process_stops_all_with_its_message(tmp_path, write_spec):
    """A reward function that raises on one process only: every process stops at that
    step with the same message (no process is left waiting in a collective)."""
    (tmp_path / "flaky.py").write_text(
        "import os\n"
        "from grpo_core import hookimpl\n"
        "def flaky(prompts, completions, **kw):\n"
        "    if os.environ.get('RANK') == '1':\n"
        "        raise ValueError('rank one cannot score')\n"
        "    return [1.0] * len(completions)\n"
        "@hookimpl\n"
        "def register_reward_functions(register):\n"
        "    register.add('flaky', flaky)\n",
        encoding="utf-8",
    )
    spec = write_spec(tmp_path, **{**DIST_SPEC, "plugins": ["flaky.py"], "rewards": [{"name": "flaky"}]})
    out = _grpo_run([spec, "--nproc", "2"], tmp_path, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "reward function 'flaky' raised" in out.stderr and "rank one cannot score" in out.stderr
    assert out.stderr.count("grpo-run: error:") == 2  # each process stops with the message
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------- no process group
def test_single_process_dist_is_the_identity():
    dist = Dist()
    assert not dist.active and dist.is_main
    assert dist.shard_bounds(6) == (0, 6)
    assert dist.sum_floats([1, 2.5]) == [1.0, 2.5]
    assert dist.gather({"a": 1}) == [{"a": 1}]
    metrics = {"loss": 0.5, "time/step": 1.0}
    assert dist.combine_metrics(metrics) is metrics
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    dist.sum_grads([p])
    assert torch.equal(p.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize(("rank", "bounds"), [(0, (0, 3)), (1, (3, 6))])
def test_shards_are_contiguous_whole_groups(rank, bounds):
    assert Dist(rank=rank, world=2).shard_bounds(6) == bounds
    with pytest.raises(RunError, match=r"train.prompts_per_step = 5 is not a multiple of the 2 processes"):
        Dist(rank=rank, world=2).shard_bounds(5)


def test_a_failed_collective_is_told_apart_from_other_errors():
    """What gloo and torch.distributed raise when another process is gone or unreachable
    (the messages of PyTorch 2.13: tests/multihost makes them for real); not a bug's error."""
    import torch.distributed as dist

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                        "waiting 10000ms for recv operation to complete")
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1")
    for exc in (gloo, closed, dist.DistNetworkError("The client socket has timed out"), dist.DistBackendError("x")):
        assert lost_contact(exc), exc
    for exc in (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError("gloo"), RunError("NCCL")):
        assert not lost_contact(exc), exc
    message = lost_contact_message(gloo, 20.0)
    assert message.startswith("lost contact with another process of the run: a collective of the process "
                              "group failed ([/pytorch/third_party/gloo")
    assert "train.parallel.timeout_s = 20 s" in message and "--resume" in message
    assert len(lost_contact_message(RuntimeError("gloo/transport " + "x" * 5000), 1.0)) < 600


def test_pad_cat_pads_the_token_dimension_of_each_part():
    a = torch.ones(2, 3)
    b = torch.full((1, 5), 2.0)
    out = pad_cat([a, b], 0.0)
    assert out.shape == (3, 5)
    assert torch.equal(out[:2, :3], a) and bool((out[:2, 3:] == 0).all())
    assert torch.equal(out[2], b[0])
    m = pad_cat([torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)], False)
    assert m.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert torch.equal(pad_cat([torch.arange(2), torch.arange(3)]), torch.tensor([0, 1, 0, 1, 2]))


def test_combine_metrics_rules():
    class Two(Dist):  # two processes' metrics, without a process group
        def gather(self, obj):
            return [obj, {"loss": 3.0, "time/step": 5.0, "completions/max_length": 9.0,
                          "completions/min_length": 1.0, "reward/failed": 2.0, "perf/tokens_per_second": 10.0}]

    out = Two(rank=0, world=2).combine_metrics(
        {"loss": 1.0, "time/step": 2.0, "completions/max_length": 4.0, "completions/min_length": 3.0,
         "reward/failed": 1.0, "perf/tokens_per_second": 30.0}
    )
    assert out == {"loss": 2.0, "time/step": 5.0, "completions/max_length": 9.0, "completions/min_length": 1.0,
                   "reward/failed": 3.0, "perf/tokens_per_second": 40.0}


def test_metric_reductions_are_declared_not_guessed_from_substrings():
    """A user reward called ``max_len`` (or ``min_steps``) is a mean like any reward; only
    declared names, ``/max``, ``/min`` suffixes and ``time/`` are reduced otherwise."""
    class Two(Dist):
        def gather(self, obj):
            return [obj, {"rewards/max_len/mean": 3.0, "rewards/min_steps/mean": 3.0,
                          "rollout_correction/logp_diff/max": 0.5, "policy/ratio/min": 0.25}]

    out = Two(rank=0, world=2).combine_metrics({"rewards/max_len/mean": 1.0, "rewards/min_steps/mean": 1.0,
                                                "rollout_correction/logp_diff/max": 2.0, "policy/ratio/min": 0.75})
    assert out == {"rewards/max_len/mean": 2.0, "rewards/min_steps/mean": 2.0,
                   "rollout_correction/logp_diff/max": 2.0, "policy/ratio/min": 0.25}
    assert [reduction(k) for k in ("advantage/abs_max", "time/generate", "loss", "frac_max_like")] == [
        "max", "max", "mean", "mean"]


@pytest.mark.slow
def test_sigint_to_the_launcher_stops_every_process_with_one_checkpoint(tmp_path, write_spec, child, kit):
    """SIGINT to `grpo-run --nproc 2`: both processes stop after the same step, the main one
    writes one checkpoint, the run exits 130, and `--resume` on two processes finishes it."""
    import signal

    spec = write_spec(tmp_path, **{**DIST_SPEC, "train": {"steps": 40, "prompts_per_step": 4, "seed": 3},
                                   "checkpoint": {"every": 0}, "eval": {"at_start": False, "at_end": False}})
    proc = child([spec, "--nproc", "2"], cwd=tmp_path)
    proc.wait_for(lambda: kit.last_step(tmp_path / "out" / "metrics.jsonl") >= 2, 150, "step 2")
    proc.signal(signal.SIGINT)
    assert proc.wait(120) == 130, proc.output()
    log = proc.output()
    assert log.count("stopped at step") == 1 and "resume with:" in log, log
    folders = ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")
    assert len(folders) == 1 and ckpt.verify(folders[0]) is None
    stopped = int(folders[0].name[5:])
    assert 2 <= stopped < 40
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, stopped + 1))  # one row per step: main only
    done = _grpo_run([spec, "--nproc", "2", "--set", f"train.steps={stopped + 1}", "--resume"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"(step {stopped})" in done.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")][-1] == stopped + 1


@pytest.mark.slow
def test_dynamic_sampling_on_two_processes_fills_each_share_and_counts_every_group(tmp_path, write_spec):
    """Each process keeps its share (P/2) of groups with a spread; the rounds stop for both
    at once; the logged counts are summed over processes."""
    algorithm = {**DIST_SPEC["algorithm"], "dynamic_sampling": {"max_rounds": 3}}
    spec = write_spec(tmp_path, **{**DIST_SPEC, "eval": {"at_start": False, "at_end": False}, "algorithm": algorithm})
    two = _grpo_run([spec, "--nproc", "2", "--set", "train.output_dir=two"], tmp_path)
    assert two.returncode == 0, two.stderr
    rows = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        rounds = r["dynamic_sampling/rounds"]
        assert rounds in (1.0, 2.0, 3.0)
        assert r["dynamic_sampling/groups_kept"] + r["dynamic_sampling/groups_filled"] == 4
        assert r["dynamic_sampling/prompts_consumed"] == 4 * rounds
        assert r["dynamic_sampling/groups_dropped"] == 4 * rounds - 4
        if r["dynamic_sampling/groups_filled"]:
            assert rounds == 3.0


# --------------------------------------------------------------------------- processes that die
def _children(pid: int) -> dict[int, int]:
    """``{child pid: its RANK}`` of the live processes whose parent is ``pid``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), -1)
            out[int(entry.name)] = rank
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has exited


LONG = {**DIST_SPEC, "train": {"steps": 40, "prompts_per_step": 4, "seed": 3},
        "checkpoint": {"every": 0}, "eval": {"at_start": False, "at_end": False}}


def _started(proc, kit, tmp_path) -> dict[int, int]:
    proc.wait_for(lambda: kit.last_step(tmp_path / "out" / "metrics.jsonl") >= 1, 150, "step 1")
    ranks = _children(proc.proc.pid)
    assert sorted(ranks.values()) == [0, 1], ranks
    return ranks


@pytest.mark.slow
def test_a_killed_process_stops_the_others_and_the_launcher_fails(tmp_path, write_spec, child, kit):
    """SIGKILL to rank 1 (what the out-of-memory killer does): the launcher names it, stops
    rank 0 within a bounded time, and exits 137; no process is left."""
    import signal
    import time

    bound = 5 + 30 + 30  # the launcher's grace and SIGKILL delays, plus slack for a busy machine
    proc = child([write_spec(tmp_path, **LONG), "--nproc", "2"], cwd=tmp_path)
    ranks = _started(proc, kit, tmp_path)
    victim = next(pid for pid, rank in ranks.items() if rank == 1)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    assert proc.wait(bound) == 128 + signal.SIGKILL, proc.output()
    assert time.monotonic() - killed_at < bound
    assert "grpo-run: process 1 was killed by SIGKILL (out of memory, or killed by hand)" in proc.output()
    assert not any(_alive(pid) for pid in ranks)


@pytest.mark.slow
def test_sigterm_to_the_launcher_exits_143_with_one_checkpoint(tmp_path, write_spec, child, kit):
    import signal

    proc = child([write_spec(tmp_path, **LONG), "--nproc", "2"], cwd=tmp_path)
    _started(proc, kit, tmp_path)
    proc.signal(signal.SIGTERM)
    assert proc.wait(120) == 143, proc.output()
    assert proc.output().count("stopped at step") == 1
    (folder,) = ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")
    assert ckpt.verify(folder) is None


@pytest.mark.slow
def test_no_process_outlives_a_killed_launcher(tmp_path, write_spec, child, kit):
    """SIGKILL to the launcher (it cannot pass anything on): the kernel sends each process
    SIGTERM (PR_SET_PDEATHSIG), and they stop together with a checkpoint."""
    import signal
    import time

    proc = child([write_spec(tmp_path, **LONG), "--nproc", "2"], cwd=tmp_path)
    ranks = _started(proc, kit, tmp_path)
    proc.signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 120
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in ranks), proc.output()
    assert proc.output().count("stopped at step") == 1, proc.output()  # the children share the log
    (folder,) = ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")
    assert ckpt.verify(folder) is None


@pytest.mark.slow
def test_a_greedy_baseline_estimator_takes_the_same_steps_on_two_processes_as_on_one(tmp_path, write_spec):
    """remax: each process generates and scores the greedy completions of its own prompts, and
    the baseline scores are gathered with the rest of the estimator's inputs."""
    spec = write_spec(tmp_path, **merge(DIST_SPEC, {"algorithm": {"advantage": {"name": "remax", "std_scope": None}},
                                                    "checkpoint": None, "eval": {"at_start": False,
                                                                                 "at_end": False}}))
    base = load_weights(Path(yaml.safe_load(spec.read_text())["model"]["path"]))
    one = _grpo_run([spec, "--set", "train.output_dir=one"], tmp_path)
    assert one.returncode == 0, one.stderr
    two = _grpo_run([spec, "--nproc", "2", "--set", "train.output_dir=two"], tmp_path)
    assert two.returncode == 0, two.stderr
    w1, w2 = load_weights(tmp_path / "one" / "final"), load_weights(tmp_path / "two" / "final")
    assert _max_diff(w1, base) > 1e-3 and _max_diff(w1, w2) < 5e-5
    rows1, rows2 = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in rows1] == [r["step"] for r in rows2] == [1, 2]
    for r1, r2 in zip(rows1, rows2):
        assert "time/baseline" in r1 and "time/baseline" in r2
        for key in ("loss", "reward", "advantage/abs_max"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-3, abs=1e-6), (r1["step"], key)


_EXIT_PROBE = """
import atexit, sys
from grpo_core.cli import app as cli


class Finalized:
    def __del__(self):
        print("finalized", flush=True)


KEEP = Finalized()  # deleted with the module, during interpreter finalization
atexit.register(lambda: print("exit handlers ran", flush=True))
def main():
    print("run done", end="")  # unflushed: the exit must flush it
    sys.stderr.write("err line")
    return 3
cli.main = main
cli._entry()
"""


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_process_of_a_multi_process_run_leaves_without_finalization_after_flushing(world):
    """DDP's reducer keeps the gloo group's threads alive past ``destroy_process_group``; a
    process of a several-process run therefore skips interpreter finalization (where a gloo
    thread can abort it), but only after its exit handlers ran and its output is flushed,
    with main's code. A single process exits normally."""
    env = {**os.environ, **CHILD_ENV, "WORLD_SIZE": world}
    done = subprocess.run([sys.executable, "-c", _EXIT_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stdout.startswith("run done")
    assert "err line" in done.stderr
    assert "exit handlers ran" in done.stdout
    assert ("finalized" in done.stdout) == (world == "1")
