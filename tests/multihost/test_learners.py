"""Two learner nodes on two network hosts (:mod:`.netns`), launched with the multi-GPU guide's
own multi-node command (torchrun, c10d rendezvous on node 0's address, one process per node),
against the same run on one host (``grpo-run --nproc 2``): the same world size, so the same
steps bit for bit, with ddp and with fsdp2. Then the link of a node is cut mid-run: the other
node stops within ``train.parallel.timeout_s`` with a clear error and the last completed step
checkpointed, and once the link is back the guide's command with ``--resume`` finishes the run
exactly as the uninterrupted one.

The machine's hostname resolves to 127.0.0.1 in every host (they share it), as on many real
machines: what the guide's command sets explicitly (the rendezvous host, the address each node
advertises, the interface gloo binds) is what makes the run work there."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_core import checkpoint as ckpt

from .conftest import guide_command, made_once, start_node, write_spec
from .netns import wait_for

pytestmark = pytest.mark.slow

#: train.parallel.timeout_s of these runs: a bound on each collective, long enough for a
#: loaded 2-core machine's slowest process (starting, or writing the final model).
TIMEOUT_S = 20
START_S = 300  # two nodes starting (imports, rendezvous) on a loaded machine

# A reward of 0 for every completion (it changes no number of the run) that records where its
# process runs, and that holds rank 1 at its second call (step 2's scoring) when
# GRPO_TEST_GATE names a folder, until the test has cut the link and opens the gate.
GATE_PLUGIN = '''
import json, os, time
from pathlib import Path

from grpo_core import hookimpl
from grpo_plugins.rollout.channel import local_address

calls = 0


def gate(prompts, completions, **columns):
    global calls
    calls += 1
    rank, master = os.environ.get("RANK", "0"), os.environ.get("MASTER_ADDR", "127.0.0.1")
    Path(f"rank{rank}.json").write_text(json.dumps({"MASTER_ADDR": master, "address": local_address(master)}))
    folder = os.environ.get("GRPO_TEST_GATE")
    if folder and rank == "1" and calls == 2:
        Path(folder, "held").touch()
        deadline = time.monotonic() + 300
        while not Path(folder, "open").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return [0.0] * len(completions)


@hookimpl
def register_reward_functions(register):
    register.add("gate", gate)
'''


def spec_of(model_dir: Path, **train) -> dict:
    """Every part of the step that processes must agree on: per-prompt seeded sampling,
    batch-scoped advantage statistics, the KL in the loss, a token-mean normalizer summed over
    processes. No periodic checkpoint: the only one a failed run has is its failure's."""
    return {
        "model": {"path": str(model_dir)},
        "plugins": ["gate.py"],
        "data": {"name": "arithmetic", "train_size": 16, "eval_size": 0},
        "rollout": {"group_size": 4, "max_new_tokens": 6, "prompts_per_generate": 1},
        "rewards": [{"name": "accuracy"}, {"name": "format", "pattern": "^\\s*\\d+", "weight": 0.5},
                    {"name": "gate"}],
        "algorithm": {"advantage": {"name": "grpo", "std_scope": "batch"},
                      "kl": {"name": "low_var_kl", "beta": 0.04}, "aggregation": {"name": "token-mean"}},
        "train": {"steps": 3, "prompts_per_step": 4, "seed": 3, "lr": 1.0e-2, "progress": False, "threads": 1,
                  "log_completions_every": 0, "output_dir": "out", **train,
                  "parallel": {"timeout_s": TIMEOUT_S, **train.get("parallel", {})}},
        "checkpoint": {"every": 0, "every_minutes": 0},
        "eval": {"at_start": False, "at_end": False},
        "tracking": [],
    }


def prepare(folder: Path, spec: dict) -> Path:
    write_spec(folder, spec)
    (folder / "gate.py").write_text(GATE_PLUGIN, encoding="utf-8")
    return folder


def one_host(folder: Path, env: dict) -> subprocess.Popen:
    """``grpo-run spec.yaml --nproc 2`` in ``folder``, on this machine's own network."""
    log = open(folder / "one-host.log", "wb")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen([sys.executable, "-m", "grpo_core.cli", "run", "spec.yaml", "--nproc", "2"],
                            cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, timeout: float = START_S) -> None:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running after {timeout} s:\n{tail(log)}") from None
    assert code == 0, tail(log)


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(encoding="utf-8", errors="replace")[-chars:] if log.exists() else "(no log)"


def weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted((run / "final").glob("*.safetensors")):
        out.update(load_file(str(f)))
    assert out, f"no final weights in {run}"
    return out


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


def assert_same_run(run: Path, reference: Path) -> None:
    """The same final weights, bit for bit, and the same logged figures at every step."""
    mine, theirs = weights(run), weights(reference)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), {k: float((mine[k] - theirs[k]).abs().max())
                                                                  for k in mine}
    rows, expected = metrics(run), metrics(reference)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [1, 2, 3]
    for row, other in zip(rows, expected):
        for key in ("loss", "kl", "grad_norm", "reward", "advantage/abs_max", "train/updates"):
            assert row[key] == other[key], (row["step"], key)


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory, tiny_model_dir, child_env) -> Path:
    """The ddp run on one host: ``grpo-run --nproc 2`` (loopback), the same spec; run once for
    the session's workers (its model is the same tiny model, built from the same seed)."""
    def make(folder: Path) -> None:
        prepare(folder, spec_of(tiny_model_dir))
        finish(one_host(folder, child_env), folder / "one-host.log")

    return made_once(tmp_path_factory, "multihost-ddp-reference", make) / "out"


def two_nodes(network, folder: Path, command: str, env: dict, extra: str = "", tag: str = "") -> list:
    """The guide's ``command`` on hosts 0 (node 0, 10.231.0.1) and 1 (10.231.0.2), logs
    ``node<k><tag>.log``."""
    main = network.hosts[0]
    return [start_node(host, main, command, folder, folder / f"node{k}{tag}.log", env, extra)
            for k, host in enumerate(network.hosts[:2])]


def ddp_command() -> str:
    return guide_command("run spec.yaml\n")


def test_the_guide_gives_one_multi_node_command_per_strategy():
    """The commands the tests below run (needs no network): each sets the three things that
    loopback hides, and the fsdp2 one differs only in selecting fsdp2."""
    ddp, fsdp2 = ddp_command(), guide_command("strategy=fsdp2")
    for block in (ddp, fsdp2):
        assert "export GLOO_SOCKET_IFNAME=$IFNAME NCCL_SOCKET_IFNAME=$IFNAME\n" in block
        assert "--rdzv_backend c10d --rdzv_endpoint $MAIN_ADDR:29500" in block
        assert "--rdzv_conf is_host=$IS_MAIN --local_addr $THIS_ADDR" in block

    def words(block: str) -> str:
        lines = [line for line in block.splitlines() if not line.startswith("#")]
        return " ".join("\n".join(lines).replace("\\\n", " ").split())

    assert words(fsdp2) == words(ddp) + " --set train.parallel.strategy=fsdp2"


def test_two_hosts_take_the_steps_of_one_host_with_ddp(network, tmp_path, tiny_model_dir, child_env, ddp_reference):
    folder = prepare(tmp_path / "two-hosts", spec_of(tiny_model_dir))
    nodes = two_nodes(network, folder, ddp_command(), child_env)
    for k, node in enumerate(nodes):
        finish(node, folder / f"node{k}.log")
    # The two processes ran on two hosts and met at node 0's address, not on loopback.
    seen = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen == [{"MASTER_ADDR": "10.231.0.1", "address": "10.231.0.1"},
                    {"MASTER_ADDR": "10.231.0.1", "address": "10.231.0.2"}]
    assert_same_run(folder / "out", ddp_reference)


def test_fsdp2_on_two_hosts_takes_the_steps_of_one_host(network, tmp_path, tiny_model_dir, child_env):
    # two micro-batches per process: gradients accumulate into the shards
    spec = spec_of(tiny_model_dir, micro_batch_size=4, parallel={"strategy": "fsdp2"})
    one = prepare(tmp_path / "one-host", spec)
    reference = one_host(one, child_env)
    # the guide's command selects fsdp2 itself (--set train.parallel.strategy=fsdp2)
    folder = prepare(tmp_path / "two-hosts", spec_of(tiny_model_dir, micro_batch_size=4))
    nodes = two_nodes(network, folder, guide_command("strategy=fsdp2"), child_env)
    finish(reference, one / "one-host.log")
    for k, node in enumerate(nodes):
        finish(node, folder / f"node{k}.log")
    assert json.loads((folder / "rank1.json").read_text())["address"] == "10.231.0.2"
    assert_same_run(folder / "out", one / "out")


def test_a_cut_link_stops_the_other_node_within_the_timeout_and_the_run_resumes_exactly(
    network, tmp_path, tiny_model_dir, child_env, ddp_reference
):
    folder = prepare(tmp_path / "cut", spec_of(tiny_model_dir))
    gate = tmp_path / "gate"
    gate.mkdir()
    cut = network.hosts[1]
    nodes = two_nodes(network, folder, ddp_command(), {**child_env, "GRPO_TEST_GATE": str(gate)})
    logs = [folder / "node0.log", folder / "node1.log"]

    # Step 1 done; rank 1 (on host 1) holds in step 2's scoring while rank 0 waits for it in
    # the step's first collective. Then host 1's link goes down, and rank 1 goes on.
    try:
        wait_for(lambda: (gate / "held").exists() or any(n.poll() is not None for n in nodes), START_S, "step 2")
    except AssertionError:
        raise AssertionError(tail(logs[0]) + tail(logs[1])) from None
    assert (gate / "held").exists(), tail(logs[0]) + tail(logs[1])
    network.cut(cut)
    cut_at = time.monotonic()
    (gate / "open").touch()

    # Node 0 stops on its own within the timeout (plus the time to checkpoint and exit on a
    # loaded machine), with the error and the checkpoint of step 1.
    try:
        nodes[0].wait(TIMEOUT_S + 90)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"node 0 still running {TIMEOUT_S + 90} s after the cut:\n{tail(logs[0])}") from None
    stopped_after = time.monotonic() - cut_at
    assert nodes[0].returncode != 0
    log = logs[0].read_text(encoding="utf-8", errors="replace")
    assert "grpo-run: error: lost contact with another process of the run" in log, log[-4000:]
    assert f"train.parallel.timeout_s = {TIMEOUT_S} s" in log
    assert "grpo-run: step 2 failed before its update; checkpoint of step 1:" in log, log[-4000:]
    assert stopped_after >= TIMEOUT_S - 1  # it waited out the timeout, not a refused connection
    folders = ckpt.list_checkpoints(folder / "out" / "checkpoints")
    assert [f.name for f in folders] == ["step-000001"] and ckpt.verify(folders[0]) is None

    # The cut-off node's training process stops the same way (its torchrun agent may go on
    # waiting for node 0's rendezvous store until TCP gives up: the guide says so).
    wait_for(lambda: "lost contact with another process of the run" in tail(logs[1], 100_000), TIMEOUT_S + 90,
             "the cut-off node's error")
    network.stop(nodes[1])

    # The link back, the guide's command with --resume on both nodes: the run ends as the
    # uninterrupted one does, bit for bit.
    network.restore(cut)
    resumed = two_nodes(network, folder, ddp_command(), child_env, extra="--resume", tag="-resume")
    for k, node in enumerate(resumed):
        finish(node, folder / f"node{k}-resume.log")
    assert "resuming from" in tail(folder / "node0-resume.log", 100_000)
    assert_same_run(folder / "out", ddp_reference)
