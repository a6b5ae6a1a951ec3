"""Each policy loss, KL estimator and advantage estimator beyond GRPO's trains on the tiny spec's task
for one step of two updates (mu = 2: in the second, ratios leave 1 and every clip, gate, mask and
selection is live): the run finishes, every update is finite and taken, the component's own metrics
are logged, and the weights move."""

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
    ("dppo", "k3+", "policy/clip/region"),
    ("opsm", "low_var_kl", "policy/opsm/masked"),
    ("m2po", "k1+", "policy/m2po/masked"),
    ("topr", "low_var_kl", "policy/topr/negative"),
    ("vespo", "k3+", "policy/vespo/weight"),
]


def train_one_step(tiny_model: Path, out: Path, spec: Path, algorithm: str) -> dict:
    """Run the tiny spec with ``algorithm`` (YAML lines of the algorithm section) for one step of two
    updates; the step's metrics, after checking the run took finite updates and moved the weights."""
    from safetensors.torch import load_file

    spec.write_text(textwrap.dedent("""
        model: {{path: {model}}}
        data: {{name: arithmetic, train_size: 16, eval_size: 0}}
        rollout: {{group_size: 4, max_new_tokens: 6, sampler: multinomial}}  # a seed whose groups' rewards differ
        rewards: [{{name: accuracy}}, {{name: format, pattern: "^\\\\s*\\\\d+", weight: 0.5}}]
        algorithm:
          mu: 2
        {algorithm}
        train: {{steps: 1, prompts_per_step: 2, lr: 1.0e-2, progress: false, seed: 3, output_dir: {out}}}
        eval: {{at_start: false, at_end: false}}
        tracking: []
    """).format(model=tiny_model, out=out, algorithm=textwrap.indent(textwrap.dedent(algorithm).strip(), "  ")))
    assert main([str(spec)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 1
    row = steps[0]
    assert math.isfinite(row["loss"])
    assert row["train/updates"] == 2 and row["train/nonfinite_updates"] == 0
    before = load_file(str(tiny_model / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    return row


@pytest.mark.parametrize("loss, kl, metric", RUNS, ids=[r[0] for r in RUNS])
def test_trains_on_the_tiny_spec(tiny_model, tmp_path, loss, kl, metric):
    row = train_one_step(tiny_model, tmp_path / "out", tmp_path / "spec.yaml", f"""
        kl: {{name: "{kl}", beta: 0.04}}
        policy_loss: {{name: {loss}}}
    """)
    assert math.isfinite(row["kl"]) and metric in row


ESTIMATORS = [  # (advantage estimator with its options, a metric only it makes the run log)
    ("gdpo", "{{name: gdpo}}", "reward"),
    ("gdpo-token", "{{name: gdpo, batch_norm: token, std: population}}", "reward"),
    ("opd", "{{name: opd, teacher: {{path: {teacher}, device: cpu}}}}", "teacher/kl"),
    ("opd-mixed", "{{name: opd, teacher: {{path: {teacher}, device: cpu}}, task_weight: 0.5, discount: 0.9}}",
     "time/teacher"),
]


@pytest.mark.parametrize("estimator, metric", [e[1:] for e in ESTIMATORS], ids=[e[0] for e in ESTIMATORS])
def test_estimators_train_on_the_tiny_spec(tiny_model, tmp_path, estimator, metric):
    """The teacher of opd is a second tiny model (another seed) with the policy's tokenizer."""
    teacher = save_tiny_model(tmp_path / "teacher", seed=11)
    row = train_one_step(tiny_model, tmp_path / "out", tmp_path / "spec.yaml", f"""
        advantage: {estimator.format(teacher=teacher)}
        kl: {{name: low_var_kl, beta: 0.04}}
    """)
    assert metric in row and math.isfinite(row[metric]) and math.isfinite(row["kl"])


def test_grpo_run_plugins_lists_them(capsys):
    assert main(["plugins"]) == 0
    listed: dict[str, set[str]] = {}
    for line in capsys.readouterr().out.splitlines():
        kind, sep, names = line.strip().partition(": ")
        if sep:
            listed.setdefault(kind, set()).update(names.split(", "))
    assert {"cispo", "sapo", "gmpo", "gpg", "reinforce", "clip-cov", "kl-cov", "dppo", "opsm", "m2po", "topr",
            "vespo"} <= listed["policy loss"]
    assert {"k1+", "k3+"} <= listed["KL penalty"]
    assert {"gdpo", "opd"} <= listed["advantage estimator"]
