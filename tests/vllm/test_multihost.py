"""A real rollout server on another network host: ``grpo-run serve`` (vLLM) on host 2 of a
network of namespaces (:mod:`tests.multihost.netns`, 10.231.0.0/24), the learner on host 0
reaching it by its address, the weight channel between their own interfaces (each hostname
resolves to 127.0.0.1). Pushes reach the server (the sampler/trainer gap stays at float32
precision); the server's link cut mid-run stops the run with exit 1, the server named and the
last completed step checkpointed; with the link back, ``--resume`` ends as the uninterrupted
run does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.testing import save_tiny_model

from ..multihost.netns import made_network, wait_for
from .conftest import HIDDEN
from .test_runs import CHILD_ENV, GAP, SPEC, step_rows

pytestmark = pytest.mark.vllm

START_S = 300  # a vLLM server starting on two shared cores
TIMEOUT_S = 10  # rollout.timeout_s
PORT = 8000
# A server bound beyond loopback needs a shared secret (its weight routes replace the model):
# the same value in the server's and the learner's environment, as the guide tells users.
SECRET = "multihost-test-secret"

GATE = '''
import os, time
from pathlib import Path
from grpo_core import hookimpl

calls = 0


def gate(prompts, completions, **columns):
    """0 for every completion; holds step 2's scoring while GRPO_TEST_GATE names a folder
    without an "open" file."""
    global calls
    calls += 1
    folder = os.environ.get("GRPO_TEST_GATE")
    if folder and calls == 2:
        Path(folder, "held").touch()
        deadline = time.monotonic() + 300
        while not Path(folder, "open").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return [0.0] * len(completions)


@hookimpl
def register_reward_functions(register):
    register.add("gate", gate)
'''

HEALTHY = '''
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(sys.argv[1] + "/health", timeout=2) as answer:
            if answer.status == 200:
                sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit(1)
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("multihost-model") / "model", hidden_size=HIDDEN)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, **CHILD_ENV, "PYTHONUNBUFFERED": "1", "GRPO_SERVE_SECRET": SECRET, **extra}


def write_spec(folder: Path, model_dir: Path, url: str) -> None:
    spec = json.loads(json.dumps(SPEC))
    spec["model"] = {"path": str(model_dir)}
    spec["plugins"] = ["gate.py"]
    spec["rewards"] = [*spec["rewards"], {"name": "gate"}]
    spec["rollout"] = {"name": "vllm-server", "urls": [url], "group_size": 4, "max_new_tokens": 6,
                       "timeout_s": TIMEOUT_S, "retries": 1}
    spec["train"] = {**spec["train"], "steps": 4}
    spec["checkpoint"] = {"every": 0, "every_minutes": 0}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.yaml").write_text(json.dumps(spec), encoding="utf-8")
    (folder / "gate.py").write_text(GATE, encoding="utf-8")


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted((out / "final").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_a_server_on_another_host_trains_fails_over_a_cut_link_and_resumes(tmp_path, model_dir):
    with made_network(3) as network:
        learner, host = network.hosts[0], network.hosts[2]
        url = f"http://{host.address}:{PORT}"
        server_log = tmp_path / "server.log"
        host.start([sys.executable, "-m", "grpo_core.cli", "serve", str(model_dir), "--host", host.address,
                    "--port", str(PORT), "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--",
                    "--max-num-seqs", "32"], server_log, env=child_env())
        up = learner.run([sys.executable, "-c", HEALTHY, url, str(START_S)], timeout=START_S + 30)
        assert up.returncode == 0, f"server {url} not up from host 0:\n{server_log.read_text()[-3000:]}"

        def grpo_run(folder: Path, *args: str, **env: str) -> subprocess.Popen:
            return learner.start([sys.executable, "-m", "grpo_core.cli", "run", "spec.yaml", *args],
                                 folder / f"learner{'-'.join(args)}.log", env=child_env(**env), cwd=folder)

        # The uninterrupted run: every push reached the server across the hosts.
        straight = tmp_path / "straight"
        write_spec(straight, model_dir, url)
        done = grpo_run(straight)
        assert done.wait(300) == 0, (straight / "learner.log").read_text()[-4000:]
        rows = step_rows(straight / "out")
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(r["rollout_correction/logp_diff/max"] <= GAP for r in rows), rows

        # The server's link cut while step 2 is scored: the push after step 2's update times
        # out, the server is dropped, and step 3 finds none left.
        cut = tmp_path / "cut"
        write_spec(cut, model_dir, url)
        gate = tmp_path / "gate"
        gate.mkdir()
        run = grpo_run(cut, GRPO_TEST_GATE=str(gate))
        wait_for(lambda: (gate / "held").exists() or run.poll() is not None, 300, "step 2")
        assert (gate / "held").exists(), (cut / "learner.log").read_text()[-4000:]
        network.cut(host)
        cut_at = time.monotonic()
        (gate / "open").touch()
        assert run.wait(TIMEOUT_S * 4 + 60) == 1, (cut / "learner.log").read_text()[-4000:]
        took = time.monotonic() - cut_at
        log = (cut / "learner.log").read_text()
        assert "no rollout server is left" in log and url in log, log[-3000:]
        assert "failed during a weight push" in log, log[-3000:]
        assert "step 3 failed before its update; checkpoint of step 2" in log, log[-3000:]
        assert took <= TIMEOUT_S * 4 + 60
        folders = ckpt.list_checkpoints(cut / "out" / "checkpoints")
        assert [f.name for f in folders] == ["step-000002"]

        # The link back: --resume reconnects, pushes the resumed weights, and ends where the
        # uninterrupted run did.
        network.restore(host)
        resumed = grpo_run(cut, "--resume")
        assert resumed.wait(300) == 0, (cut / "learner--resume.log").read_text()[-4000:]
        rows = step_rows(cut / "out")
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(r["rollout_correction/logp_diff/max"] <= GAP for r in rows), rows
        mine, theirs = final_weights(cut / "out"), final_weights(straight / "out")
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), {k: float((mine[k] - theirs[k]).abs().max())
                                                                      for k in mine}
