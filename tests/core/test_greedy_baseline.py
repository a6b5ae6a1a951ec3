"""The greedy-baseline rollout (``needs_greedy_baseline``, ReMax) on real components: the
``hf`` backend on the tiny model, the step's scoring, and grpo-run end to end with a
third-party estimator that declares the flag; then every estimator of issue 28 B trained for
two steps on the tiny spec."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions

from grpo_core.cli import main
from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.actor.baseline import greedy_baseline_scores
from grpo_core.train.actor.data import Prompt
from grpo_core.train.actor.drivers.single_turn import SingleTurn
from grpo_core.train.actor.rollout import Scorer, score_rollout
from grpo_core.train.actor.scoring import RewardFn

from .conftest import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["What is 3 + 4?", "Hi", "Think step by step. What is 12 * 7? Answer:"]


def parity(prompts, completions, **_):
    """1 for a completion of even length, else 0: binary, and it varies on a random model."""
    return [float(len(c) % 2 == 0) for c in completions]


def test_greedy_baseline_is_the_score_of_each_prompts_argmax_completion():
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    backend = HFRollout(HFRolloutOptions())
    backend.setup(RolloutSetup(model, tokenizer))
    prompts = [Prompt({"prompt": t}, t, t, tokenizer(t)["input_ids"]) for t in TEXTS]
    scorer = Scorer([RewardFn.of("parity", 1.0, parity)], "prompt")
    sampling = SamplingParams(max_new_tokens=7, temperature=1.7, top_k=5, seed=3)  # greedy must override them

    got = greedy_baseline_scores(backend, lambda p, r: score_rollout(scorer, p, r), prompts, 4, sampling, SingleTurn())

    expected = []
    for p in prompts:  # each prompt alone, transformers' own argmax decoding
        ids = torch.tensor([p.ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=7,
                             pad_token_id=tokenizer.pad_token_id)
        expected.extend(parity([p.text], [tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)]))
    assert got.shape == (12,) and got.dtype == torch.float32
    assert got.tolist() == [e for e in expected for _ in range(4)]


PLUGIN = '''\
import json, os
import torch
from grpo_core import hookimpl
from grpo_core.groups import per_token


def parity(prompts, completions, completion_ids, **_):
    scores = [float(sum(ids) % 2 == 0) for ids in completion_ids]
    with open(os.environ["GRPO_TEST_LOG"], "a") as f:
        f.write(json.dumps({"kind": "reward", "completions": completions, "scores": scores}) + "\\n")
    return scores


class Recorder:
    """A third-party estimator that asks for the greedy baseline: r_i - b_i, recorded."""

    needs_greedy_baseline = True

    def __call__(self, inputs):
        with open(os.environ["GRPO_TEST_LOG"], "a") as f:
            f.write(json.dumps({"kind": "estimator", "scores": inputs.scores.tolist(),
                                "baseline": inputs.baseline_scores.tolist(),
                                "group_ids": inputs.group_ids.tolist()}) + "\\n")
        return per_token(torch.nan_to_num(inputs.scores - inputs.baseline_scores), inputs.mask)


def rare(prompts, completions, completion_ids, **_):
    scores = [float(sum(ids) % 5 == 0) for ids in completion_ids]
    with open(os.environ["GRPO_TEST_LOG"], "a") as f:
        f.write(json.dumps({"kind": "reward", "completions": completions, "scores": scores}) + "\\n")
    return scores


@hookimpl
def register_reward_functions(register):
    register.add("parity", parity)
    register.add("rare", rare)


@hookimpl
def register_advantage_estimators(register):
    register.add("recorder", Recorder())
'''


def _run(write_spec, folder: Path, monkeypatch, advantage: dict, **extra) -> list[dict]:
    (folder / "toy.py").parent.mkdir(parents=True, exist_ok=True)
    (folder / "toy.py").write_text(PLUGIN, encoding="utf-8")
    monkeypatch.setenv("GRPO_TEST_LOG", str(folder / "calls.jsonl"))
    spec = write_spec(folder, plugins=["toy.py"], rewards=extra.pop("rewards", [{"name": "parity"}]),
                      algorithm={"advantage": advantage, **extra.pop("algorithm", {})},
                      train={"steps": 2, "micro_batch_size": 4, "output_dir": "out"}, **extra)
    assert main([str(spec)]) == 0
    return read_metrics(folder / "out" / "metrics.jsonl")


def test_an_estimator_declaring_the_flag_gets_the_greedy_completions_scores(write_spec, tmp_path, monkeypatch):
    metrics = _run(write_spec, tmp_path, monkeypatch, {"name": "recorder"})
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    estimator_calls = [c for c in calls if c["kind"] == "estimator"]
    assert len(estimator_calls) == 2  # one per step
    for step, seen in enumerate(estimator_calls):
        # the step's reward calls: G completions of P prompts, then the P greedy ones
        rewards = [c for c in calls if c["kind"] == "reward"]
        sampled, greedy = rewards[2 * step], rewards[2 * step + 1]
        assert len(sampled["completions"]) == 8 and len(greedy["completions"]) == 2
        assert seen["scores"] == sampled["scores"]
        assert seen["baseline"] == [s for s in greedy["scores"] for _ in range(4)]
        assert seen["group_ids"] == [0, 0, 0, 0, 1, 1, 1, 1]
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 2 and all("time/baseline" in m for m in steps)


def test_estimators_without_the_flag_generate_no_greedy_rollout(write_spec, tmp_path, monkeypatch):
    metrics = _run(write_spec, tmp_path, monkeypatch, {"name": "grpo"})
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [len(c["completions"]) for c in calls] == [8, 8]
    assert not any("time/baseline" in m for m in metrics)


@pytest.mark.parametrize("advantage", [
    {"name": "passk", "k": 2},
    {"name": "opo"},
    {"name": "gpg"},
    {"name": "remax"},
    {"name": "reinforce++-no-baseline", "gamma": 0.9},
], ids=lambda a: a["name"])
def test_each_new_estimator_trains_on_the_tiny_spec(write_spec, tiny_model_dir, tmp_path, monkeypatch, advantage):
    from safetensors.torch import load_file

    metrics = _run(write_spec, tmp_path, monkeypatch, advantage)
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 2
    assert all(math.isfinite(m["loss"]) for m in steps)
    assert any(m["advantage/abs_max"] > 0 for m in steps)  # the estimator gave a signal
    assert ("time/baseline" in steps[0]) is (advantage["name"] == "remax")
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained


def test_under_dynamic_sampling_the_greedy_baseline_covers_the_kept_prompts(write_spec, tmp_path, monkeypatch):
    _run(write_spec, tmp_path, monkeypatch, {"name": "recorder"}, rewards=[{"name": "rare"}],
         algorithm={"dynamic_sampling": {"max_rounds": 4}})
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    step_calls, current = [], []
    for call in calls:  # each step: its rounds' reward calls, the greedy reward call, then the estimator
        current.append(call)
        if call["kind"] == "estimator":
            step_calls.append(current)
            current = []
    assert len(step_calls) == 2
    for calls_of_step in step_calls:
        *rounds, greedy, seen = calls_of_step
        assert rounds and all(len(c["completions"]) == 8 for c in rounds) and len(greedy["completions"]) == 2
        assert seen["baseline"] == [s for s in greedy["scores"] for _ in range(4)]
        # the kept groups are groups of the rounds' rollouts
        groups = [tuple(c["scores"][i:i + 4]) for c in rounds for i in (0, 4)]
        assert tuple(seen["scores"][:4]) in groups and tuple(seen["scores"][4:]) in groups
    assert max(len(c) - 2 for c in step_calls) > 1  # some step took several rounds: groups were selected
