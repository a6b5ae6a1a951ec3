"""The ``ray`` launcher places a rollout server (``grpo-run serve``, a real vLLM) and two
learner ranks, from a spec that names no URL: the two steps, weight pushes included, equal bit
for bit the same run wired by hand (a server started by hand, its URL in ``rollout.urls``,
``--nproc 2``), and no process of it is left: on a real three-node cluster in network namespaces
(tests/multihost/raycluster.py: the head on 10.231.0.1, workers on .2 and .3), the ranks spread
over the first two nodes and the server on the third, its weights pushed across the hosts. (A
cluster the launcher starts itself is tests/core/test_launcher_ray.py's, without a server: the
one-node run with a server that was here took four minutes of the test run for a combination
whose two halves are each proved.)

The rollout correction weighs nothing here (``level: off``, a rejection band no push can
leave): the sampler's log-probs of a batch depend in their last bits on how the server batched
the requests, the completions do not; its ``logp_diff/max`` still shows each push arrived.
Ray comes with the test extra, as it does into this environment (``tests/vllm/run.sh``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from grpo_core.testing import save_tiny_model

from ..multihost.netns import made_network
from ..multihost.raycluster import ray_cluster, tagged
from .conftest import HIDDEN
from .test_runs import CHILD_ENV, GAP, max_change, step_rows
from .test_servers import SECRET, Server, run, write_spec

pytestmark = pytest.mark.vllm

#: Without Ray's token authentication (on by default since Ray 2.5x) on the cluster the launcher
#: starts, as in tests/core/test_launcher_ray.py.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--", "--max-num-seqs", "32"]
START_S = 600  # a vLLM server's start on two shared cores, however busy
CORRECTION = {"rollout_correction": {"level": "off", "reject": {"low": 0.5, "high": 2.0}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("placed-model") / "model", hidden_size=HIDDEN)


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def hand(model_dir, tmp_path_factory) -> Path:
    """The output folder of the run wired by hand: a server started by hand, its URL in
    ``rollout.urls``, ``--nproc 2``."""
    folder = tmp_path_factory.mktemp("wired-by-hand")
    spec = write_spec(folder, model_dir, {"name": "vllm-server"}, algorithm=CORRECTION)
    server = Server(model_dir, folder / "server.log")
    try:
        server.wait(time.monotonic() + START_S)
        done = run([spec, "--nproc", "2", "--set", f"rollout.urls={json.dumps([server.url])}",
                    "--set", "train.output_dir=hand"], folder, env={"GRPO_SERVE_SECRET": SECRET}, timeout=START_S)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-4000:]
    return folder / "hand"


def _trained_as_by_hand(out: Path, hand: Path, model_dir: Path) -> None:
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout_correction/logp_diff/max"] <= GAP for r in rows), rows  # each push reached the server
    assert max_change(out, model_dir) > 1e-2
    w_hand, w_ray = _weights(hand), _weights(out)
    assert w_hand.keys() == w_ray.keys() and all(torch.equal(w_hand[k], w_ray[k]) for k in w_hand)


def _none_left(tag: str) -> None:
    deadline = time.monotonic() + 30  # the server's engine process ends after its API server
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not tagged(tag)


def test_on_three_nodes_the_server_goes_to_the_third_and_trains_as_one_wired_by_hand(model_dir, hand, tmp_path):
    spec = write_spec(tmp_path, model_dir, {"name": "vllm-server"}, algorithm=CORRECTION)
    env = {**os.environ, **CHILD_ENV, **RAY_ENV}
    with made_network(3) as network, ray_cluster(network, env=env) as cluster:
        tag = uuid.uuid4().hex
        options = {"address": cluster.address, "strategy": "spread", "servers": 1, "wait_s": START_S,
                   "server_args": json.dumps(SERVER_ARGS)}
        argv = [sys.executable, "-m", "grpo_core.cli", "run", str(spec), "--launcher", "ray", "--nproc", "2",
                "--set", "train.output_dir=ray",
                *(a for k, v in options.items() for a in ("--launcher-option", f"{k}={v}"))]
        log = tmp_path / "driver.log"
        driver = network.hosts[0].start(argv, log, env={**env, "GRPO_TEST_TAG": tag}, cwd=tmp_path)
        try:
            code = driver.wait(2 * START_S)
        except subprocess.TimeoutExpired:
            code = None
        output = log.read_text(errors="replace")
        assert code == 0, output[-4000:]
        hosts = [h.address for h in network.hosts]
        for role, host in (("server 0", hosts[2]), ("learner 1", hosts[1])):
            assert re.search(rf"\({role} pid=\d+, ip={re.escape(host)}\)", output), (role, output[-4000:])
        assert re.search(r"\(learner 0 pid=\d+\)", output), output[-4000:]  # on the driver's node, the head
        _trained_as_by_hand(tmp_path / "ray", hand, model_dir)
        _none_left(tag)
        state = cluster.state()
        assert state["nodes"] == hosts and set(state["groups"]) == {"REMOVED"}, state
