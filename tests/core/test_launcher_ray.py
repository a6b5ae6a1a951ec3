"""The ``ray`` launcher on a real Ray cluster (one node, CPU), started once for this module with
``ray start --head`` as a user would: two ranks placed by Ray take bitwise the steps of the
``local`` launcher's two, and so do two on a one-node cluster the launcher starts itself (no
process of it left); a rank killed by SIGKILL ends the run with a named error and leaves no
process, actor nor placement group; a request the cluster cannot hold fails within seconds
naming it, on the joined cluster and on one the launcher starts itself."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from grpo_core.launching import free_port

from .conftest import CHILD_ENV, load_weights, tagged_processes

ray = pytest.importorskip("ray", reason="the ray launcher's tests need Ray (the test extra installs it)")

#: One worker runs the module, so the test run starts one Ray head for it, not one per xdist worker.
pytestmark = pytest.mark.xdist_group("ray-launcher")

SPEC = {
    "data": {"name": "arithmetic", "train_size": 8, "eval_size": 0},
    "rollout": {"group_size": 2, "max_new_tokens": 4},
    "algorithm": {"advantage": {"name": "grpo", "std_scope": "batch"}},
    "train": {"steps": 3, "prompts_per_step": 2, "seed": 5},
    "checkpoint": {"every": 0},
}
#: The module's cluster runs without Ray's token authentication (on by default since Ray 2.5x),
#: so that its drivers need no token file; a real cluster's drivers read its token instead.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
LONG = {**SPEC, "train": {"steps": 60, "prompts_per_step": 2, "seed": 5}, "checkpoint": {"every": 0}}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A one-node Ray cluster of 2 CPUs (``ray start --head --block``), its address; stopped
    at the end of the module (SIGTERM to ``ray start``'s own session, which stops what it began)."""
    port, folder = free_port(), tmp_path_factory.mktemp("ray")
    log = (folder / "head.log").open("wb")
    env = {**os.environ, **CHILD_ENV, **RAY_ENV}
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={port}", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false",
         "--object-store-memory=100000000", f"--temp-dir={folder}", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (folder / "head.log").read_text(errors="replace"):
            assert head.poll() is None and time.monotonic() < deadline, (folder / "head.log").read_text()
            time.sleep(0.5)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # what is left of its session
            os.killpg(head.pid, signal.SIGKILL)
        head.wait(30)
        log.close()


def _grpo_run(args: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **CHILD_ENV, **RAY_ENV, **(env or {})}
    full.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "grpo_core.cli", "run", *map(str, args)], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=400)


def _cluster_state(address: str) -> dict:
    """The placement groups' and actors' states on the cluster, read by a fresh driver."""
    program = (f"import json, ray; ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False); "
               "from ray._private import state; "
               "print(json.dumps({'groups': [g['state'] for g in ray.util.placement_group_table().values()], "
               "'actors': [a['State'] for a in state.actors().values()]}))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **RAY_ENV})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_ranks_on_ray_take_bitwise_the_steps_of_two_local_ones(ray_head, tmp_path, write_spec):
    spec = write_spec(tmp_path, **SPEC)
    local = _grpo_run([spec, "--nproc", "2", "--set", "train.output_dir=local"], tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    placed = _grpo_run([spec, "--launcher", "ray", "--nproc", "2", "--launcher-option", f"address={ray_head}",
                        "--set", "train.output_dir=ray"], tmp_path)
    assert placed.returncode == 0, placed.stderr[-3000:]
    # No address: the launcher starts a one-node cluster of its own (address="local", so not the
    # module's head) and stops it after the run; the same steps.
    tag = uuid.uuid4().hex
    own = _grpo_run([spec, "--launcher", "ray", "--nproc", "2", "--launcher-option", "local_cpus=2",
                     "--set", "train.output_dir=own"], tmp_path, env={"GRPO_TEST_TAG": tag})
    assert own.returncode == 0, own.stderr[-3000:]
    deadline = time.monotonic() + 30  # the cluster's processes end shortly after the driver
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not tagged_processes(tag)
    w_local = load_weights(tmp_path / "local" / "final")
    for folder in ("ray", "own"):
        w_ray = load_weights(tmp_path / folder / "final")
        assert w_local.keys() == w_ray.keys()
        assert all(torch.equal(w_local[k], w_ray[k]) for k in w_local), folder
    for done in (placed, own):  # each rank's output reached the driver, prefixed with its role; only rank 0 sums up
        assert "(learner 0 pid=" in done.stderr + done.stdout and "(learner 1 pid=" in done.stderr + done.stdout
        assert (done.stderr + done.stdout).count("grpo-run: finished 3 steps.") == 1
    state = _cluster_state(ray_head)
    assert state["groups"] and set(state["groups"]) == {"REMOVED"}, state


@pytest.mark.slow
def test_a_rank_killed_on_ray_ends_the_run_naming_it_and_leaves_nothing(ray_head, tmp_path, write_spec, child, kit):
    tag = uuid.uuid4().hex
    proc = child(["run", write_spec(tmp_path, **LONG), "--launcher", "ray", "--nproc", "2",
                  "--launcher-option", f"address={ray_head}"],
                 cwd=tmp_path, env={**RAY_ENV, "GRPO_TEST_TAG": tag})
    proc.wait_for(lambda: kit.last_step(tmp_path / "out" / "metrics.jsonl") >= 1, 300, "step 1")
    ranks = {rank: pid for pid, rank in tagged_processes(tag).items() if rank >= 0}
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGKILL)
    killed_at = time.monotonic()
    assert proc.wait(120) == 128 + signal.SIGKILL, proc.output()[-3000:]
    assert time.monotonic() - killed_at < 5 + 30 + 30  # grace, SIGKILL delay, slack
    assert "grpo-run: process 1 was killed by SIGKILL (out of memory, or killed by hand)" in proc.output()
    assert not tagged_processes(tag)
    state = _cluster_state(ray_head)
    assert set(state["groups"]) == {"REMOVED"} and set(state["actors"]) == {"DEAD"}, state


@pytest.mark.slow
def test_sigint_to_the_ray_driver_reaches_each_rank_once_and_they_checkpoint(ray_head, tmp_path, write_spec, child,
                                                                            kit):
    from grpo_core import checkpoint as ckpt

    tag = uuid.uuid4().hex
    proc = child(["run", write_spec(tmp_path, **LONG), "--launcher", "ray", "--nproc", "2",
                  "--launcher-option", f"address={ray_head}"], cwd=tmp_path, env={**RAY_ENV, "GRPO_TEST_TAG": tag})
    proc.wait_for(lambda: kit.last_step(tmp_path / "out" / "metrics.jsonl") >= 1, 300, "step 1")
    proc.signal(signal.SIGINT)
    assert proc.wait(120) == 130, proc.output()[-3000:]
    assert proc.output().count("stopped at step") == 1, proc.output()[-3000:]
    (folder,) = ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")
    assert ckpt.verify(folder) is None
    assert not tagged_processes(tag)


@pytest.mark.slow
def test_a_request_the_cluster_cannot_hold_fails_within_seconds_naming_it(ray_head, tmp_path, write_spec):
    spec = write_spec(tmp_path, **SPEC)
    started = time.monotonic()
    done = _grpo_run([spec, "--launcher", "ray", "--nproc", "2", "--launcher-option", f"address={ray_head}",
                      "--launcher-option", "gpus_per_rank=1"], tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert ("one learner process asks for 1 GPUs, and no node has that many: the most a node of the cluster "
            "has free is 0 (1 node(s))") in done.stderr
    # On a cluster the launcher starts itself (no address), sized by local_cpus: the same refusal.
    done = _grpo_run([spec, "--launcher", "ray", "--nproc", "2", "--launcher-option", "local_cpus=1"], tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "2 learner process(es) of 1 CPUs each need 2 CPUs; the cluster has 1 free over 1 node(s)" in done.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))
