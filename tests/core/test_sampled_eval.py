"""Sampled evaluation (mean@n, pass@k), named eval sets, and ``grpo-run eval`` on a saved
model, end to end on the tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo_core.cli import main
from grpo_core.train.loop.evaluate import sampled_metrics


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_sampled_metrics_by_hand():
    # 2 prompts x n=3 samples; functions (accuracy, format); the third sample of prompt 2 unscorable.
    table = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [math.nan, math.nan]])
    total = torch.tensor([1.5, 0.5, 1.0, 0.0, 0.5, math.nan])
    correct = torch.tensor([2, 0])
    out = sampled_metrics("eval/x/", 3, [1, 2, 3], ["accuracy", "format"], total, table, correct,
                          torch.tensor([4.0, 6.0, 2.0, 8.0, 4.0, 6.0]))
    assert out["eval/x/mean@3"] == pytest.approx((1.5 + 0.5 + 1.0 + 0.0 + 0.5) / 5)
    assert out["eval/x/rewards/accuracy/mean@3"] == pytest.approx(2 / 5)
    assert out["eval/x/rewards/format/mean@3"] == pytest.approx(3 / 5)
    assert out["eval/x/pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert out["eval/x/pass@2"] == pytest.approx((1 - 0 + 0) / 2)  # 1 - C(1,2)/C(3,2) = 1
    assert out["eval/x/pass@3"] == pytest.approx(0.5)
    assert out["eval/x/sampled/mean_length"] == pytest.approx(5.0)


EVAL = {
    "data": {"name": "arithmetic", "train_size": 16, "eval_size": 4},
    "eval": {"at_start": False, "at_end": True, "n": 4, "temperature": 1.0, "batch_size": 3,
             "sets": {"hard": {"data": {"name": "arithmetic", "num_terms": 3, "train_size": 1, "eval_size": 3}}}},
    "train": {"steps": 2},
}


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_then_eval_the_final_model(tmp_path, write_spec, capsys):
    spec = write_spec(tmp_path, **EVAL)
    assert main([str(spec)]) == 0
    capsys.readouterr()
    (last,) = [r for r in _rows(tmp_path / "out" / "metrics.jsonl") if "eval/reward" in r]
    for prefix, prompts in (("eval/", 4), ("eval/hard/", 3)):
        assert last[f"{prefix}prompts"] == prompts
        for key in ("reward", "rewards/accuracy", "rewards/format", "completions/mean_length", "mean@4",
                    "rewards/accuracy/mean@4", "pass@1", "pass@4", "sampled/mean_length"):
            assert math.isfinite(last[f"{prefix}{key}"]), (prefix, key)
        # accuracy is 0/1 and the threshold 1.0: pass@1 is the mean accuracy over samples.
        assert last[f"{prefix}pass@1"] == pytest.approx(last[f"{prefix}rewards/accuracy/mean@4"])
        assert last[f"{prefix}pass@1"] <= last[f"{prefix}pass@4"] <= 1.0
    assert "eval/pass@2" not in last  # default k: [1, n]

    # The saved model, evaluated without training, gives the figures the run logged at its end.
    assert main(["eval", str(spec), "--model", str(tmp_path / "out" / "final"), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated.keys() == {k for k in last if k.startswith("eval/")}
    for key, value in evaluated.items():
        assert value == pytest.approx(last[key], abs=1e-6), key
    # ... and as a table, one row per set and metric.
    assert main(["eval", str(spec), "--model", str(tmp_path / "out" / "final")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["set", "metric", "value"]
    assert any(line.split()[:2] == ["hard", "pass@4"] for line in table)
    assert any(line.split()[:2] == ["(default)", "reward"] for line in table)
    assert len(table) == 1 + len(evaluated)


def test_eval_of_the_base_model_and_of_a_checkpoint(tmp_path, write_spec, capsys):
    spec = write_spec(tmp_path, **{**EVAL, "train": {"steps": 1}, "checkpoint": {"every": 1},
                                   "eval": {"at_start": False, "at_end": False, "n": 2, "k": [1, 2]}})
    assert main(["eval", str(spec), "--json"]) == 0  # the spec's own (untrained) model
    base = json.loads(capsys.readouterr().out)
    assert set(base) == {"eval/reward", "eval/rewards/accuracy", "eval/rewards/format", "eval/completions/mean_length",
                         "eval/mean@2", "eval/rewards/accuracy/mean@2", "eval/rewards/format/mean@2",
                         "eval/pass@1", "eval/pass@2", "eval/sampled/mean_length", "eval/prompts"}
    assert main([str(spec)]) == 0
    capsys.readouterr()
    checkpoint = tmp_path / "out" / "checkpoints" / "step-000001"
    assert main(["eval", str(spec), "--model", str(checkpoint), "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert main(["eval", str(spec), "--model", str(tmp_path / "out" / "final"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == trained


def test_correct_threshold_and_reward(tmp_path, write_spec, capsys):
    """format scores 0/1: with it as the verifier pass@1 is its mean; no score reaches 2."""
    spec = write_spec(tmp_path, **{**EVAL, "eval": {"n": 3, "correct": {"reward": "format", "threshold": 1.0}}})
    assert main(["eval", str(spec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval/pass@1"] == pytest.approx(out["eval/rewards/format/mean@3"])
    assert main(["eval", str(spec), "--json", "--set", "eval.correct.threshold=2.0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval/pass@1"] == 0 and out["eval/pass@3"] == 0


@pytest.mark.parametrize(
    "model, message",
    [("missing", "--model {}: no such folder"), ("empty", "--model {}: the folder has no config.json")],
)
def test_a_bad_model_folder_exits_2(tmp_path, write_spec, capsys, model, message):
    spec = write_spec(tmp_path, **EVAL)
    folder = tmp_path / model
    if model == "empty":
        folder.mkdir()
    assert main(["eval", str(spec), "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert message.format(folder) in err and "runs/<name>/final" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n": 4, "k": [1, 5]}, "eval.k values must be in 1..eval.n (4); got [5]"),
        ({"k": [1]}, "eval.k needs eval.n > 0"),
        ({"n": 2, "correct": {"reward": "accurcy"}},
         "eval.correct.reward 'accurcy' must name an entry of rewards (accuracy, format)"),
        ({"sets": {"rewards": {"data": {"name": "arithmetic"}}}}, "eval set name 'rewards'"),
        ({"sets": {"hard": {"data": {"name": "arithmetc"}}}},
         "eval.sets.hard.data.name (line |): unknown dataset 'arithmetc'"),
    ],
)
def test_eval_options_are_validated(tmp_path, write_spec, capsys, change, message):
    spec = write_spec(tmp_path, eval=change)
    assert main(["eval", str(spec)]) == 2
    err = capsys.readouterr().err
    assert all(part in err for part in message.split("|")), err


def test_no_held_out_prompts_is_a_usage_error(tmp_path, write_spec, capsys):
    spec = write_spec(tmp_path)  # eval_size: 0, no sets
    assert main(["eval", str(spec)]) == 2
    assert "the spec has no held-out prompts" in capsys.readouterr().err


def test_sampled_eval_does_not_change_training(tmp_path, write_spec, kit):
    """Evaluation draws from its own seeded generator: a run evaluating every step trains
    exactly as one that never evaluates."""
    sections = {**EVAL, "train": {"steps": 3}}
    with_eval = write_spec(tmp_path / "a", **{**sections, "eval": {**EVAL["eval"], "every": 1, "at_start": True}})
    without = write_spec(tmp_path / "b", **{**sections, "eval": {"at_start": False, "at_end": False}})
    assert main([str(with_eval)]) == 0 and main([str(without)]) == 0
    volatile = ("time/", "perf/", "eval/")
    rows = [[{k: v for k, v in r.items() if not k.startswith(volatile)} for r in _rows(d / "out" / "metrics.jsonl")]
            for d in (tmp_path / "a", tmp_path / "b")]
    rows[0] = [r for r in rows[0] if set(r) - {"step"}]  # the eval-only rows (at start)
    assert rows[0] == rows[1]
    assert any("eval/hard/pass@4" in r for r in _rows(tmp_path / "a" / "out" / "metrics.jsonl"))
    a, b = (kit.load_weights(d / "out" / "final") for d in (tmp_path / "a", tmp_path / "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_of_a_lora_adapter(tmp_path, write_spec, capsys):
    spec = write_spec(tmp_path, **{**EVAL, "train": {"steps": 1},
                                   "model": {"lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}}})
    assert main([str(spec)]) == 0
    capsys.readouterr()
    (last,) = [r for r in _rows(tmp_path / "out" / "metrics.jsonl") if "eval/reward" in r]
    assert (tmp_path / "out" / "final" / "adapter_config.json").is_file()
    assert main(["eval", str(spec), "--model", str(tmp_path / "out" / "final"), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    logged = {k: v for k, v in last.items() if k.startswith("eval/")}
    assert {k: pytest.approx(v, abs=1e-6) for k, v in evaluated.items()} == logged


def test_an_eval_set_with_an_unknown_dataset_is_reported_with_every_other_problem(tmp_path, write_spec, capsys):
    spec = write_spec(tmp_path, train={"lr_rate": 1}, eval={"sets": {"hard": {"data": {"name": "arithmetc"}}}})
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "(2 problems)" in err and "spec.train.lr_rate" in err
    assert "spec.eval.sets.hard.data.name (line" in err
    assert "unknown dataset 'arithmetc'; did you mean 'arithmetic'?" in err
