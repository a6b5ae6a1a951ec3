"""Asynchronous rollouts (``rollout.max_staleness``): the fixed schedule, the threaded
pipeline against a one-thread reference of the same schedule, restarts and resumes, and the
rest of the engine (multi-turn, dynamic sampling, LoRA, evaluation, failures) on top."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.cli import main
from grpo_core.spec import load_spec
from grpo_core.testing import save_tiny_model
from grpo_core.train.feed import SyncFeed
from grpo_core.train.learner.batch import batch_logprobs
from grpo_core.train.learner.learner import train_batch
from grpo_core.train.learner.parallel import forward_of
from grpo_core.train.loop.assemble import build_run
from grpo_core.train.loop.step import train_step
from grpo_core.train.pipeline import sampled_version

from .conftest import CHILD_ENV

torch.set_num_threads(1)
SPECS = Path(__file__).resolve().parents[2] / "specs"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def make_run(tiny_model, tmp_path, *overrides):
    base = [f"model.path={tiny_model}", "tracking=[]", f"train.output_dir={tmp_path}", "train.progress=false",
            "train.threads=1", "eval.every=0", "eval.at_start=false", "eval.at_end=false"]
    return build_run(load_spec(SPECS / "tiny.yaml", [*base, *overrides]))


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- the schedule
@given(st.integers(0, 50), st.integers(0, 50), st.integers(1, 8))
def test_no_batch_is_sampled_more_than_k_versions_before_it_is_trained(step, start, k):
    """Trained at version ``step`` (one update per step), sampled at ``max(start, step - k)``:
    staleness in ``[0, k]``, exactly ``k`` once ``k`` steps past a restart, and never a
    version the learner has not reached."""
    if step < start:
        return
    version = sampled_version(step, start, k)
    assert start <= version <= step
    assert 0 <= step - version <= k
    assert (step - version == k) == (step - start >= k)


# ----------------------------------------------------------------------------- the pipeline
def _reference(run, k: int, steps: int) -> tuple[dict, list[int], list[torch.Tensor]]:
    """The schedule in one thread: keep every version's weights; the batch of step ``t`` is
    sampled from version ``max(0, t - k)`` (loaded into the sampler copy), its sampler
    log-probs computed with that copy, and trained on. Final weights, sampled versions, and
    each batch's sampler log-probs."""
    learner, actor = run.learner, run.actor
    sampler = run.feed.sampler
    versions = {0: weights(learner.model)}
    sampled, sampler_logp = [], []
    for t in range(steps):
        v = sampled_version(t, 0, k)
        sampler.load_state_dict(versions[v])
        actor.version = v
        experience = actor.collect(t)
        batch = train_batch(experience.scored.rollout, mask_truncated=False)
        micro = run.spec.train.micro_batch_size or batch.mask.shape[0]
        logp = batch_logprobs(forward_of(sampler), batch, micro, run.spec.rollout.temperature, actor.autocast,
                              packed=learner.packs)  # as the learner computes them
        experience.scored.rollout.sampling_logp = logp.masked_fill(~batch.mask, 0.0)
        learner.learn(experience)
        versions[t + 1] = weights(learner.model)
        sampled.append(experience.version)
        sampler_logp.append(experience.scored.rollout.sampling_logp)
    return versions[steps], sampled, sampler_logp


@pytest.mark.parametrize("k", [1, 2])
def test_the_threaded_pipeline_trains_exactly_as_its_schedule_run_in_one_thread(tiny_model, tmp_path, k):
    steps = 5
    threaded = make_run(tiny_model, tmp_path / "a", f"rollout.max_staleness={k}", f"train.steps={steps}")
    pipeline = threaded.feed
    assert pipeline is not None and pipeline.sampler is not None  # hf generates from a copy of its own
    assert threaded.actor.backend.model is pipeline.sampler
    pipeline.start(threaded.model, 0)
    metrics = []
    try:
        for t in range(steps):
            metrics.append(train_step(pipeline, threaded.learner, t).metrics)
    finally:
        pipeline.close()
    alone = make_run(tiny_model, tmp_path / "b", f"rollout.max_staleness={k}", f"train.steps={steps}")
    final, sampled, _ = _reference(alone, k, steps)

    assert [m["async/staleness"] for m in metrics] == [t - v for t, v in enumerate(sampled)]
    assert [m["async/staleness"] for m in metrics] == [min(t, k) for t in range(steps)]
    got = weights(threaded.model)
    assert got.keys() == final.keys()
    for name in final:
        assert torch.equal(got[name], final[name]), name
    # the stale batches were corrected: the sampler's log-probs differ from the trainer's there
    assert metrics[0]["rollout_correction/logp_diff"] == 0.0  # version 0 trained at version 0
    assert metrics[-1]["rollout_correction/logp_diff"] > 0.0
    for m in metrics:
        assert {"async/queue_depth", "time/learner_wait", "time/actor_wait", "async/dropped_batches"} <= m.keys()


def test_the_learner_never_writes_a_snapshot_the_actor_is_still_reading(tiny_model, tmp_path, monkeypatch):
    """k = 2 and an actor slow to apply weights: the learner, done with step 1, waits to
    publish version 2 while the actor takes version 1 out of the slot for batch 3. Had the
    slot been freed before the actor's copy, version 2 would overwrite the snapshot first and
    batch 3 would be sampled from the wrong weights: the run trains as its schedule says."""
    from grpo_core.train import pipeline as pipeline_module

    steps, k = 5, 2
    threaded = make_run(tiny_model, tmp_path / "a", f"rollout.max_staleness={k}", f"train.steps={steps}")
    real = pipeline_module.copy_weights

    def slow_copy(into, model):
        if into is threaded.feed.sampler:
            time.sleep(0.3)
        real(into, model)

    monkeypatch.setattr(pipeline_module, "copy_weights", slow_copy)
    threaded.feed.start(threaded.model, 0)
    try:
        for t in range(steps):
            train_step(threaded.feed, threaded.learner, t)
    finally:
        threaded.feed.close()
    monkeypatch.setattr(pipeline_module, "copy_weights", real)
    final, _, _ = _reference(make_run(tiny_model, tmp_path / "b", f"rollout.max_staleness={k}",
                                      f"train.steps={steps}"), k, steps)
    got = weights(threaded.model)
    for name in final:
        assert torch.equal(got[name], final[name]), name


def test_the_sampler_log_probs_are_those_of_the_version_the_batch_was_sampled_with(tiny_model, tmp_path):
    """The behaviour policy of the correction: a batch sampled at version 1 carries version 1's
    log-probs, not the learner's newer ones."""
    run = make_run(tiny_model, tmp_path, "rollout.max_staleness=1", "train.steps=3")
    _, sampled, sampler_logp = _reference(run, 1, 3)
    assert sampled == [0, 0, 1]
    again = make_run(tiny_model, tmp_path / "again", "rollout.max_staleness=1", "train.steps=3")
    again.feed.start(again.model, 0)
    try:
        train_step(again.feed, again.learner, 0)
        train_step(again.feed, again.learner, 1)
        experience, _ = again.feed.take(2)
    finally:
        again.feed.close()
    assert experience.version == 1
    assert torch.equal(experience.scored.rollout.sampling_logp, sampler_logp[2])
    batch = train_batch(experience.scored.rollout, mask_truncated=False)
    newest = batch_logprobs(forward_of(again.model), batch, batch.mask.shape[0], 1.0, again.actor.autocast)
    assert float((newest - sampler_logp[2])[batch.mask].abs().max()) > 1e-6


@pytest.mark.slow
def test_two_processes_run_asynchronously_as_one_does(tmp_path, write_spec, kit):
    """The actors of two processes collect in threads with a process group of their own
    while the learners train: under FSDP2 (full weights gathered once per publish) the run
    takes the steps one process takes; under DDP with dynamic sampling, whose rounds the
    actors agree on through their group, it runs to the end within its staleness bound."""
    spec = write_spec(
        tmp_path, data={"eval_size": 4}, rollout={"max_staleness": 1, "prompts_per_generate": 1},
        algorithm={"advantage": {"name": "grpo", "std_scope": "batch"}, "aggregation": {"name": "token-mean"}},
        train={"steps": 4, "prompts_per_step": 4, "seed": 3},
        eval={"every": 2, "at_start": False, "at_end": True, "max_prompts": 4},
    )
    env = {**os.environ, **CHILD_ENV}
    env.pop("WORLD_SIZE", None)
    runs = {
        "one": [],
        "fsdp2": ["--nproc", "2", "--set", "train.parallel.strategy=fsdp2"],
        "ddp": ["--nproc", "2", "--set", "algorithm.dynamic_sampling.max_rounds=2"],
    }
    for out, extra in runs.items():
        done = subprocess.run([sys.executable, "-m", "grpo_core.cli", "run", str(spec), *extra,
                               "--set", f"train.output_dir={out}"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (out, done.stderr)
    one, two = kit.load_weights(tmp_path / "one" / "final"), kit.load_weights(tmp_path / "fsdp2" / "final")
    assert max(float((one[k].float() - two[k].float()).abs().max()) for k in one) < 5e-5
    rows = {out: [r for r in kit.read_metrics(tmp_path / out / "metrics.jsonl") if "loss" in r] for out in runs}
    for out in runs:
        assert [r["async/staleness"] for r in rows[out]] == [0, 1, 0, 1], out
    for r1, r2 in zip(rows["one"], rows["fsdp2"]):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-3, abs=1e-6)
    assert all(r["dynamic_sampling/groups_kept"] + r["dynamic_sampling/groups_filled"] == 4 for r in rows["ddp"])


def test_max_staleness_0_is_the_synchronous_loop(tiny_model, tmp_path):
    run = make_run(tiny_model, tmp_path, "rollout.max_staleness=0")
    assert isinstance(run.feed, SyncFeed) and run.actor.backend.model is run.model


@pytest.mark.parametrize("k", [0, 1])
def test_a_failure_at_rest_leaves_the_actor_stopped_and_the_prompts_where_they_stood(tiny_model, tmp_path, k):
    """An error inside ``run.at_rest()`` (a full disk while checkpointing, a reward model that
    fails to fit at an iteration start) does not start the actor's thread again, and prompts
    drawn inside are given back, so the failed step's checkpoint resumes exactly."""
    run = make_run(tiny_model, tmp_path, f"rollout.max_staleness={k}", "train.steps=4")
    run.feed.start(run.model, 0)
    try:
        train_step(run.feed, run.learner, 0)
        assert run.step == 1  # the learner's version is the run's step
        with pytest.raises(OSError, match="disk full"):
            with run.at_rest():
                before = run.prompts.state_dict()
                run.prompts.next(2)
                raise OSError("disk full")
        assert run.prompts.state_dict() == before
        assert not getattr(run.feed, "running", False)
    finally:
        run.feed.close()


# ----------------------------------------------------------------------------- whole runs
def _grpo(spec_path: Path, out: Path, *sets: str, resume: bool = False) -> int:
    args = [str(spec_path), "--set", f"train.output_dir={out}", *[x for s in sets for x in ("--set", s)]]
    return main([*args, "--resume", "latest"] if resume else args)


def test_a_resumed_asynchronous_run_trains_on_exactly_what_the_uninterrupted_run_did(
        tmp_path, write_spec, kit):
    """A checkpoint restarts the pipeline (the batches generated ahead are dropped and
    regenerated from the checkpoint's weights), so resuming from it repeats the run."""
    spec = write_spec(tmp_path, rollout={"max_staleness": 2}, train={"steps": 6},
                      checkpoint={"every": 3, "keep": 5})
    assert _grpo(spec, tmp_path / "whole") == 0
    assert _grpo(spec, tmp_path / "cut", "train.steps=3") == 0
    assert _grpo(spec, tmp_path / "cut", resume=True) == 0
    whole, cut = kit.load_weights(tmp_path / "whole" / "final"), kit.load_weights(tmp_path / "cut" / "final")
    for name in whole:
        assert torch.equal(whole[name], cut[name]), name
    rows = {r["step"]: r for r in kit.read_metrics(tmp_path / "whole" / "metrics.jsonl") if "loss" in r}
    resumed = {r["step"]: r for r in kit.read_metrics(tmp_path / "cut" / "metrics.jsonl") if "loss" in r}
    # staleness restarts at 0 after the checkpoint of step 3, in both runs
    assert [rows[s]["async/staleness"] for s in range(1, 7)] == [0, 1, 2, 0, 1, 2]
    for s in (4, 5, 6):
        assert rows[s]["loss"] == resumed[s]["loss"] and rows[s]["reward"] == resumed[s]["reward"]


def test_an_asynchronous_run_evaluates_the_current_policy_and_trains_on(tmp_path, write_spec, kit):
    spec = write_spec(tmp_path, data={"eval_size": 4}, rollout={"max_staleness": 1}, train={"steps": 4},
                      eval={"every": 2, "at_start": True, "at_end": True, "max_prompts": 2})
    assert _grpo(spec, tmp_path / "out") == 0
    rows = kit.read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/reward" in r] == [0, 2, 4]
    steps = [r for r in rows if "loss" in r]
    assert [r["async/staleness"] for r in steps] == [0, 1, 0, 1]  # the evaluation at step 2 restarted it


def test_dynamic_sampling_and_lora_run_asynchronously(tmp_path, write_spec, kit):
    spec = write_spec(
        tmp_path, rollout={"max_staleness": 1}, train={"steps": 3},
        algorithm={"dynamic_sampling": {"max_rounds": 2}}, model={"lora": {"r": 4, "alpha": 8}},
    )
    assert _grpo(spec, tmp_path / "out") == 0
    steps = [r for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["async/staleness"] for r in steps] == [0, 1, 1]
    assert all("dynamic_sampling/rounds" in r for r in steps)


def test_multi_turn_episodes_run_asynchronously(tmp_path, write_spec, kit):
    model = save_tiny_model(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # room for the tools' schemas in the prompt
    (model / "config.json").write_text(json.dumps(config))
    spec = write_spec(
        tmp_path, model={"path": str(model)},
        rollout={"max_staleness": 1,
                 "environment": {"name": "tools", "tools": ["calculator"], "max_turns": 2, "max_total_tokens": 16}},
        train={"steps": 2},
    )
    assert _grpo(spec, tmp_path / "out") == 0
    steps = [r for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["async/staleness"] for r in steps] == [0, 1]
    assert all(r["env/turns_per_episode"] >= 1 for r in steps)


FAILING_REWARD = """
from pathlib import Path

from grpo_core import hookimpl

COUNT = Path(__file__).with_name("calls.txt")  # reward calls may run in worker processes


def fails_third(prompts, completions, **kwargs):
    calls = int(COUNT.read_text() if COUNT.exists() else "0") + 1
    COUNT.write_text(str(calls))
    if calls >= 3:
        raise ValueError("third batch")
    return [float(len(str(c)) % 3) for c in completions]


@hookimpl
def register_reward_functions(register):
    register.add("fails_third", fails_third)
"""


def test_a_failure_in_the_actors_thread_stops_the_run_with_the_last_completed_step_saved(
        tmp_path, write_spec, kit, capsys):
    """The actor fails while collecting the batch of step 2 (ahead of the learner): the run
    stops with exit 1, reports the reward, and the checkpoint of the last completed step
    resumes at the batch that failed."""
    (tmp_path / "failing.py").write_text(FAILING_REWARD)
    spec = write_spec(tmp_path, plugins=["failing.py"], rewards=[{"name": "fails_third"}],
                      rollout={"max_staleness": 1}, train={"steps": 4, "reward_errors": "raise"})
    assert _grpo(spec, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert "fails_third" in err
    saved = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert saved and saved[-1].endswith("000002")


# ----------------------------------------------------------------------------- nothing generated in vain
COUNTING_REWARD = """
import json
from pathlib import Path

from grpo_core import hookimpl

CALLS = Path(__file__).with_name("calls.jsonl")  # reward calls may run in worker processes


def counted(prompts, completions, **kwargs):
    kinds = sorted({"eval" if "held-out" in str(p) else "train" for p in prompts})
    with CALLS.open("a") as f:
        f.write(json.dumps(kinds) + "\\n")
    return [float(len(str(c)) % 3) for c in completions]


@hookimpl
def register_reward_functions(register):
    register.add("counted", counted)
"""


def reward_calls(folder: Path) -> tuple[int, int]:
    """(calls on training batches, calls on held-out prompts) of the counting reward; a call
    never mixes the two."""
    calls = [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]
    assert all(len(kinds) == 1 for kinds in calls), calls
    return sum(k == ["train"] for k in calls), sum(k == ["eval"] for k in calls)


def counting_spec(folder: Path, write_spec, **sections) -> Path:
    (folder / "counting.py").write_text(COUNTING_REWARD)
    (folder / "train.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?"}) + "\n"
                                                for i in range(16)))
    (folder / "eval.jsonl").write_text("".join(json.dumps({"prompt": f"A held-out sum: {i} + 1 = ?"}) + "\n"
                                               for i in range(4)))
    data = {"name": "file", "train": "train.jsonl", "eval": "eval.jsonl", "train_size": None, "eval_size": None}
    return write_spec(folder, plugins=["counting.py"], rewards=[{"name": "counted"}], data=data, **sections)


@pytest.mark.parametrize(("checkpoint", "evaluate"), [
    ({"every": 2, "keep": 5}, {"every": 0}),
    ({"every": 0}, {"every": 0}),
    ({"every": 2, "keep": 5}, {"every": 2, "at_end": True, "max_prompts": 4}),
])
def test_the_actor_scores_no_batch_that_no_step_trains(tmp_path, write_spec, kit, monkeypatch, checkpoint,
                                                        evaluate):
    """Issue 60, item 4. max_staleness 1, 4 steps: the reward runs once per trained batch, 4
    times, whether checkpoints (and evaluations) come every 2 steps or not at all; the
    held-out evaluations' calls are their own. Before, in the runs measured: 7 calls with a
    checkpoint every 2 steps (a batch generated ahead, dropped at the checkpoint and generated
    again; one past the last step), 5 without, 8 with evaluations too. Staleness restarts at
    the rest of step 2 as it did."""
    spec = counting_spec(tmp_path, write_spec, rollout={"max_staleness": 1}, train={"steps": 4},
                         checkpoint=checkpoint, eval=evaluate)
    monkeypatch.chdir(tmp_path)
    assert main([str(spec)]) == 0
    rows = kit.read_metrics(tmp_path / "out" / "metrics.jsonl")
    trained = [r for r in rows if "loss" in r]
    evaluations = [r["step"] for r in rows if "eval/reward" in r]
    assert reward_calls(tmp_path) == (4, len(evaluations))
    assert evaluations == ([2, 4] if evaluate["every"] else [])
    restarted = checkpoint["every"] or evaluate["every"]
    assert [r["async/staleness"] for r in trained] == ([0, 1, 0, 1] if restarted else [0, 1, 1, 1])
    assert sum(r["async/dropped_batches"] for r in trained) == 0


def test_the_next_rest_is_the_first_evaluation_checkpoint_or_the_end(tiny_model, tmp_path):
    run = make_run(tiny_model, tmp_path, "rollout.max_staleness=1", "train.steps=10", "eval.every=3",
                   "checkpoint.every=4")
    assert [run.stages[-1].next_rest(s) for s in (0, 2, 3, 4, 6, 8, 9, 10)] == [3, 3, 4, 6, 8, 9, 10, 10]


def test_an_actor_told_the_run_stops_starts_no_batch_the_learner_has_not_asked_for(tiny_model, tmp_path):
    """A signal or a hook's stop (here from the start): with k = 2 the actor would run two
    batches ahead; told the run stops, it starts none the learner has not asked for, yet
    serves a step asked for after the stop (the learner had passed its check before the
    signal came)."""
    run = make_run(tiny_model, tmp_path, "rollout.max_staleness=2", "train.steps=4")
    collected, original = [], run.actor.collect

    def collect(step):
        collected.append(step)
        return original(step)

    run.actor.collect = collect
    run.feed.start(run.model, 0, run.stages[-1].next_rest, lambda: True)
    try:
        train_step(run.feed, run.learner, 0)
        time.sleep(1.0)
        assert collected == [0]
        train_step(run.feed, run.learner, 1)
        time.sleep(0.5)
        assert collected == [0, 1]
        experience, metrics = run.feed.take(2)
        assert experience.step == 2 and collected == [0, 1, 2] and metrics["async/staleness"] == 2
    finally:
        run.feed.close()
