"""The weight channel of the ``vllm-server`` backend (:mod:`grpo_plugins.rollout.channel`) between
a learner on host 0 and a rollout server's worker on host 2, by their network addresses: the
server's side is the calls its ``grpo_torch`` engine makes (``open_group`` as rank 1 at the
address the learner advertised, then ``receive_tensors``), without vLLM (tests/vllm runs a
real server). The policy's weights cross bit for bit; then host 2's link is cut before a second
push, and both ends fail within the channel's timeout instead of hanging.

Every host resolves the machine's hostname to 127.0.0.1: a member that bound gloo there (PyTorch's
default device) could not be reached from the other host."""

from __future__ import annotations

import json
import sys
import time

import pytest

from .netns import wait_for

pytestmark = pytest.mark.slow

TIMEOUT_S = 8  # the channel's timeout_s (rollout.timeout_s in a run)

LEARNER = '''
import json, sys, time
from pathlib import Path

import torch
from grpo_plugins.rollout.weights import cast_weights, policy_weights
from grpo_plugins.rollout.channel import local_address, open_group, send_tensors, update_info
from safetensors.torch import save_file

from grpo_core.testing import build_model, build_tokenizer

folder, server, port, timeout_s = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
weights = cast_weights(list(policy_weights(build_model(build_tokenizer()))), torch.float32)
save_file({n: t.contiguous() for n, t in weights}, str(folder / "sent.safetensors"))
host = local_address(server)  # what the vllm-server backend advertises with weight_host: null
(folder / "init.json").write_text(json.dumps({"host": host, "port": port, "info": update_info(weights)}))
group = open_group(host, port, 0, 2, "gloo", timeout_s)
send_tensors(group, (t for _, t in weights))
(folder / "learner-ready").touch()
while not (folder / "go").exists():
    time.sleep(0.05)
start = time.monotonic()
try:
    send_tensors(group, (t for _, t in weights))
    outcome = "sent"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
(folder / "learner.json").write_text(json.dumps({"second": outcome, "after_s": time.monotonic() - start}))
'''

SERVER_WORKER = '''
import json, sys, time
from pathlib import Path

from grpo_plugins.rollout.channel import local_address, open_group, receive_tensors
from safetensors.torch import save_file

folder, timeout_s = Path(sys.argv[1]), float(sys.argv[2])
while not (folder / "init.json").exists():
    time.sleep(0.05)
init = json.loads((folder / "init.json").read_text())  # what /init_weight_transfer_engine carries
group = open_group(init["host"], init["port"], 1, 2, "gloo", timeout_s)
got = dict(receive_tensors(group, init["info"], "cpu"))
save_file(got, str(folder / "received.safetensors"))
(folder / "server-ready").touch()
while not (folder / "go").exists():
    time.sleep(0.05)
start = time.monotonic()
try:
    list(receive_tensors(group, init["info"], "cpu"))
    outcome = "received"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
(folder / "server.json").write_text(json.dumps({"second": outcome, "after_s": time.monotonic() - start,
                                                "address": local_address(init["host"])}))
'''


def test_weights_cross_to_a_server_host_by_address_and_a_cut_link_fails_both_ends_in_time(
    network, tmp_path, child_env
):
    from safetensors.torch import load_file

    learner, server = network.hosts[0], network.hosts[2]
    (tmp_path / "learner.py").write_text(LEARNER, encoding="utf-8")
    (tmp_path / "server.py").write_text(SERVER_WORKER, encoding="utf-8")
    procs = [
        learner.start([sys.executable, str(tmp_path / "learner.py"), str(tmp_path), server.address, "29600",
                       str(TIMEOUT_S)], tmp_path / "learner.log", env=child_env),
        server.start([sys.executable, str(tmp_path / "server.py"), str(tmp_path), str(TIMEOUT_S)],
                     tmp_path / "server.log", env=child_env),
    ]

    def logs() -> str:
        return "".join(f"\n--- {name}.log\n" + (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:]
                       for name in ("learner", "server"))

    def ready() -> bool:
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a side exited early:{logs()}")
        return (tmp_path / "learner-ready").exists() and (tmp_path / "server-ready").exists()

    wait_for(ready, 240, "the first push")
    # The learner advertised its address on the route to the server, not loopback, and the
    # server's worker joined from its own.
    init = json.loads((tmp_path / "init.json").read_text())
    assert init["host"] == learner.address == "10.231.0.1"
    sent, received = load_file(str(tmp_path / "sent.safetensors")), load_file(str(tmp_path / "received.safetensors"))
    assert sent.keys() == received.keys() and len(sent) > 5
    assert all(received[k].dtype == sent[k].dtype and received[k].equal(sent[k]) for k in sent)

    network.cut(server)
    (tmp_path / "go").touch()
    cut_at = time.monotonic()
    for proc in procs:
        proc.wait(TIMEOUT_S + 60)
    took = time.monotonic() - cut_at
    ends = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("learner", "server")}
    assert ends["server"]["address"] == server.address
    for name, end in ends.items():
        # gloo's own timeout, not TCP's retransmissions (minutes): both ends give up after timeout_s
        assert "Timed out waiting" in end["second"], (name, end)
        assert TIMEOUT_S - 1 <= end["after_s"] <= TIMEOUT_S + 30, (name, end)
    assert took <= TIMEOUT_S + 60
