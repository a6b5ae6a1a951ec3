"""Silent wrong numbers (issue 26, items 11 and 13): the adaptive KL controller keeps beta
positive whatever the horizon (Ziegler et al. 2019, with rows / horizon capped at 1), and
``grpo-run runs`` lists every folder when one holds a ``null`` row or a non-numeric
``eval/reward``, showing a folder it cannot read as unreadable."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.cli import main
from grpo_core.cli.runs import describe
from grpo_core.train.learner.kl import adapted_beta


# --------------------------------------------------------------------------- the adaptive KL controller
def reference_beta(beta: float, kl: float, rows: int, target: float, horizon: int) -> float:
    """Ziegler et al. 2019 (sec. 2.2), written as a plain loop over the step's rows: each row
    moves beta by ``e / horizon`` of itself, ``e = clip(kl / target - 1, -0.2, 0.2)``, and a
    step moves it by at most ``e`` (at most one horizon's worth of rows counts)."""
    e = max(-0.2, min(0.2, kl / target - 1.0))
    moved = 0.0
    for _ in range(rows):
        moved = min(moved + 1.0 / horizon, 1.0)
    return beta * (1.0 + e * moved)


@pytest.mark.parametrize(
    ("kl", "rows", "horizon", "expected"),
    [
        (0.0, 8, 1, 0.04 * 0.8),  # the tiny spec with target 1, horizon 1: was 0.04 * (1 - 0.2 * 8) = -0.024
        (5.0, 8, 1, 0.04 * 1.2),
        (0.0, 8, 16, 0.04 * (1 - 0.2 * 0.5)),  # rows below the horizon: Ziegler's formula, unchanged
        (1.1, 64, 1000, 0.04 * (1 + 0.1 * 0.064)),
        (1.0, 8, 1, 0.04),
    ],
)
def test_adapted_beta_hand_computed(kl, rows, horizon, expected):
    assert adapted_beta(0.04, kl, rows, target=1.0, horizon=horizon) == pytest.approx(expected)


@given(
    beta=st.floats(1e-6, 10.0), kl=st.floats(0.0, 1e6), rows=st.integers(1, 100_000),
    target=st.floats(1e-6, 100.0), horizon=st.integers(1, 100_000),
)
def test_adapted_beta_stays_positive_within_20_percent_and_matches_the_loop(beta, kl, rows, target, horizon):
    new = adapted_beta(beta, kl, rows, target=target, horizon=horizon)
    assert 0.8 * beta * (1 - 1e-12) <= new <= 1.2 * beta * (1 + 1e-12)
    assert new == pytest.approx(reference_beta(beta, kl, min(rows, horizon + 1), target, horizon), rel=1e-9)


def test_a_run_with_a_tiny_horizon_keeps_beta_positive(tmp_path, write_spec, kit, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path, algorithm={"kl": {"beta": 0.04, "adaptive": {"target": 1.0, "horizon": 1}}},
                      train={"steps": 3})
    assert main([str(spec)]) == 0
    betas = [r["kl/beta"] for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl")]
    assert len(betas) == 3 and all(b > 0 for b in betas), betas
    assert betas[0] == pytest.approx(0.04 * 0.8)  # step 1: policy = reference, KL 0, error -0.2, capped factor


# --------------------------------------------------------------------------- grpo-run runs
def _run_folder(root, name: str, lines: list[str], steps: int = 4) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "spec.resolved.yaml").write_text(f"train:\n  steps: {steps}\n")
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/mem stands for an unreadable file")
def test_runs_lists_every_folder_despite_bad_rows(tmp_path, capsys):
    root = tmp_path / "runs"
    _run_folder(root, "good", [json.dumps({"step": 1, "reward": 0.5}), json.dumps({"step": 2, "eval/reward": 0.75})])
    _run_folder(root, "nulls", ["null", json.dumps({"step": 1}), "[1, 2]", json.dumps({"step": 2, "eval/reward": 0.25}),
                                json.dumps({"step": 3, "eval/reward": "high"}), json.dumps({"step": True})])
    _run_folder(root, "stringy", [json.dumps({"step": 1, "eval/reward": "0.9"}), json.dumps({"step": "2"})])
    unreadable = root / "unreadable"
    unreadable.mkdir()
    (unreadable / "spec.resolved.yaml").write_text("train:\n  steps: 4\n")
    # A regular file whose reading fails (EIO at offset 0; permissions would not stop root).
    (unreadable / "metrics.jsonl").symlink_to("/proc/self/mem")

    assert main(["runs", str(root)]) == 0
    captured = capsys.readouterr()
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines()[2:] if line.strip()}
    assert set(rows) == {"good", "nulls", "stringy", "unreadable"}
    assert rows["good"][2:4] == ["2/4", "0.7500"]
    assert rows["nulls"][2:4] == ["3/4", "0.2500"]  # the last numeric eval/reward; null, list and bool rows skipped
    assert rows["stringy"][2:4] == ["1/4", "-"]
    assert rows["unreadable"][1] == "unreadable"
    assert f"grpo-run runs: cannot read {unreadable}: OSError" in captured.err


def test_describe_never_raises_on_a_bad_folder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('null\n{"step": 1, "eval/reward": NaN}\n{"step": 1, "eval/reward": 1e999}\n')
    info = describe(folder)
    assert info.last_step == 1 and info.heldout is None and info.status == "incomplete"
