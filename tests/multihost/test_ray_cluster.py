"""The ``ray`` launcher on a real multi-node Ray cluster: the head on host 0 (10.231.0.1) of a
network of namespaces (:mod:`.netns`), workers on hosts 1 and 2 (:mod:`.raycluster`, one cluster
for the module), ``grpo-run --launcher ray`` driven from host 0 as a user on the head node would.

- Two learner ranks spread over two nodes meet at rank 0's node (``MASTER_ADDR``, a port free
  there) over the hosts' own interfaces, and take the steps of the same run on one host
  (``--nproc 2``, test_learners.py's reference) bit for bit.
- A rank killed by SIGKILL on its node ends the run with a named error, and leaves no process
  on any node, no live actor and no placement group.
- A cut link (rank 1's host off the switch mid-step): rank 0 stops within
  ``train.parallel.timeout_s`` with the lost-contact error and the checkpoint of the last
  completed step, intact; the launcher ends the run once Ray declares the node dead, naming it.

The machine's hostname resolves to 127.0.0.1 on every host (as /etc/hosts makes it on many real
machines): the ranks meet only because the launcher binds gloo to the interface that holds each
node's address.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from grpo_core import checkpoint as ckpt

from .netns import made_network, wait_for
from .raycluster import ray_cluster, tagged
from .test_learners import TIMEOUT_S, assert_same_run, ddp_reference, finish, prepare, spec_of, tail  # noqa: F401

ray = pytest.importorskip("ray", reason="the ray launcher's tests need Ray (the test extra installs it)")

# One cluster for the module: its tests go to one xdist worker under --dist loadgroup.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray-cluster")]

RUN_S = 300  # a run of two ranks starting and taking its steps on a loaded machine
HOSTS = ["10.231.0.1", "10.231.0.2", "10.231.0.3"]


@pytest.fixture(scope="module")
def cluster(child_env):
    with made_network(3) as network, ray_cluster(network, env=child_env) as running:
        yield running


def placed(cluster, folder: Path, env: dict[str, str], *args: str, log: str = "driver.log") -> subprocess.Popen:
    """``grpo-run run spec.yaml --launcher ray --nproc 2`` (ranks spread over the nodes) in
    ``folder``, on the head's host."""
    argv = [sys.executable, "-m", "grpo_core.cli", "run", "spec.yaml", "--launcher", "ray", "--nproc", "2",
            "--launcher-option", f"address={cluster.address}", "--launcher-option", "strategy=spread", *args]
    return cluster.network.hosts[0].start(argv, folder / log, env=env, cwd=folder)


def test_ranks_spread_over_two_nodes_take_the_steps_of_the_run_on_one_host(cluster, tmp_path, tiny_model_dir,
                                                                          child_env, ddp_reference):  # noqa: F811
    folder = prepare(tmp_path / "spread", spec_of(tiny_model_dir))
    finish(placed(cluster, folder, child_env), folder / "driver.log", RUN_S)
    # Rank 0 on the driver's node, at MASTER_ADDR; rank 1 on the next node, reaching it from its own address.
    seen = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen == [{"MASTER_ADDR": HOSTS[0], "address": HOSTS[0]}, {"MASTER_ADDR": HOSTS[0], "address": HOSTS[1]}]
    log = tail(folder / "driver.log", 1_000_000)
    assert re.search(rf"\(learner 1 pid=\d+, ip={re.escape(HOSTS[1])}\)", log), log[-3000:]
    assert log.count("grpo-run: finished 3 steps.") == 1
    assert_same_run(folder / "out", ddp_reference)
    state = cluster.state()
    assert state["nodes"] == HOSTS and state["groups"] and set(state["groups"]) == {"REMOVED"}, state


def test_a_rank_killed_on_its_node_ends_the_run_naming_it_and_leaves_nothing_on_any_node(
    cluster, tmp_path, tiny_model_dir, child_env
):
    folder = prepare(tmp_path / "killed", spec_of(tiny_model_dir, steps=60))
    tag = uuid.uuid4().hex
    run = placed(cluster, folder, {**child_env, "GRPO_TEST_TAG": tag})
    log = folder / "driver.log"
    try:
        wait_for(lambda: (folder / "out" / "metrics.jsonl").exists() or run.poll() is not None, RUN_S, "step 1")
    except AssertionError:
        raise AssertionError(tail(log)) from None
    assert run.poll() is None, tail(log)
    ranks = {rank: pid for pid, rank in tagged(tag).items() if rank >= 0}  # not the driver
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGKILL)
    killed_at = time.monotonic()
    assert run.wait(120) == 128 + signal.SIGKILL, tail(log)
    assert time.monotonic() - killed_at < 5 + 30 + 30  # grace, SIGKILL delay, slack
    assert "grpo-run: process 1 was killed by SIGKILL (out of memory, or killed by hand)" in tail(log, 1_000_000)
    assert not tagged(tag)
    state = cluster.state()
    assert set(state["groups"]) == {"REMOVED"} and set(state["actors"]) == {"DEAD"}, state


def test_a_cut_link_stops_the_run_within_the_timeout_with_an_intact_checkpoint(cluster, tmp_path, tiny_model_dir,
                                                                                child_env):
    """Last in the module: the cut-off node leaves the cluster for good."""
    folder = prepare(tmp_path / "cut", spec_of(tiny_model_dir))
    gate = tmp_path / "gate"
    gate.mkdir()
    run = placed(cluster, folder, {**child_env, "GRPO_TEST_GATE": str(gate)})
    log = folder / "driver.log"
    # Step 1 done; rank 1 (host 1) holds in step 2's scoring while rank 0 waits for it in the
    # step's first collective. Then host 1's link goes down, and rank 1 goes on.
    try:
        wait_for(lambda: (gate / "held").exists() or run.poll() is not None, RUN_S, "step 2")
    except AssertionError:
        raise AssertionError(tail(log)) from None
    assert (gate / "held").exists(), tail(log)
    cut = cluster.network.hosts[1]
    cluster.network.cut(cut)
    cut_at = time.monotonic()
    (gate / "open").touch()
    try:
        wait_for(lambda: "lost contact with another process of the run" in tail(log, 1_000_000), TIMEOUT_S + 90,
                 "rank 0's error")
        stopped_after = time.monotonic() - cut_at
        code = run.wait(120)
    except (AssertionError, subprocess.TimeoutExpired):
        raise AssertionError(tail(log)) from None
    finally:
        cluster.network.restore(cut)
    text = tail(log, 1_000_000)
    assert code != 0, text[-3000:]
    # The launcher ends the run once Ray declares the cut-off node dead, and says so.
    assert f"grpo-run: the Ray actor of learner 1 on {HOSTS[1]} is gone" in text, text[-3000:]
    assert f"train.parallel.timeout_s = {TIMEOUT_S} s" in text
    assert "grpo-run: step 2 failed before its update; checkpoint of step 1:" in text, text[-4000:]
    assert stopped_after >= TIMEOUT_S - 1  # it waited out the timeout, not a refused connection
    folders = ckpt.list_checkpoints(folder / "out" / "checkpoints")
    assert [f.name for f in folders] == ["step-000001"] and ckpt.verify(folders[0]) is None
