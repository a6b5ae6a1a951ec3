"""End to end: grpo-run on a tiny real model writes a real MLflow run, changes the
weights, and learns a toy task."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from grpo_core.cli import main
from grpo_core.testing import save_tiny_model

SPECS = Path(__file__).resolve().parents[2] / "specs"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_tiny_spec_writes_mlflow_run_and_changes_weights(tiny_model, tmp_path, mlflow_uri, capsys):
    out = tmp_path / "run"
    code = main([str(SPECS / "tiny.yaml"), "--set", f"model.path={tiny_model}",
                 "--set", f"train.output_dir={out}"])
    assert code == 0
    err = capsys.readouterr().err
    assert "model saved to" in err and "mlflow ui --backend-store-uri" in err

    from mlflow import MlflowClient

    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    for key in ["reward", "reward_std", "rewards/accuracy/mean", "rewards/format/mean",
                "frac_reward_zero_std", "kl", "loss", "grad_norm", "learning_rate",
                "completions/mean_length", "completions/max_length", "completions/clipped_ratio",
                "advantage/std", "policy/ratio", "policy/clip/region", "time/generate", "time/score",
                "time/logprobs", "time/forward_backward", "time/optimizer", "time/sync",
                "perf/tokens_per_second", "eval/reward", "eval/rewards/accuracy"]:
        assert key in metrics, key
    assert math.isfinite(metrics["loss"])
    history = client.get_metric_history(run.info.run_id, "reward")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert run.data.params["algorithm.kl.beta"] == "0.04"
    assert run.data.params["rewards.1.pattern"] == "^\\s*\\d+"  # plugin option defaults filled in
    # The local JSONL copy has every step too.
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines if "reward" in row] == [1, 2, 3]

    before, after = _weights(tiny_model), _weights(out / "final")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2


def test_quickstart_spec_runs_with_a_tiny_model(tiny_model, tmp_path, mlflow_uri):
    """The quickstart's settings (SmolLM2 swapped for the tiny model) run a step."""
    code = main([str(SPECS / "quickstart.yaml"),
                 "--set", "model.package=null", "--set", "model.gguf_file=null",
                 "--set", f"model.path={tiny_model}", "--set", "train.steps=1",
                 "--set", "eval.max_prompts=2", "--set", "rollout.max_new_tokens=4",
                 "--set", "train.progress=false", "--set", f"train.output_dir={tmp_path / 'qs'}"])
    assert code == 0
    assert (tmp_path / "qs" / "final" / "config.json").exists()


LEARN_PLUGIN = '''
from grpo_core import hookimpl

def starts_with_digit(prompts, completions, **kwargs):
    """1 when the completion's first visible character is a digit."""
    return [1.0 if c.strip()[:1].isdigit() else 0.0 for c in completions]

@hookimpl
def register_reward_functions(register):
    register.add("starts_with_digit", starts_with_digit)
'''


def test_reward_rises_on_a_learnable_toy_task(tiny_model, tmp_path, mlflow_uri):
    (tmp_path / "digit.py").write_text(LEARN_PLUGIN)
    spec = tmp_path / "learn.yaml"
    spec.write_text(textwrap.dedent(f"""
        plugins: [digit.py]
        model: {{path: {tiny_model}}}
        data: {{name: arithmetic, chat: false, train_size: 64, eval_size: 0}}
        rollout: {{group_size: 8, max_new_tokens: 2}}
        rewards: [{{name: starts_with_digit}}]
        train: {{steps: 30, prompts_per_step: 4, lr: 2.0e-2, progress: false, seed: 1,
                 output_dir: {tmp_path / 'out'}}}
        eval: {{at_start: false, at_end: false}}
        tracking: []
    """))
    assert main([str(spec)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.25, (first, last)


def test_missing_reward_column_names_it_and_lists_columns(tiny_model, tmp_path, mlflow_uri, capsys):
    code = main([str(SPECS / "tiny.yaml"), "--set", f"model.path={tiny_model}",
                 "--set", "rewards.0.answer_column=solution", "--set", f"train.output_dir={tmp_path}"])
    assert code == 1
    err = capsys.readouterr().err
    assert "column 'solution'" in err and "accuracy" in err
    assert "prompt" in err and "answer" in err  # the columns that exist
    assert "Traceback" not in err
