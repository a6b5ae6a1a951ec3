"""The best checkpoints by an evaluation metric (``checkpoint.best_metric``): the ranking
against its definition, a tiny run that keeps the best beside the last ones and saves the
best as the final model, a resume that ranks on from the checkpoint, and the errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from safetensors.torch import load_file

from grpo_core.cli import main
from grpo_core.errors import RunError
from grpo_core.spec.models import CheckpointSection
from grpo_core.train.loop.best import BestCheckpoints

from .conftest import BASE_SPEC, merge, read_metrics

METRIC = "eval/reward"


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.one_of(st.floats(-5, 5), st.just(math.nan), st.sampled_from([0.0, 1.0])),
                       min_size=1, max_size=12),
       keep=st.integers(1, 4), mode=st.sampled_from(["max", "min"]))
def test_the_kept_steps_are_the_k_best_with_ties_to_the_earlier_step(values, keep, mode):
    best = BestCheckpoints("eval/x", mode, keep)
    for step, value in enumerate(values):
        entered = best.offer(step, {"eval/x": value})
        assert entered == (step in best.steps)
    finite = [(v, s) for s, v in enumerate(values) if not math.isnan(v)]
    sign = -1 if mode == "max" else 1
    expected = sorted(finite, key=lambda e: (sign * e[0], e[1]))[:keep]
    assert best.entries == expected
    again = BestCheckpoints("eval/x", mode, keep)
    again.load_state_dict(best.state_dict())
    assert again.entries == expected
    other = BestCheckpoints("eval/y", mode, keep)
    other.load_state_dict(best.state_dict())  # another metric's ranking is not carried over
    assert other.entries == []


def test_an_unknown_metric_names_the_logged_ones():
    with pytest.raises(RunError, match=r"no metric 'eval/acc'.*eval/reward, eval/rewards/accuracy"):
        BestCheckpoints("eval/acc", "max", 1).offer(3, {"eval/reward": 1.0, "eval/rewards/accuracy": 0.5, "x": 1})


@pytest.mark.parametrize(("fields", "message"), [
    ({"final": "best"}, "final: best needs best_metric"),
    ({"best_metric": "reward"}, r"evaluation metric \(eval/...\)"),
    ({"best_metric": "eval/reward", "keep_best": 0}, "greater than or equal to 1"),
])
def test_bad_best_options_say_what_is_valid(fields, message):
    with pytest.raises(ValidationError, match=message):
        CheckpointSection(**fields)


def run(folder: Path, model: Path, *args: str, **changes) -> int:
    spec = merge({"model": {"path": str(model)}, **BASE_SPEC}, {
        "data": {"train_size": 16, "eval_size": 4},
        "rollout": {"group_size": 2, "max_new_tokens": 6, "temperature": 1.0},
        "train": {"steps": 5, "output_dir": str(folder / "out")},
        "eval": {"every": 1, "at_end": True},
        "checkpoint": {"every": 1, "every_minutes": 0, "keep": 1, "best_metric": METRIC, "best_mode": "max",
                       "keep_best": 2, "final": "best"},
        **changes,
    })
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return main([str(path), *args])


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_a_run_keeps_the_best_beside_the_last_and_saves_the_best_as_final(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run(tmp_path / "a", tiny_model_dir) == 0
    out = tmp_path / "a" / "out"
    evals = {row["step"]: row[METRIC] for row in read_metrics(out / "metrics.jsonl") if METRIC in row}
    assert sorted(evals) == [1, 2, 3, 4, 5]
    ranked = sorted(evals.items(), key=lambda e: (-e[1], e[0]))[:2]
    listing = json.loads((out / "checkpoints" / "best.json").read_text())
    assert [(b["step"], b["value"]) for b in listing["best"]] == [(s, pytest.approx(v)) for s, v in ranked]
    kept = sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step-*"))
    # every step that ever ranked was checkpointed; those that fell out were pruned unless last
    assert kept == sorted({s for s, _ in ranked} | {5})
    best_step = ranked[0][0]
    final, best = weights(out / "final"), weights(out / "checkpoints" / f"step-{best_step:06d}" / "model")
    assert final.keys() == best.keys() and all(torch.equal(final[k], best[k]) for k in final)
    if best_step != 5:  # the last step's weights differ: the final model really is the best one
        last = weights(out / "checkpoints" / "step-000005" / "model")
        assert any(not torch.equal(final[k], last[k]) for k in final)

    # each ranked checkpoint's own state names its folder (a run resumed from it can export it)
    for step, _ in ranked:
        folder = out / "checkpoints" / f"step-{step:06d}"
        state = torch.load(folder / "state.pt", weights_only=False)
        assert state["best"]["folders"][str(step)] == str(folder.resolve())

    # resumed from the best-so-far checkpoint at an earlier step, the ranking goes on from its state
    first = min(s for s, _ in ranked)
    resume = str(out / "checkpoints" / f"step-{first:06d}")
    changes = {"train": {"steps": 5, "output_dir": str(tmp_path / "b" / "out")}}
    assert run(tmp_path / "b", tiny_model_dir, "--resume", resume, **changes) == 0
    again = json.loads((tmp_path / "b" / "out" / "checkpoints" / "best.json").read_text())
    assert [b["step"] for b in again["best"]] == [b["step"] for b in listing["best"]]


def test_best_metric_without_evaluation_is_refused(tiny_model_dir, tmp_path, capsys):
    code = run(tmp_path, tiny_model_dir, data={"train_size": 16, "eval_size": 0})
    assert code != 0
    assert "best_metric ranks steps by an evaluation" in capsys.readouterr().err
