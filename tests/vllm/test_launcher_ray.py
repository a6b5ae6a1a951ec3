"""The ``ray`` launcher places a rollout server (``grpo-run serve``, a real vLLM) and two
learner ranks on a one-node Ray cluster it starts itself, from a spec that names no URL: the
two steps, weight pushes included, equal bit for bit the same run wired by hand (a server
started by hand, its URL in ``rollout.urls``, ``--nproc 2``), and no process of it is left.

The rollout correction weighs nothing here (``level: off``, a rejection band no push can
leave): the sampler's log-probs of a batch depend in their last bits on how the server batched
the requests, the completions do not; its ``logp_diff/max`` still shows each push arrived.
Ray comes with the test extra, as it does into this environment (``tests/vllm/run.sh``).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import torch

from grpo_core.testing import save_tiny_model

from .conftest import HIDDEN
from .test_runs import GAP, max_change, step_rows
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


def _tagged(tag: str) -> list[int]:
    """The live processes whose environment carries ``GRPO_TEST_TAG=tag``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
            stat = (entry / "stat").read_text() if env else ""
        except OSError:
            continue
        if f"GRPO_TEST_TAG={tag}".encode() in env and stat[stat.rindex(")") + 2] != "Z":
            found.append(int(entry.name))
    return found


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


def test_a_server_placed_by_ray_trains_as_one_wired_by_hand(model_dir, tmp_path):
    spec = write_spec(tmp_path, model_dir, {"name": "vllm-server"}, algorithm=CORRECTION)
    server = Server(model_dir, tmp_path / "server.log")
    try:
        server.wait(time.monotonic() + START_S)
        hand = run([spec, "--nproc", "2", "--set", f"rollout.urls={json.dumps([server.url])}",
                    "--set", "train.output_dir=hand"], tmp_path, env={"GRPO_SERVE_SECRET": SECRET}, timeout=START_S)
    finally:
        server.stop()
    assert hand.returncode == 0, hand.stderr[-4000:]

    tag = uuid.uuid4().hex  # the launcher makes the servers' secret and hands it to every process
    options = {"servers": 1, "local_cpus": 3, "wait_s": START_S, "server_args": json.dumps(SERVER_ARGS)}
    placed = run([spec, "--launcher", "ray", "--nproc", "2", "--set", "train.output_dir=ray",
                  *(a for k, v in options.items() for a in ("--launcher-option", f"{k}={v}"))],
                 tmp_path, env={**RAY_ENV, "GRPO_TEST_TAG": tag}, timeout=2 * START_S)
    output = placed.stderr + placed.stdout
    assert placed.returncode == 0, output[-4000:]
    assert "(server 0 pid=" in output and "(learner 1 pid=" in output, output[-4000:]
    rows = step_rows(tmp_path / "ray")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout_correction/logp_diff/max"] <= GAP for r in rows), rows  # each push reached the server
    assert max_change(tmp_path / "ray", model_dir) > 1e-2
    w_hand, w_ray = _weights(tmp_path / "hand"), _weights(tmp_path / "ray")
    assert w_hand.keys() == w_ray.keys() and all(torch.equal(w_hand[k], w_ray[k]) for k in w_hand)
    deadline = time.monotonic() + 30  # the server's engine process ends after its API server
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _tagged(tag)
