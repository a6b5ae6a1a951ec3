"""Partial rollouts on a real vLLM engine (``rollout.partial_rollouts``): a weight push that
reaches the colocated ``vllm`` backend mid-generation (its :class:`WeightSwitch` fires after
a set number of engine steps, so the cut is exact).

What each test pins: without an interruption the step-by-step path samples what one
``llm.generate`` samples; with one, every completion's tokens before the push are those of
the uninterrupted run with the old weights, the later ones carry the new version and their
sampler log-probs are the new policy's (<= 1e-4), the earlier ones' the old policy's, and no
token is lost (each completion's length is what the budget and its stop allow).
"""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch
from grpo_plugins.vllm.colocated import VLLMRollout

from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.testing import build_model

from .conftest import HIDDEN
from .test_engine import _nudge, engine_options, trainer_logps

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

TOL = 1e-4


class StepSwitch:
    """Newer weights (``model``, version ``version + 1``) wait from the ``after``-th poll on."""

    def __init__(self, backend, model, after: int, version: int = 0):
        self.backend, self.model, self.after, self.version = backend, model, after, version
        self.polls = 0
        self.taken = 0

    def pending(self) -> bool:
        self.polls += 1
        return self.model is not None and self.polls >= self.after and self.taken == 0

    def take(self) -> int:
        self.backend.sync_weights(self.model)
        self.taken += 1
        self.version += 1
        return self.version


@pytest.fixture(scope="module")
def policy(tokenizer):
    return build_model(tokenizer, hidden_size=HIDDEN, seed=0).eval()


@pytest.fixture(scope="module")
def engine(policy, tokenizer):
    backend = VLLMRollout(engine_options())
    backend.setup(RolloutSetup(policy, tokenizer))
    return backend


SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5)


def test_without_an_interruption_the_stepped_path_samples_what_generate_does(engine, prompts):
    engine.switch = None
    want = engine.generate(prompts, 4, SAMPLING)
    engine.switch = StepSwitch(engine, None, after=0)
    try:
        got = engine.generate(prompts, 4, SAMPLING)
    finally:
        engine.switch = None
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.completion_mask, want.completion_mask)
    assert torch.equal(got.truncated, want.truncated)
    assert torch.equal(got.sampling_logp, want.sampling_logp)
    assert got.token_versions is not None and int(got.token_versions.max()) == 0


def test_a_push_mid_generation_keeps_the_prefix_and_samples_the_rest_from_the_new_policy(engine, policy, prompts):
    new = copy.deepcopy(policy)
    _nudge(new, seed=3)
    engine.switch = StepSwitch(engine, None, after=0)
    try:
        plain = engine.generate(prompts, 4, SAMPLING)  # the uninterrupted run, old weights
        switch = StepSwitch(engine, new, after=6)
        engine.switch = switch
        cut = engine.generate(prompts, 4, SAMPLING)
    finally:
        engine.switch = None
        engine.sync_weights(policy)
    assert switch.taken == 1
    versions, mask = cut.token_versions, cut.completion_mask
    assert versions.shape == mask.shape and versions.dtype == torch.long
    old, late = mask & (versions == 0), mask & (versions == 1)
    assert int(old.sum()) > 0 and int(late.sum()) > 0, "the push did not land mid-generation"
    assert not bool((versions[~mask] != 0).any())
    # versions never go back along a completion
    assert bool((versions[:, 1:] >= versions[:, :-1]).logical_or(~mask[:, 1:]).all())
    # before the push: the uninterrupted run's tokens, with the old policy's log-probs
    width = min(plain.completion_ids.shape[1], cut.completion_ids.shape[1])
    assert torch.equal(cut.completion_ids[:, :width][old[:, :width]], plain.completion_ids[:, :width][old[:, :width]])
    mine_old = trainer_logps(policy, cut)
    mine_new = trainer_logps(new, cut)
    assert float((mine_old - cut.sampling_logp).abs()[old].max()) <= TOL
    # after it: sampled from the new policy given the whole prefix
    gap = (mine_new - cut.sampling_logp).abs()[late]
    assert float(gap.max()) <= TOL, float(gap.max())
    assert float((mine_old - cut.sampling_logp).abs()[late].max()) > 1e-2  # not the old policy's
    # nothing lost: a completion ends at its EOS or at the budget
    lengths = mask.sum(1)
    ended = [bool(row[n - 1] in engine.eos_ids) for row, n in zip(cut.completion_ids.tolist(), lengths.tolist())]
    assert all(e or n == SAMPLING.max_new_tokens for e, n in zip(ended, lengths.tolist()))
    assert torch.equal(cut.truncated, torch.tensor([not e for e in ended]))


# --------------------------------------------------------------------------- rollout servers
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One ``grpo-run serve`` server of a tiny model; the learner sends its secret."""
    from grpo_core.testing import save_tiny_model

    from .test_servers import SECRET, START_S, Server

    before = os.environ.get("GRPO_SERVE_SECRET")
    os.environ["GRPO_SERVE_SECRET"] = SECRET
    folder = tmp_path_factory.mktemp("partial-server")
    started = Server(save_tiny_model(folder / "model", hidden_size=HIDDEN), folder / "server.log")
    try:
        started.wait(time.monotonic() + START_S)
        yield started
    finally:
        started.stop()
        if before is None:
            os.environ.pop("GRPO_SERVE_SECRET", None)
        else:
            os.environ["GRPO_SERVE_SECRET"] = before


def test_a_push_mid_generation_on_a_server_keeps_the_prefix_and_samples_the_rest_from_the_new_policy(
        server, tokenizer, prompts):
    """The server is paused (vLLM's /pause?mode=abort) while it generates, the new weights
    pushed, and each unfinished completion continues from its prefix: its tokens before the
    push are the uninterrupted run's, the later ones are sampled from the new policy."""
    from .test_servers import backend, in_thread

    model = build_model(tokenizer, seed=4, hidden_size=HIDDEN).float()
    new = copy.deepcopy(model)
    _nudge(new, seed=5)
    sampling = SamplingParams(max_new_tokens=64, temperature=1.0, seed=9)
    rollout = backend([server.url], timeout_s=60)
    rollout.setup(RolloutSetup(model, tokenizer))
    rollout.switch = StepSwitch(rollout, None, after=0)
    plain = in_thread(rollout.generate, prompts, 4, sampling)
    switch = StepSwitch(rollout, new, after=3)  # 3 polls: about 60 ms into the batch
    rollout.switch = switch
    cut = in_thread(rollout.generate, prompts, 4, sampling)
    assert switch.taken == 1
    versions, mask = cut.token_versions, cut.completion_mask
    old, late = mask & (versions == 0), mask & (versions == 1)
    assert int(old.sum()) > 0 and int(late.sum()) > 0, "the push did not land mid-generation"
    width = min(plain.completion_ids.shape[1], cut.completion_ids.shape[1])
    assert torch.equal(cut.completion_ids[:, :width][old[:, :width]], plain.completion_ids[:, :width][old[:, :width]])
    assert float((trainer_logps(model, cut) - cut.sampling_logp).abs()[old].max()) <= TOL
    gap = (trainer_logps(new, cut) - cut.sampling_logp).abs()[late]
    assert float(gap.max()) <= TOL, float(gap.max())
    lengths = mask.sum(1).tolist()
    ended = [row[n - 1] in rollout.eos_ids for row, n in zip(cut.completion_ids.tolist(), lengths)]
    assert all(e or n == sampling.max_new_tokens for e, n in zip(ended, lengths))
    assert rollout.failover.dropped == {}


# --------------------------------------------------------------------------- runs
#: The colocated backend, with its switch answering only at the CUT-th engine step of a batch,
#: where it waits for the weights that are coming: every batch after the first since a
#: (re)start is cut at that step, so a run repeats exactly and a resume can be compared.
HELD = """
import time
from grpo_plugins.vllm.colocated import VLLMRollout, VLLMRolloutOptions
from grpo_core import hookimpl

CUT = 3

class Held:
    def __init__(self, inner):
        self.inner, self.polls = inner, 0

    @property
    def version(self):
        return self.inner.version

    def pending(self):
        self.polls += 1
        if self.polls != CUT:
            return False
        deadline = time.monotonic() + 120
        while self.inner.coming and not self.inner.pending() and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.inner.pending()

    def take(self):
        return self.inner.take()

class HeldVLLM(VLLMRollout):
    @property
    def switch(self):
        return self._held

    @switch.setter
    def switch(self, value):
        self._held = None if value is None else Held(value)

    def generate(self, *args, **kwargs):
        if self._held is not None:
            self._held.polls = 0
        return super().generate(*args, **kwargs)

@hookimpl
def register_rollout_backends(register):
    register.add("held-vllm", HeldVLLM, options=VLLMRolloutOptions)
"""


def test_a_partial_run_on_the_engine_bounds_every_token_and_resumes_exactly(tmp_path):
    """grpo-run with rollout.partial_rollouts on the colocated engine (max_staleness 1): each
    batch after the first since a (re)start takes the newer weights mid-generation (the
    switches), no token is more than 1 version old and the batch's later tokens are fresher;
    a checkpoint is a point of rest, so a run resumed from it trains on exactly what the
    uninterrupted run did (final weights bit for bit, each step's loss)."""
    from safetensors.torch import load_file

    from grpo_core.testing import save_tiny_model

    from .test_runs import grpo_run, write_spec

    model_dir = save_tiny_model(tmp_path / "model", hidden_size=HIDDEN)
    (tmp_path / "held_vllm.py").write_text(HELD, encoding="utf-8")
    changes = {"plugins": [str(tmp_path / "held_vllm.py")],
               "rollout": {"name": "held-vllm", "max_staleness": 1, "partial_rollouts": True, "max_new_tokens": 12},
               "train": {"steps": 5}, "checkpoint": {"every": 2, "keep": 5}}
    whole = write_spec(tmp_path / "whole", model_dir, **changes)
    grpo_run([whole], tmp_path / "whole", timeout=600)
    cut = write_spec(tmp_path / "cut", model_dir, **changes)
    grpo_run([cut, "--set", "train.steps=2"], tmp_path / "cut", timeout=600)
    grpo_run([cut, "--resume", "latest"], tmp_path / "cut", timeout=600)

    def rows(folder):
        lines = (folder / "out" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, filter(None, lines)) if "loss" in r}

    a, b = rows(tmp_path / "whole"), rows(tmp_path / "cut")
    assert [a[s]["async/switches"] for s in range(1, 6)] == [0, 1, 0, 1, 0]  # restarts at steps 2 and 4
    assert all(a[s]["async/staleness"] <= 1 and a[s]["async/token_staleness/max"] <= 1 for s in a)
    # logged step 2 (batch 1): its first tokens one version old, the rest current; step 3 (the
    # first batch after the checkpoint's restart) all current
    assert 0 < a[2]["async/token_staleness"] < 1 and a[3]["async/token_staleness"] == 0
    for s in (3, 4, 5):
        for key in ("loss", "reward", "async/token_staleness"):
            assert a[s][key] == b[s][key], (s, key)
    final = [load_file(str(next((tmp_path / f / "out" / "final").glob("*.safetensors")))) for f in ("whole", "cut")]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


COUNTING = """
from pathlib import Path
from grpo_core import hookimpl

CALLS = Path(__file__).with_name("calls.txt")

def counted(prompts, completions, **kwargs):
    with CALLS.open("a") as f:
        f.write(f"{len(completions)}\\n")
    return [float(len(str(c)) % 3) for c in completions]

@hookimpl
def register_reward_functions(register):
    register.add("counted", counted)
"""


def test_a_partial_run_on_the_engine_scores_no_batch_that_no_step_trains(tmp_path):
    """Issue 60, item 4, on the colocated engine: 6 steps, max_staleness 1, partial rollouts,
    a checkpoint every 3: the reward runs once per trained batch, 6 times (before: 9, the
    batch generated ahead of the checkpoint and the one past the last step generated and
    scored for nothing)."""
    from grpo_core.testing import save_tiny_model

    from .test_runs import grpo_run, write_spec

    model_dir = save_tiny_model(tmp_path / "model", hidden_size=HIDDEN)
    (tmp_path / "held_vllm.py").write_text(HELD, encoding="utf-8")
    (tmp_path / "counting.py").write_text(COUNTING, encoding="utf-8")
    plugins = [str(tmp_path / "held_vllm.py"), str(tmp_path / "counting.py")]
    spec = write_spec(tmp_path / "run", model_dir, plugins=plugins, rewards=[{"name": "counted"}],
                      rollout={"name": "held-vllm", "max_staleness": 1, "partial_rollouts": True, "max_new_tokens": 12},
                      train={"steps": 6}, checkpoint={"every": 3, "keep": 5})
    grpo_run([spec], tmp_path / "run", timeout=900)
    assert (tmp_path / "calls.txt").read_text().split() == ["8"] * 6  # 2 prompts x 4 completions a batch
    lines = (tmp_path / "run" / "out" / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, filter(None, lines)) if "loss" in r]
    assert [r["async/switches"] for r in rows] == [0, 1, 1, 0, 1, 1]  # restarted at step 3 as before
    assert sum(r["async/dropped_batches"] for r in rows) == 0
