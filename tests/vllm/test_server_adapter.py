"""Adapter-only LoRA pushes to rollout servers (``vllm-server`` with ``lora_push``), against two
real ``grpo-run serve`` servers started with vLLM's LoRA support (``-- --enable-lora
--max-lora-rank 8 --max-loras 2``) on 127.0.0.1.

What each test pins: over several optimizer steps the first server, given the base weights once
and then the adapter alone (over the weight channel, written to its disk and loaded by vLLM's
``/v1/load_lora_adapter``), gives the log-probs of a fixed sequence and the sampled batches
that the second server gives with the merged weights pushed (<= 1e-4), holding at most
``max_staleness + 1`` versions; a resumed learner (a new backend) unloads the old run's
versions and samples with the same log-probs again. Those pushes stream in buckets smaller
than what they send (the adapter in several parts its server holds until the last, the
merged weights in several buckets), and the adapter the server wrote to its disk is bitwise the
learner's at every step. ``grpo-run`` on the servers trains with
the sampler's log-probs equal to the trainer's at every step, before and after a resume, and
logs the adapter's bytes per push.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import requests
import torch
from grpo_plugins.rollout.adapter import adapter_state
from grpo_plugins.rollout.weights import policy_weights
from peft import LoraConfig, get_peft_model

from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.testing import build_model, save_tiny_model

from .conftest import HIDDEN
from .test_runs import GAP
from .test_servers import (
    AUTH,
    BUCKET_MB,
    START_S,
    Server,
    backend,
    in_thread,
    learner_logprobs,
    run,
    step_rows,
    write_spec,
)

ADAPTER_BUCKET_MB = 1 / 32  # 32 KiB: the tiny model's rank-8 adapter (128 KiB) goes in several parts

pytestmark = pytest.mark.vllm

TOL = 1e-4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
SEQ = "Think step by step. What is 12 * 7?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("lora-server-model") / "model", hidden_size=HIDDEN)


@pytest.fixture(scope="module", autouse=True)
def learner_secret():
    from .test_servers import SECRET

    mp = pytest.MonkeyPatch()
    mp.setenv("GRPO_SERVE_SECRET", SECRET)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, model_dir):
    folder = tmp_path_factory.mktemp("lora-servers")
    started = [Server(model_dir, folder / f"server{k}.log", extra=LORA_ARGS) for k in range(2)]
    try:
        deadline = time.monotonic() + START_S
        for server in started:
            server.wait(deadline)
        yield started
    finally:
        for server in started:
            server.stop()


def server_logps(server: Server, seq: list[int], model: str | None = None) -> torch.Tensor:
    """The server's log-probs of ``seq[1:]`` under ``model`` (a LoRA name; None: the base)."""
    body = {"prompt": seq, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    if model:
        body["model"] = model
    answer = requests.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
    rows = answer["choices"][0]["prompt_logprobs"]
    return torch.tensor([rows[t][str(seq[t])]["logprob"] for t in range(1, len(seq))])


def lora_policy(tokenizer):
    torch.manual_seed(1)
    return get_peft_model(build_model(tokenizer, hidden_size=HIDDEN, seed=0).float(),
                          LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False))


def written_adapter(version: int) -> dict[str, torch.Tensor]:
    """The adapter version ``version`` as a server's worker wrote it to this machine's disk (the
    newest such folder: both servers run here)."""
    import glob
    import os
    import tempfile

    from safetensors.torch import load_file

    pattern = os.path.join(tempfile.gettempdir(), "grpo-adapters-*", f"v{version}", "adapter_model.safetensors")
    files = glob.glob(pattern)
    return load_file(max(files, key=os.path.getmtime))


def train_step(policy, ids: list[int], optimizer) -> None:
    policy.train()
    loss = -torch.log_softmax(policy(torch.tensor([ids])).logits[0, :-1], -1).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    policy.eval()


def test_adapter_pushes_give_the_merged_pushes_log_probs_over_steps_and_a_resume(servers, tokenizer, prompts,
                                                                               caplog):
    first, second = servers
    policy = lora_policy(tokenizer)
    ids = tokenizer(SEQ)["input_ids"]
    with caplog.at_level(logging.INFO, logger="grpo.rollout.vllm-server"):
        adapter = backend([first.url], lora_push="auto", timeout_s=60, push_bucket_mb=ADAPTER_BUCKET_MB)
        pushed = adapter.setup(RolloutSetup(policy, tokenizer, max_staleness=1))
    assert "LoRA weight pushes send the adapter alone (lora_push: auto)" in caplog.text
    client = adapter.clients[first.url]
    assert client.lora == {"max_lora_rank": 8, "max_loras": 2, "runtime_updates": True}
    merged = backend([second.url], lora_push="merged", timeout_s=60, push_bucket_mb=BUCKET_MB)
    merged.setup(RolloutSetup(policy, tokenizer))
    assert adapter.push == "adapter" and merged.push == "merged" and merged.serving == ""

    full_bytes = sum(t.numel() * t.element_size() for _, t in policy_weights(policy))  # a merged push's
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    seconds: dict[str, list[float]] = {"adapter": [], "merged": []}  # push times, printed (a shared machine)
    for step in range(4):
        if step:
            train_step(policy, ids, optimizer)
            start = time.perf_counter()
            pushed = in_thread(adapter.sync_weights, policy)  # as the actor thread of asynchronous training calls it
            seconds["adapter"].append(time.perf_counter() - start)
            start = time.perf_counter()
            in_thread(merged.sync_weights, policy)
            seconds["merged"].append(time.perf_counter() - start)
        own = learner_logprobs(policy, ids)
        got, want = server_logps(first, ids, adapter.serving), server_logps(second, ids)
        assert (got - want).abs().max() <= TOL, (step, (got - want).abs().max())
        assert (got - own).abs().max() <= TOL, step
        a, m = adapter.generate(prompts, 2, sampling), merged.generate(prompts, 2, sampling)
        assert torch.equal(a.completion_ids, m.completion_ids), step
        assert (a.sampling_logp - m.sampling_logp)[a.completion_mask].abs().max() <= TOL, step
        # the server holds the last max_staleness + 1 = 2 versions
        assert sorted(client.adapters()) == sorted(adapter.loaded.values()), step
        assert len(adapter.loaded) == min(step + 1, 2), (step, adapter.loaded)
        assert 0 < pushed.bytes < full_bytes / 10 and pushed.seconds > 0, (step, pushed)
        assert pushed.bytes > 2 * pushed.figures["buffer_bytes"], (step, pushed)  # several parts
        on_disk, own_adapter = written_adapter(adapter.version), adapter_state(policy)
        assert sorted(on_disk) == sorted(own_adapter), step
        assert all(torch.equal(on_disk[k], own_adapter[k]) for k in own_adapter), step  # bitwise the learner's
    assert adapter.failover.dropped == {}
    print(f"bytes per push: adapter {pushed.bytes:.0f}, merged {full_bytes}; seconds per push: "
          f"adapter {sorted(seconds['adapter'])}, merged {sorted(seconds['merged'])}")

    # A resumed learner: a new backend (setup pushes the base, then the adapter as its version 1)
    # and the previous learner's versions unloaded.
    resumed = backend([first.url], lora_push="auto", timeout_s=60)
    resumed.setup(RolloutSetup(policy, tokenizer, max_staleness=1))
    assert client.adapters() == [resumed.serving]
    got = server_logps(first, ids, resumed.serving)
    assert (got - server_logps(second, ids)).abs().max() <= TOL
    train_step(policy, ids, optimizer)
    in_thread(resumed.sync_weights, policy)
    in_thread(merged.sync_weights, policy)
    assert (server_logps(first, ids, resumed.serving) - server_logps(second, ids)).abs().max() <= TOL
    a, m = resumed.generate(prompts, 2, sampling), merged.generate(prompts, 2, sampling)
    assert torch.equal(a.completion_ids, m.completion_ids)
    assert (a.sampling_logp - m.sampling_logp)[a.completion_mask].abs().max() <= TOL


def test_a_lora_run_on_servers_pushes_adapters_across_a_resume(servers, model_dir, tmp_path):
    """grpo-run with a LoRA policy on both servers (lora_push: auto): the base weights at setup,
    then the adapter alone after each update; the servers' log-probs equal the trainer's at
    every step with something to train, before and after a resume; each push's bytes are
    logged (the adapter's: the same at every step)."""
    lora = {"r": 8, "alpha": 16, "target_modules": TARGETS}
    rollout = {"name": "vllm-server", "urls": [s.url for s in servers]}
    spec = write_spec(tmp_path, model_dir, rollout, model={"path": str(model_dir), "lora": lora},
                      train={"steps": 3, "lr": 5.0e-2}, checkpoint={"every": 1, "keep": 3})
    done = run([spec], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "full merged weights" not in done.stderr, done.stderr[-4000:]
    done = run([spec, "--set", "train.steps=5", "--resume"], tmp_path, timeout=300)
    assert done.returncode == 0 and "(step 3)" in done.stderr, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if line]
    pushes = {r["step"]: r["sync/push_bytes"] for r in rows if "sync/push_bytes" in r}
    assert sorted(pushes) == [1, 2, 3, 4, 5] and len(set(pushes.values())) == 1, pushes
    checked = {r["step"]: r["rollout_correction/logp_diff/max"] for r in step_rows(tmp_path / "out")}
    assert min(checked) <= 3 and max(checked) > 3, checked
    assert all(g <= GAP for g in checked.values()), checked
    print(f"bytes per adapter push: {pushes[1]:.0f}")


def test_two_learner_processes_push_the_adapter_once_and_both_sample_with_it(servers, model_dir, tmp_path):
    """grpo-run --nproc 2 (ddp) with a LoRA policy on both servers: every process gathers the
    adapter, the first pushes it, the second waits until its servers list the new version
    (/v1/models) before it generates with it; every step's sampler log-probs equal the trainer's."""
    lora = {"r": 8, "alpha": 16, "target_modules": TARGETS}
    rollout = {"name": "vllm-server", "urls": [s.url for s in servers]}
    spec = write_spec(tmp_path, model_dir, rollout, model={"path": str(model_dir), "lora": lora},
                      train={"steps": 2, "lr": 5.0e-2, "prompts_per_step": 4})
    done = run([spec, "--nproc", "2"], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "full merged weights" not in done.stderr, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if line]
    assert sorted(r["step"] for r in rows if "sync/push_bytes" in r) == [1, 2]
    checked = {r["step"]: r["rollout_correction/logp_diff/max"] for r in step_rows(tmp_path / "out")}
    assert checked and all(g <= GAP for g in checked.values()), checked


def test_an_asynchronous_lora_run_keeps_max_staleness_plus_one_versions_on_the_servers(servers, model_dir, tmp_path):
    """rollout.max_staleness: 1 with a LoRA policy on servers holding two adapters
    (--max-loras 2): the actor's thread pushes each version's adapter and generates with it;
    a batch sampled at the learner's own version matches the trainer (1e-4), one a version
    older does not; the servers end holding the last two versions."""
    lora = {"r": 8, "alpha": 16, "target_modules": TARGETS}
    rollout = {"name": "vllm-server", "urls": [s.url for s in servers], "max_staleness": 1}
    spec = write_spec(tmp_path, model_dir, rollout, model={"path": str(model_dir), "lora": lora},
                      train={"steps": 4, "lr": 5.0e-2})
    done = run([spec], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "full merged weights" not in done.stderr, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["async/staleness"] for r in rows if "async/staleness" in r][:2] == [0, 1]
    gaps = {r["step"]: (r["async/staleness"], r["rollout_correction/logp_diff/max"])
            for r in step_rows(tmp_path / "out")}
    for step, (staleness, gap) in gaps.items():
        assert (gap <= GAP) if staleness == 0 else (gap > 1e-3), (step, gap)
    for server in servers:
        listed = requests.get(server.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]
        adapters = [m["id"] for m in listed if m.get("parent")]
        assert len(adapters) == 2 and all(a.startswith("grpo-policy-") for a in adapters), adapters


def test_partial_rollouts_with_adapter_pushes_train_every_token_within_the_bound(servers, model_dir, tmp_path):
    """rollout.partial_rollouts with a LoRA policy on servers that load adapters: a weight
    update pauses the servers mid-batch and pushes the adapter alone; a request still queued at
    the pause names (and samples with) the older adapter version, which stays loaded, so every
    token's recorded version is at most max_staleness behind the step that trains it."""
    lora = {"r": 8, "alpha": 16, "target_modules": TARGETS}
    rollout = {"name": "vllm-server", "urls": [s.url for s in servers], "max_staleness": 1,
               "partial_rollouts": True, "max_new_tokens": 48}
    spec = write_spec(tmp_path, model_dir, rollout, model={"path": str(model_dir), "lora": lora},
                      train={"steps": 4, "lr": 5.0e-2})
    done = run([spec], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "full merged weights" not in done.stderr, done.stderr[-4000:]
    rows = [r for r in step_rows(tmp_path / "out") if "async/token_staleness/max" in r]
    assert len(rows) >= 3, rows
    assert all(0 <= r["async/token_staleness/max"] <= 1 and r["async/staleness"] <= 1 for r in rows), rows
    for server in servers:
        listed = requests.get(server.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]
        assert len([m for m in listed if m.get("parent")]) <= 2, listed
