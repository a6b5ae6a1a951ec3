"""specs/code.yaml, the shipped code task: its tasks' tests are right (each reference solution
scores 1 under the spec's own ``code_tests`` options, a wrong one less), and the spec trains a
few steps on a tiny model on the CPU, scored in the sandbox and evaluated on the held-out file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from grpo_plugins.rewards.code import CodeTests, CodeTestsOptions

from grpo_core.cli import main
from grpo_core.testing import save_tiny_model

SPECS = Path(__file__).resolve().parents[3] / "specs"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (SPECS / "code" / name).read_text().splitlines()]


def spec_reward() -> CodeTests:
    spec = yaml.safe_load((SPECS / "code.yaml").read_text())
    (options,) = [r for r in spec["rewards"] if r["name"] == "code_tests"]
    return CodeTests(CodeTestsOptions(**{k: v for k, v in options.items() if k != "name"}))


def test_each_shipped_solution_passes_its_tests_and_a_wrong_one_does_not():
    reward = spec_reward()
    tasks = rows("train.jsonl") + rows("eval.jsonl")
    assert len(tasks) >= 8 and len({t["name"] for t in tasks}) == len(tasks)
    right = [f"```python\n{t['solution']}\n```" for t in tasks]
    wrong = [f"```python\ndef {t['name']}(*args):\n    return None\n```" for t in tasks]
    tests = [t["tests"] for t in tasks]
    assert reward(["p"] * len(tasks), right, tests=tests) == [1.0] * len(tasks)
    assert all(score < 1.0 for score in reward(["p"] * len(tasks), wrong, tests=tests))


@pytest.mark.slow
def test_the_code_spec_trains_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = save_tiny_model(tmp_path / "model")
    out = tmp_path / "run"
    code = main([str(SPECS / "code.yaml"), "--set", f"model.path={model}", "--set", f"train.output_dir={out}"])
    assert code == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rewards/code_tests/mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(0.0 <= m["rewards/code_tests/mean"] <= 1.0 for m in steps)
    assert any("eval/rewards/code_tests" in m for m in metrics)
    assert (out / "final" / "config.json").is_file() and (out / "checkpoints" / "best.json").is_file()
