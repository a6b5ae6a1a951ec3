"""``checkpoint.best_metric`` against the metric names the evaluation logs: known when the spec
is validated (a misspelled name fails before any model loads, listing the valid ones), the
same names a real evaluation logs, and a name that is missing only at run time failing after
the trained steps are written (a checkpoint and the final model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from grpo_core.cli import main
from grpo_core.errors import SpecError
from grpo_core.spec import load_spec

from .conftest import BASE_SPEC, merge, read_metrics

SPEC = merge(BASE_SPEC, {"model": {"path": "no-such-model"}, "data": {"eval_size": 4}})


def spec_with(**changes) -> dict:
    return merge(SPEC, changes)


@pytest.mark.parametrize(("changes", "message"), [
    ({"checkpoint": {"best_metric": "eval/rewards/acuracy"}},
     "'eval/rewards/acuracy' is not a metric the evaluation logs (did you mean 'eval/rewards/accuracy'?); it logs: "
     "eval/completions/mean_length, eval/prompts, eval/reward, eval/rewards/accuracy, eval/rewards/format"),
    ({"eval": {"n": 4, "k": [1, 4]}, "checkpoint": {"best_metric": "eval/pass@3"}}, "eval/pass@1, eval/pass@4"),
    ({"eval": {"sets": {"hard": {"data": {"name": "arithmetic", "eval_size": 2}}}},
      "checkpoint": {"best_metric": "eval/hrad/reward"}}, "(did you mean 'eval/hard/reward'?)"),
    ({"rewards": [{"name": "accuracy"}, {"name": "accuracy", "weight": 0.5}],
      "checkpoint": {"best_metric": "eval/rewards/accuracy"}}, "eval/rewards/accuracy#0, eval/rewards/accuracy#1"),
    ({"eval": {"greedy": False}, "checkpoint": {"best_metric": "eval/reward"}},
     "the evaluation logs nothing (eval.greedy is false and eval.n is 0)"),
])
def test_a_best_metric_the_evaluation_cannot_log_is_refused_when_the_spec_loads(tmp_path, changes, message):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_with(**changes), sort_keys=False))
    with pytest.raises(SpecError) as info:
        load_spec(path, external_plugins=False)
    assert "spec.checkpoint.best_metric (line " in str(info.value) and message in str(info.value), str(info.value)


@pytest.mark.parametrize(("changes", "metric"), [
    ({}, "eval/rewards/format"),
    ({"eval": {"n": 4}}, "eval/rewards/accuracy/mean@4"),
    ({"eval": {"n": 4, "greedy": False}}, "eval/pass@4"),
    ({"eval": {"sets": {"hard": {"data": {"name": "arithmetic", "eval_size": 2}}}}}, "eval/hard/rewards/accuracy"),
    ({"rollout": {"environment": {"name": "tools", "tools": ["calculator"]}}}, "eval/env/tool_calls"),
])
def test_a_metric_the_evaluation_logs_is_accepted(changes, metric):
    loaded = load_spec(spec_with(**changes, checkpoint={"best_metric": metric}), external_plugins=False)
    assert loaded.spec.checkpoint.best_metric == metric


def test_a_misspelled_best_metric_exits_2_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """The reported run: evaluation only at the end and a typo; it used to train every step,
    then exit 1 with no checkpoint and no final model. (The model does not exist: loading it
    would be the first thing to fail.)"""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_with(checkpoint={"best_metric": "eval/rewards/acuracy"},
                                             eval={"at_end": True}), sort_keys=False))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "spec.checkpoint.best_metric" in err and "did you mean 'eval/rewards/accuracy'" in err
    assert "no-such-model" not in err


def test_the_names_known_at_validation_are_those_an_evaluation_logs(tiny_model_dir, tmp_path, monkeypatch):
    """A tiny run evaluated greedily and with n samples, on the default set and a named one,
    with a reward listed twice: every eval/ metric it logs is a name the validation knows, and
    every name the validation knows is logged (the conditional env/ ones aside)."""
    from grpo_core.spec.metrics import eval_metric_names

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = merge({"model": {"path": str(tiny_model_dir)}, **BASE_SPEC}, {
        "data": {"eval_size": 2},
        "rewards": [{"name": "accuracy"}, {"name": "accuracy", "weight": 0.5},
                    {"name": "format", "pattern": "^\\s*\\d+"}],
        "train": {"steps": 1, "output_dir": str(tmp_path / "out")},
        "eval": {"at_end": True, "n": 2, "batch_size": 4, "sets": {"hard": {"data": {"name": "arithmetic",
                                                                                      "eval_size": 2}}}},
        "checkpoint": {"every": 0, "every_minutes": 0, "best_metric": "eval/hard/pass@2"},
    })
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    known = set(eval_metric_names(load_spec(path, external_plugins=False).spec))
    assert main([str(path)]) == 0
    logged = {k for row in read_metrics(tmp_path / "out" / "metrics.jsonl") for k in row if k.startswith("eval/")}
    assert logged == known


PLUGIN = '''
from grpo_core import hookimpl


def unscorable(prompts, completions, **columns):
    return [None] * len(completions)  # a judge that answered no verdict, say


@hookimpl
def register_reward_functions(register):
    register.add("unscorable", unscorable)
'''


def test_a_metric_missing_at_run_time_fails_after_the_trained_steps_are_written(tiny_model_dir, tmp_path,
                                                                               monkeypatch, capsys):
    """eval/rewards/unscorable is a name the spec logs, but its function scored no held-out
    completion, so the evaluation at the end has no value of it: the run fails (exit 1) naming
    the metric and the ones logged, after writing the last step's checkpoint and the final
    model (there was no other checkpoint: every and every_minutes are 0)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "unscorable.py").write_text(PLUGIN)
    out = tmp_path / "out"
    spec = merge({"model": {"path": str(tiny_model_dir)}, **BASE_SPEC}, {
        "plugins": ["unscorable.py"],
        "data": {"eval_size": 2},
        "rewards": [{"name": "accuracy"}, {"name": "unscorable"}],
        "train": {"steps": 2, "output_dir": str(out)},
        "eval": {"at_end": True},
        "checkpoint": {"every": 0, "every_minutes": 0, "best_metric": "eval/rewards/unscorable"},
    })
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert main([str(path)]) == 1
    err = capsys.readouterr().err
    assert "the evaluation logged no metric 'eval/rewards/unscorable'" in err and "eval/rewards/accuracy" in err
    checkpoint = out / "checkpoints" / "step-000002"
    assert (checkpoint / "state.pt").is_file() and f"{checkpoint}" in err
    assert (out / "final" / "model.safetensors").is_file() and f"{out / 'final'}" in err
    assert not Path(out / "checkpoints" / "best.json").exists()


def test_a_metric_missing_at_a_mid_run_evaluation_stops_the_run_with_that_step_checkpointed(tiny_model_dir, tmp_path,
                                                                                            monkeypatch, capsys):
    """The same miss at the evaluation after step 1 of 3: the run stops there (exit 1) with
    step 1 checkpointed, and says so; no final model, since training did not finish."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "unscorable.py").write_text(PLUGIN)
    out = tmp_path / "out"
    spec = merge({"model": {"path": str(tiny_model_dir)}, **BASE_SPEC}, {
        "plugins": ["unscorable.py"],
        "data": {"eval_size": 2},
        "rewards": [{"name": "accuracy"}, {"name": "unscorable"}],
        "train": {"steps": 3, "output_dir": str(out)},
        "eval": {"every": 1, "at_end": True},
        "checkpoint": {"every": 0, "every_minutes": 0, "best_metric": "eval/rewards/unscorable"},
    })
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert main([str(path)]) == 1
    err = capsys.readouterr().err
    checkpoint = out / "checkpoints" / "step-000001"
    assert "no metric 'eval/rewards/unscorable'" in err and f"the checkpoint {checkpoint}." in err
    assert (checkpoint / "state.pt").is_file() and not (out / "final").exists()
