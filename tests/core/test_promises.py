"""The README's promises, each run for real: a model's own code never runs unless the spec
turns ``model.trust_remote_code`` on; a LoRA run and a run under a warm-up + cosine
schedule resume mid-run from a checkpoint and end bit for bit where the uninterrupted run
ends (the adapter, the optimizer and the scheduler's position all come back)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


REMOTE_CODE = '''
from pathlib import Path
Path({marker!r}).write_text("ran")
raise RuntimeError("this model's own code ran")
'''


def test_a_models_own_code_runs_only_when_the_spec_turns_it_on(tmp_path, write_spec, tiny_model_dir, capsys):
    model = tmp_path / "custom-model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "custom-llama"  # unknown to transformers: only its own code could load it
    config["auto_map"] = {"AutoConfig": "remote.CustomConfig", "AutoModelForCausalLM": "remote.CustomModel"}
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "REMOTE-CODE-RAN"
    (model / "remote.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    spec = write_spec(tmp_path, model={"path": str(model)})

    assert main([str(spec)]) == 1  # the default: refused, with transformers' reason
    err = capsys.readouterr().err
    assert "model: cannot load" in err and "trust_remote_code" in err, err
    assert not marker.exists()

    # The control: with the switch on, the same files do run their code (so the check above
    # means something).
    assert main([str(spec), "--set", "model.trust_remote_code=true", "--set", "train.output_dir=with-code"]) == 1
    assert marker.exists()


def _split_run(tmp_path, write_spec, kit, **sections) -> tuple[dict, dict, list, list]:
    """6 steps straight (checkpoints at 3 and 6), and the same run resumed in another folder
    from the step-3 checkpoint: (final weights straight, resumed, metrics straight, resumed)."""
    spec = write_spec(tmp_path, train={"steps": 6, "seed": 4, **sections.pop("train", {})},
                      checkpoint={"every": 3, "keep": 5}, **sections)
    assert main([str(spec)]) == 0
    middle = tmp_path / "out" / "checkpoints" / "step-000003"
    assert main([str(spec), "--set", "train.output_dir=resumed", "--resume", str(middle)]) == 0
    weights = [kit.load_weights(tmp_path / d / "final") for d in ("out", "resumed")]
    rows = [kit.read_metrics(tmp_path / d / "metrics.jsonl") for d in ("out", "resumed")]
    return weights[0], weights[1], rows[0], rows[1]


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_lora_resumes_mid_run_exactly(tmp_path, write_spec, kit):
    straight, resumed, rows, resumed_rows = _split_run(
        tmp_path, write_spec, kit, model={"lora": {"r": 4, "alpha": 8.0}},
        algorithm={"kl": {"name": "low_var_kl", "beta": 0.04}},  # the reference: the base, adapter off
    )
    assert straight and all("lora" in k for k in straight)  # the adapter is what is saved
    assert _equal(straight, resumed) == []
    state = ckpt.load_state(tmp_path / "out" / "checkpoints" / "step-000003" / ckpt.STATE)
    assert state["optimizer"]["state"]  # AdamW moments of the adapter came back
    by_step = {r["step"]: r for r in rows}
    assert [r["step"] for r in resumed_rows] == [4, 5, 6]
    for r in resumed_rows:
        assert r["loss"] == by_step[r["step"]]["loss"] and r["kl"] == by_step[r["step"]]["kl"]
    assert any(r["kl"] > 0 for r in resumed_rows)


def test_a_cosine_schedule_resumes_at_its_position(tmp_path, write_spec, kit):
    straight, resumed, rows, resumed_rows = _split_run(
        tmp_path, write_spec, kit, train={"schedule": "cosine", "warmup_steps": 2},
    )
    lrs = [r["learning_rate"] for r in rows]
    assert len(set(lrs)) >= 4  # not constant: warm-up, then decay to 0
    assert [r["learning_rate"] for r in resumed_rows] == lrs[3:]
    assert _equal(straight, resumed) == []
    state = ckpt.load_state(tmp_path / "out" / "checkpoints" / "step-000003" / ckpt.STATE)
    assert state["scheduler"]["last_epoch"] == 3
