"""Each policy loss and KL estimator of issue 28 trains on the tiny spec's task for one step of
two updates (mu = 2: in the second, ratios leave 1 and every clip, gate and selection is live): the run
finishes, every update is finite and taken, the loss's own metrics are logged, and the
weights move."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from grpo_core.cli import main
from grpo_core.testing import save_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


RUNS = [  # (policy loss, KL estimator, a metric only that loss logs)
    ("cispo", "k1+", "policy/clip/high"),
    ("sapo", "k3+", "policy/gate"),
    ("gmpo", "low_var_kl", "policy/clip/region"),
    ("gpg", "low_var_kl", "policy/ratio"),
    ("reinforce", "k1+", "policy/ratio"),
    ("clip-cov", "k3+", "policy/cov/selected"),
    ("kl-cov", "low_var_kl", "policy/cov/abs_log_ratio"),
]


@pytest.mark.parametrize("loss, kl, metric", RUNS, ids=[r[0] for r in RUNS])
def test_trains_on_the_tiny_spec(tiny_model, tmp_path, loss, kl, metric):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent(f"""
        model: {{path: {tiny_model}}}
        data: {{name: arithmetic, train_size: 16, eval_size: 0}}
        rollout: {{group_size: 4, max_new_tokens: 6, sampler: multinomial}}  # a seed whose groups' rewards differ
        rewards: [{{name: accuracy}}, {{name: format, pattern: "^\\\\s*\\\\d+", weight: 0.5}}]
        algorithm:
          kl: {{name: "{kl}", beta: 0.04}}
          policy_loss: {{name: {loss}}}
          mu: 2
        train: {{steps: 1, prompts_per_step: 2, lr: 1.0e-2, progress: false, seed: 3, output_dir: {out}}}
        eval: {{at_start: false, at_end: false}}
        tracking: []
    """))
    assert main([str(spec)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 1
    for row in steps:
        assert math.isfinite(row["loss"]) and math.isfinite(row["kl"])
        assert row["train/updates"] == 2 and row["train/nonfinite_updates"] == 0
        assert metric in row
    before = load_file(str(tiny_model / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_grpo_run_plugins_lists_them(capsys):
    assert main(["plugins"]) == 0
    listed: dict[str, set[str]] = {}
    for line in capsys.readouterr().out.splitlines():
        kind, sep, names = line.strip().partition(": ")
        if sep:
            listed.setdefault(kind, set()).update(names.split(", "))
    assert {"cispo", "sapo", "gmpo", "gpg", "reinforce", "clip-cov", "kl-cov"} <= listed["policy loss"]
    assert {"k1+", "k3+"} <= listed["KL penalty"]
