"""The ``vllm-server`` rollout backend against real rollout servers (``grpo-run serve``:
vLLM's own OpenAI server with the ``grpo_torch`` weight channel), started here on
127.0.0.1 on free ports and killed (their whole process group) at the end, even on failure.

Two servers serve the whole module, in order: their routes locked by the shared secret,
pushes (log-probs of a fixed sequence), a batch split across both, a ``grpo-run`` that trains
on them, a hung server failed over, and last a run whose only server is killed mid-run (exit
1, last step checkpointed). Both require the shared secret: the first gets it from
``GRPO_SERVE_SECRET``, the second as vLLM's own ``--api-key``; the learner (this process and
the ``grpo-run`` it starts) sends it from ``GRPO_SERVE_SECRET``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.testing import build_model, save_tiny_model

from .conftest import HIDDEN
from .test_runs import CHILD_ENV, COUNTDOWN, GAP, SPEC, max_change, step_rows

pytestmark = pytest.mark.vllm

START_S = 240  # two servers starting at once on two shared cores
SECRET = "grpo-test-secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}
BUCKET_MB = 0.25  # push_bucket_mb of the tests that stream a push in several buckets


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One ``grpo-run serve`` process group, its URL and log."""

    def __init__(self, model_dir: Path, log: Path, as_api_key: bool = False, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in {**os.environ, **CHILD_ENV}.items() if k != "GRPO_SERVE_SECRET"}
        vllm_args = ["--max-num-seqs", "32", *extra]
        if as_api_key:
            vllm_args += ["--api-key", SECRET]
        else:
            env["GRPO_SERVE_SECRET"] = SECRET
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "grpo_core.cli", "serve", str(model_dir), "--port", str(self.port),
                 "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--", *vllm_args],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )

    def wait(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        pytest.fail(f"server {self.url} not up in {START_S} s:\n{self.log.read_text()[-3000:]}")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def finished_requests(self) -> float:
        text = requests.get(self.url + "/metrics", headers=AUTH, timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total{"))

    def logprobs(self, seq: list[int]) -> torch.Tensor:
        """The server's log-probs of ``seq[1:]`` given the tokens before each (prompt log-probs)."""
        body = {"prompt": seq, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        answer = requests.post(self.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
        rows = answer["choices"][0]["prompt_logprobs"]
        return torch.tensor([rows[t][str(seq[t])]["logprob"] for t in range(1, len(seq))])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("server-model") / "model", hidden_size=HIDDEN)


@pytest.fixture(scope="module", autouse=True)
def learner_secret():
    """The learner's GRPO_SERVE_SECRET, in this process and the runs it starts."""
    before = os.environ.get("GRPO_SERVE_SECRET")
    os.environ["GRPO_SERVE_SECRET"] = SECRET
    yield
    if before is None:
        os.environ.pop("GRPO_SERVE_SECRET", None)
    else:
        os.environ["GRPO_SERVE_SECRET"] = before


@pytest.fixture(scope="module")
def servers(tmp_path_factory, model_dir):
    folder = tmp_path_factory.mktemp("servers")
    started = [Server(model_dir, folder / f"server{k}.log", as_api_key=k == 1) for k in range(2)]
    try:
        deadline = time.monotonic() + START_S
        for server in started:
            server.wait(deadline)
        yield started
    finally:
        for server in started:
            server.stop()


def learner_logprobs(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


def backend(urls: list[str], **options):
    from grpo_plugins.vllm.server import VLLMServerOptions, VLLMServerRollout

    return VLLMServerRollout(VLLMServerOptions(urls=urls, **options))


def in_thread(function, *args):
    """``function(*args)`` run in another thread (bounded), its result or its exception."""
    out: dict = {}

    def target():
        try:
            out["value"] = function(*args)
        except BaseException as exc:  # re-raised below
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    if "error" in out:
        raise out["error"]
    return out["value"]


def gap(server: Server, model, seq: list[int]) -> float:
    return float((server.logprobs(seq) - learner_logprobs(model, seq)).abs().max())


def perturb(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


@pytest.mark.parametrize("path", ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                                  "/finish_weight_update", "/collective_rpc", "/reset_prefix_cache", "/v1/completions"])
def test_every_route_but_health_needs_the_shared_secret(servers, path):
    """vLLM's --api-key alone guards /v1 only; with grpo-run serve's guard the weight routes
    answer 401 without the secret, on both servers (secret from the environment, or --api-key)."""
    for server in servers:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = requests.post(server.url + path, json={}, headers=headers, timeout=30)
            assert refused.status_code == 401, (server.url, path, refused.text)
        assert requests.get(server.url + "/health", timeout=30).status_code == 200
        assert requests.get(server.url + "/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_a_learner_without_the_secret_is_refused_naming_the_variable(servers, tokenizer, monkeypatch):
    from grpo_core.errors import RunError

    monkeypatch.delenv("GRPO_SERVE_SECRET")
    model = build_model(tokenizer, seed=1, hidden_size=HIDDEN).float()
    with pytest.raises(RunError, match="set GRPO_SERVE_SECRET in the learner's environment"):
        backend([servers[0].url], retries=0, timeout_s=30).setup(RolloutSetup(model, tokenizer))


def test_the_judge_reward_grades_through_a_real_vllm_server(servers, model_dir, monkeypatch):
    """The judge against a real OpenAI-compatible server (vLLM behind grpo-run serve, its own
    --api-key as the key; placed before the tests that stop a server): the request is one vLLM
    accepts, the answer is parsed (a tiny random model's text holds a number or not: a score in
    [0, 1] or None), and a second call of the same completions is answered from the cache
    without a request."""
    from grpo_plugins.rewards.judge import Judge, JudgeOptions

    server = servers[1]  # started with vLLM's own --api-key SECRET
    monkeypatch.setenv("JUDGE_TEST_KEY", SECRET)
    rubric = "Q: {prompt} A: {completion} Expected: {reference}. {verdict}"  # the server's context is 256
    judge = Judge(JudgeOptions(url=server.url + "/v1", model=str(model_dir), api_key_env="JUDGE_TEST_KEY",
                               template=rubric, reference_column="answer", max_tokens=8, temperature=0.0,
                               retries=0, timeout=60))
    before = server.finished_requests()
    prompts = [[{"role": "user", "content": "What is 2 + 2?"}]] * 2
    scores = judge(prompts, ["4", "5"], answer=["4", "4"])
    assert len(scores) == 2 and all(s is None or 0.0 <= s <= 1.0 for s in scores), scores
    assert server.finished_requests() - before == 2
    assert judge(prompts, ["4", "5"], answer=["4", "4"]) == scores
    assert server.finished_requests() - before == 2  # the cache answered
    monkeypatch.setenv("JUDGE_TEST_KEY", "not-the-key")
    with pytest.raises(Exception, match="401"):
        Judge(JudgeOptions(url=server.url + "/v1", model=str(model_dir), api_key_env="JUDGE_TEST_KEY",
                           template=rubric, reference_column="answer", retries=0, cache=False,
                           max_tokens=8))(prompts[:1], ["4"], answer=["4"])


def test_pushes_reach_every_server(servers, tokenizer):
    """Each server's log-probs of a fixed sequence differ from the learner's before a push
    (it serves other weights) and equal them to 1e-4 (float32) after each push; with
    push_every 2, syncs 1 and 3 push (the first: a resumed run's) and sync 2 leaves the
    servers one update behind. Every full push (setup's too) reports its bytes, a whole
    float32 copy of the model, and its seconds; the skipped one reports none. The pushes
    stream in buckets of a quarter MiB (the model is 1.44 MiB): the largest bucket stays within
    it, and a push of the same weights in one bucket leaves every log-prob bit for bit where
    the streamed one had (the engines hold the same weights)."""
    seq = tokenizer("Think step by step. What is 12 * 7?")["input_ids"]
    model = build_model(tokenizer, seed=1, hidden_size=HIDDEN).float()
    from grpo_plugins.rollout.weights import policy_weights

    full_bytes = sum(t.numel() * 4 for _, t in policy_weights(model))  # the servers compute in float32
    assert all(gap(s, model, seq) > 1e-2 for s in servers)
    bound = BUCKET_MB * 2**20
    rollout = backend([s.url for s in servers], push_every=2, timeout_s=60, push_bucket_mb=BUCKET_MB)
    first = rollout.setup(RolloutSetup(model, tokenizer))
    assert first.bytes == full_bytes and first.seconds > 0, first
    assert full_bytes > 4 * bound and 0 < first.figures["buffer_bytes"] <= bound, first
    assert all(gap(s, model, seq) <= GAP for s in servers)
    for sync, pushed in ((1, True), (2, False), (3, True)):
        perturb(model, sync)
        push = in_thread(rollout.sync_weights, model)  # as the actor thread of asynchronous training calls it
        gaps = [gap(s, model, seq) for s in servers]
        assert all(g <= GAP for g in gaps) if pushed else all(g > 1e-2 for g in gaps), (sync, gaps)
        assert (push.bytes == full_bytes and push.seconds > 0) if pushed else push is None, (sync, push)
    assert rollout.failover.dropped == {}
    streamed = [s.logprobs(seq) for s in servers]
    whole = backend([s.url for s in servers], timeout_s=60).setup(RolloutSetup(model, tokenizer))  # one bucket
    assert whole.figures["buffer_bytes"] == full_bytes
    assert all(torch.equal(a, s.logprobs(seq)) for a, s in zip(streamed, servers, strict=True))


def sparse_step(model, seed: int, fraction: float = 0.01) -> None:
    """About ``fraction`` of every weight's elements moved (an RL step, as bf16 sees it)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            pick = torch.rand(p.shape, generator=generator) < fraction
            p.add_(0.05 * torch.randn(p.shape, generator=generator) * pick)


def test_delta_pushes_leave_the_servers_where_full_pushes_do_and_a_drifted_copy_is_caught(servers, tokenizer):
    """delta_push: after a full push at setup and at the first sync, three syncs send only the
    changed elements (logged bytes well under a full push's) and each server's log-probs equal
    the learner's; after them, a full push of the same weights leaves every log-prob bit for
    bit where the deltas had (the engines hold the same weights). The deltas stream in buckets
    of a quarter MiB, the full push in one. The negative control: the
    learner believes a server holds one element it does not; the server's checksum refuses the
    push, and a full push afterwards brings it back."""
    seq = tokenizer("Think step by step. What is 12 * 7?")["input_ids"]
    model = build_model(tokenizer, seed=3, hidden_size=HIDDEN).float()
    urls = [s.url for s in servers]
    rollout = backend(urls, delta_push=True, timeout_s=60, push_bucket_mb=BUCKET_MB)
    rollout.setup(RolloutSetup(model, tokenizer))
    sent = []
    for sync in range(1, 5):
        sparse_step(model, sync)
        sent.append(in_thread(rollout.sync_weights, model).metrics())
        assert all(gap(s, model, seq) <= GAP for s in servers), sync
    assert rollout.failover.dropped == {}
    # the first sync: whole (a resumed run's weights)
    assert sent[0]["sync/push_bytes"] == sent[0]["sync/push_full_bytes"] and sent[0]["sync/push_seconds"] > 0
    assert all(0 < p["sync/push_bytes"] < 0.2 * p["sync/push_full_bytes"] for p in sent[1:]), sent
    assert all(0 < p["sync/push_buffer_bytes"] <= BUCKET_MB * 2**20 for p in sent), sent
    after_deltas = [s.logprobs(seq) for s in servers]
    backend(urls, timeout_s=60).setup(RolloutSetup(model, tokenizer))  # a full push of the same weights
    after_full = [s.logprobs(seq) for s in servers]
    assert all(torch.equal(a, b) for a, b in zip(after_deltas, after_full, strict=True))

    # The negative control, on the first server.
    drifted = backend(urls[:1], delta_push=True, timeout_s=60)
    drifted.setup(RolloutSetup(model, tokenizer))
    in_thread(drifted.sync_weights, model)  # the first sync (whole)
    name, weight = "model.layers.0.mlp.down_proj.weight", model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        weight.view(-1)[7] += 0.5
    drifted.encoders["float32"].held[name].view(-1)[7] = weight.view(-1)[7]  # believed already there
    in_thread(drifted.sync_weights, model)
    assert "checksum" in drifted.failover.dropped.get(urls[0], ""), drifted.failover.dropped
    backend(urls[:1], timeout_s=60).setup(RolloutSetup(model, tokenizer))
    assert gap(servers[0], model, seq) <= GAP


def test_two_servers_split_a_batch_and_sample_what_one_would(servers, tokenizer, prompts):
    """Both servers get requests, and the batch equals the one a single server gives for the
    same seed and weights (seeds are per prompt, so who samples does not matter). The split
    batch is generated in another thread, as asynchronous training's actor does."""
    model = build_model(tokenizer, seed=2, hidden_size=HIDDEN).float()
    both = backend([s.url for s in servers])
    both.setup(RolloutSetup(model, tokenizer))
    sampling = SamplingParams(max_new_tokens=6, seed=11)
    before = [s.finished_requests() for s in servers]
    split = in_thread(both.generate, prompts, 3, sampling)
    assert all(s.finished_requests() > b for s, b in zip(servers, before, strict=True))
    alone = backend([servers[0].url])
    alone.setup(RolloutSetup(model, tokenizer))
    single = alone.generate(prompts, 3, sampling)
    assert split.completion_ids.shape[0] == 3 * len(prompts)
    assert torch.equal(split.completion_ids, single.completion_ids)
    assert torch.equal(split.completion_mask, single.completion_mask)
    torch.testing.assert_close(split.sampling_logp, single.sampling_logp, atol=1e-5, rtol=0)
    mask = split.completion_mask
    assert bool((split.sampling_logp[mask] < 0).all()) and bool((split.sampling_logp[~mask] == 0).all())
    greedy = both.generate(prompts, 3, SamplingParams(max_new_tokens=6, greedy=True))
    rows = greedy.completion_ids.view(len(prompts), 3, -1)
    assert torch.equal(rows, rows[:, :1].expand_as(rows))  # one greedy completion, repeated G times
    assert torch.equal(greedy.completion_ids, alone.generate(prompts, 3, SamplingParams(max_new_tokens=6,
                                                                                        greedy=True)).completion_ids)


def write_spec(folder: Path, model_dir: Path, rollout: dict, **changes) -> Path:
    spec = json.loads(json.dumps(SPEC))
    spec["model"] = {"path": str(model_dir)}
    spec["rollout"] = {"group_size": 4, "max_new_tokens": 6, **rollout}
    for section, values in changes.items():
        spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.yaml").write_text(json.dumps(spec), encoding="utf-8")
    return folder / "spec.yaml"


def run(args: list, cwd: Path, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    child = {**os.environ, **CHILD_ENV, **(env or {})}
    return subprocess.run([sys.executable, "-m", "grpo_core.cli", "run", *map(str, args)],
                          cwd=cwd, env=child, capture_output=True, text=True, timeout=timeout)


LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(
    ("case", "args", "changes"),
    [
        ("lora-multi-turn", [], {
            "model": {"lora": LORA}, "train": {"steps": 3, "lr": 5.0e-2}, "plugins": ["countdown.py"],
            "rollout": {"environment": {"name": "countdown", "max_turns": 3, "max_total_tokens": 48}},
            "rewards": [{"name": "env_reward"}]}),
        ("fsdp2-2-processes-sampled-eval", ["--nproc", "2"], {
            "train": {"steps": 2, "parallel": {"strategy": "fsdp2"}}, "data": {"eval_size": 4},
            "eval": {"at_end": True, "n": 2, "greedy": False}}),
    ],
    ids=["lora-multi-turn", "fsdp2-2-processes-sampled-eval"],
)
def test_a_run_trains_on_two_servers(servers, model_dir, tmp_path, case, args, changes):
    """grpo-run with rollout.name vllm-server: every step's sampler log-probs (the servers')
    equal the trainer's to 1e-4, so each update reached both servers before the next rollout.
    lora-multi-turn: each push is the merged adapter (lora_push: auto on servers started
    without --enable-lora merges, and says why in the log); two-turn episodes, the server generating
    each turn after the environment's message. fsdp2 over two processes: every process gathers
    the sharded weights once per push, the first one pushes, both generate on the servers; the
    held-out evaluation samples there too."""
    changes = json.loads(json.dumps(changes))
    changes.setdefault("model", {})["path"] = str(model_dir)
    rollout = {"name": "vllm-server", "urls": [s.url for s in servers], **changes.pop("rollout", {})}
    (tmp_path / "countdown.py").write_text(COUNTDOWN)
    spec = write_spec(tmp_path, model_dir, rollout, **changes)
    done = run([spec, *args], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = step_rows(tmp_path / "out")
    steps = changes["train"]["steps"]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["rollout_correction/logp_diff/max"] <= GAP for r in rows), rows
    # merged pushes (the LoRA merged, or plain full weights) are measured at every step
    assert all(r["sync/push_bytes"] > 0 and r["sync/push_seconds"] > 0 for r in rows), rows
    if case.startswith("lora"):  # servers without --enable-lora: auto merges, saying so
        assert ("full merged weights (lora_push: auto, and the server http://127.0.0.1:"
                in done.stderr and "was not started with LoRA" in done.stderr), done.stderr[-4000:]
        assert all(r["env/turns_per_episode"] == 2.0 and r["env/env_tokens"] > 0 for r in rows), rows
    else:  # (a LoRA run saves the adapter, not merged weights)
        assert max_change(tmp_path / "out", model_dir) > 1e-2
        final = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][-1]
        assert [k for k in final if k.startswith("eval/") and "@2" in k], final


def test_push_every_two_lags_one_step_and_a_resume_pushes_the_resumed_weights(servers, model_dir, tmp_path):
    """push_every 2: pushes at setup and at syncs 1, 3, ...: steps 1 and 2 sample with the
    current policy, step 3 with the one of a step before (the sampler/trainer gap shows it);
    a resumed run's first sync pushes the checkpoint's weights, so its step 4 samples with them."""
    rollout = {"name": "vllm-server", "urls": [servers[0].url], "push_every": 2}
    spec = write_spec(tmp_path, model_dir, rollout, train={"steps": 3}, checkpoint={"every": 1, "keep": 3})
    done = run([spec], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    done = run([spec, "--set", "train.steps=4", "--resume"], tmp_path)
    assert done.returncode == 0 and "(step 3)" in done.stderr, done.stderr[-4000:]
    rows = step_rows(tmp_path / "out")
    gaps = {r["step"]: r["rollout_correction/logp_diff/max"] for r in rows}
    assert sorted(gaps) == [1, 2, 3, 4]
    # every step logs the plain full push its rollouts sampled after (step 3: step 1's, skipped since)
    assert len({r["sync/push_bytes"] for r in rows}) == 1 and all(r["sync/push_seconds"] > 0 for r in rows), rows
    assert gaps[1] <= GAP and gaps[2] <= GAP and gaps[4] <= GAP, gaps
    assert gaps[3] > 10 * GAP, gaps  # sampled with the weights of step 1's update, trained from step 2's


def test_a_delta_pushing_run_logs_its_bytes_and_pushes_whole_after_a_resume(servers, model_dir, tmp_path):
    """grpo-run with delta_push: the servers sample with the trained weights at every step (the
    sampler/trainer gap), the pushes before steps 1 and 2 (setup, first sync) and the resumed
    run's before step 4 are whole, and the one before step 3 sends fewer bytes than a full push
    (the embedding rows of tokens no batch held do not move); each logged as sync/push_*."""
    rollout = {"name": "vllm-server", "urls": [servers[0].url], "delta_push": True}
    spec = write_spec(tmp_path, model_dir, rollout, train={"steps": 3}, checkpoint={"every": 1, "keep": 3})
    done = run([spec], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    done = run([spec, "--set", "train.steps=4", "--resume"], tmp_path)
    assert done.returncode == 0 and "(step 3)" in done.stderr, done.stderr[-4000:]
    rows = {r["step"]: r for r in step_rows(tmp_path / "out")}
    assert sorted(rows) == [1, 2, 3, 4]
    assert all(r["rollout_correction/logp_diff/max"] <= GAP for r in rows.values()), rows
    whole = {s: rows[s]["sync/push_bytes"] == rows[s]["sync/push_full_bytes"] for s in rows}
    assert whole == {1: True, 2: True, 3: False, 4: True}, {s: (r["sync/push_bytes"], r["sync/push_full_bytes"])
                                                          for s, r in rows.items()}
    assert rows[3]["sync/push_bytes"] < rows[3]["sync/push_full_bytes"]


def test_an_asynchronous_run_generates_on_the_servers_from_the_actors_thread(servers, model_dir, tmp_path):
    """rollout.max_staleness: 1 on two servers: the actor's thread generates on them and pushes
    the snapshot of each version through the weight channel. A batch sampled at the learner's
    own version (the first step, and the step after the evaluation at step 2 restarted the
    pipeline with the current weights) matches the trainer to 1e-4; one sampled a version
    earlier does not (the rollout correction sees the lag)."""
    rollout = {"name": "vllm-server", "urls": [s.url for s in servers], "max_staleness": 1}
    spec = write_spec(tmp_path, model_dir, rollout, train={"steps": 4}, data={"eval_size": 2},
                      eval={"every": 2, "at_start": False, "at_end": False})
    done = run([spec], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["async/staleness"] for r in rows if "async/staleness" in r] == [0, 1, 0, 1]
    # a step whose advantages are all 0 takes no forward, so logs no gap: check those that do
    gaps = {r["step"]: (r["async/staleness"], r["rollout_correction/logp_diff/max"])
            for r in step_rows(tmp_path / "out")}
    assert any(staleness == 0 for staleness, _ in gaps.values()) and any(s == 1 for s, _ in gaps.values()), gaps
    for step, (staleness, gap) in gaps.items():
        assert (gap <= GAP) if staleness == 0 else (gap > 1e-3), (step, gap)


def test_a_hung_server_is_failed_over_with_the_same_batch(servers, tokenizer, prompts):
    """A server that stops answering (SIGSTOP) is dropped after timeout_s and its prompts go
    to the other; the batch is the one both would have given. Pushes then skip it."""
    model = build_model(tokenizer, seed=3, hidden_size=HIDDEN).float()
    rollout = backend([s.url for s in servers], timeout_s=5, retries=0)
    rollout.setup(RolloutSetup(model, tokenizer))
    sampling = SamplingParams(max_new_tokens=6, seed=5)
    healthy = rollout.generate(prompts, 2, sampling)
    servers[1].signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        failed_over = rollout.generate(prompts, 2, sampling)
        assert time.monotonic() - start < 60
        assert list(rollout.failover.dropped) == [servers[1].url]
        assert "timed out" in rollout.failover.dropped[servers[1].url].lower()
        assert torch.equal(healthy.completion_ids, failed_over.completion_ids)
        perturb(model, 1)
        rollout.sync_weights(model)  # only the live server is pushed to
        seq = prompts[2]
        assert gap(servers[0], model, seq) <= GAP
    finally:
        servers[1].stop()


KILLER = """
import os, signal
from pathlib import Path
from grpo_core import hookimpl

def killer(prompts, completions, **kwargs):
    calls = Path("calls")
    n = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(n))
    if n == int(os.environ["KILL_AT"]):
        os.killpg(int(os.environ["KILL_PGID"]), signal.SIGKILL)
    return [float(len(c) % 3) for c in completions]

@hookimpl
def register_reward_functions(register):
    register.add("killer", killer)
"""


def test_a_run_whose_last_server_dies_stops_with_its_last_step_checkpointed(servers, model_dir, tmp_path):
    """The only server is killed (SIGKILL, from a reward function) during step 2: the run stops
    with exit 1, a message naming the server's URL and what failed, and a checkpoint of the
    last completed step."""
    server = servers[0]
    (tmp_path / "killer.py").write_text(KILLER)
    spec = write_spec(tmp_path, model_dir, {"name": "vllm-server", "urls": [server.url], "timeout_s": 10,
                                            "retries": 1},
                      plugins=["killer.py"], rewards=[{"name": "killer"}], train={"steps": 4})
    done = run([spec], tmp_path, env={"KILL_AT": "2", "KILL_PGID": str(server.proc.pid)})
    assert done.returncode == 1, done.stderr[-4000:]
    assert "no rollout server is left" in done.stderr and server.url in done.stderr, done.stderr[-2000:]
    assert "step 3 failed before its update; checkpoint of step 2" in done.stderr, done.stderr[-2000:]
    from grpo_core import checkpoint as ckpt

    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    completed = [r["step"] for r in rows if "loss" in r]
    assert completed == [1, 2], completed  # killed while step 2 was scored; step 3 found no server
    folders = ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")
    assert folders, done.stderr[-2000:]
    assert folders[-1].name == f"step-{max(completed):06d}", (folders, completed)


