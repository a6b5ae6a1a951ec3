"""An SFT -> GRPO run stopped in either stage and resumed ends bit for bit as the run that was
never stopped: real ``grpo-run`` processes, stopped by SIGTERM (checkpointed at the stop) or
SIGKILL (nothing written at the kill: the resume goes back to the last checkpoint), then
``--resume``. The KL reference (a copy, reset to the SFT result) is restored too: a GRPO
resume reloads it from ``sft/final``."""

from __future__ import annotations

import signal

import pytest
import torch

STAGES = {
    "sft": {"data": {"name": "arithmetic", "train_size": 48, "eval_size": 4, "solutions": True},
            "completion_column": "solution", "steps": 24, "batch_size": 4, "lr": 1.0e-2, "eval_every": 4,
            "max_length": 64},
    "train": {"steps": 6, "seed": 5},
    "data": {"eval_size": 4},
    "eval": {"at_start": True, "at_end": True, "every": 3, "max_prompts": 4},
    "algorithm": {"kl": {"beta": 0.04}},
    "checkpoint": {"every": 1, "keep": 2},
}


def _rows(kit, path) -> dict[int, list[dict]]:
    """The metric rows of each step, in order (a step's final evaluation is a row of its own)."""
    out: dict[int, list[dict]] = {}
    for r in kit.read_metrics(path):
        out.setdefault(r["step"], []).append(
            {k: v for k, v in r.items() if not k.startswith("time/") and "per_second" not in k})
    return out


@pytest.mark.slow
def test_a_run_stopped_in_either_stage_resumes_to_the_same_weights(tmp_path, write_spec, child, kit):
    cases = {  # name: (signal, stage it must land in, how far that stage must be)
        "term-in-sft": (signal.SIGTERM, "sft", 6),
        "kill-in-sft": (signal.SIGKILL, "sft", 10),
        "kill-in-grpo": (signal.SIGKILL, "grpo", 2),
    }
    straight_dir = tmp_path / "straight"
    straight = child([write_spec(straight_dir, **STAGES)], cwd=straight_dir)
    broken = {}
    for name, (signum, stage, at) in cases.items():
        folder = tmp_path / name
        spec = write_spec(folder, **STAGES)
        proc = child([spec], cwd=folder)  # one at a time: each must still be running when its signal comes
        metrics = folder / "out" / ("sft" if stage == "sft" else "") / "metrics.jsonl"
        broken[name] = (folder, spec, proc, metrics)
        proc.wait_for(lambda m=metrics, a=at: kit.last_step(m) >= a, 300, f"{stage} step {at}")
        proc.signal(signum)
        code = proc.wait()
        assert code == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signum), (code, proc.output())
        out = folder / "out"
        if stage == "sft":  # the stop landed in the SFT stage: no GRPO step was taken
            assert kit.last_step(out / "metrics.jsonl") < 1
            assert kit.last_step(out / "sft" / "metrics.jsonl") < STAGES["sft"]["steps"]
        else:
            assert (out / "sft" / "final").is_dir() and kit.last_step(out / "metrics.jsonl") < STAGES["train"]["steps"]
        if signum == signal.SIGTERM:
            assert "stopped at SFT step" in proc.output(), proc.output()
        resumed = child([spec, "--resume"], cwd=folder)
        assert resumed.wait(300) == 0, resumed.output()
        said = "resuming the SFT stage from" if stage == "sft" else "resuming from"
        assert said in resumed.output(), resumed.output()
    assert straight.wait(300) == 0, straight.output()

    want_final = kit.load_weights(straight_dir / "out" / "final")
    want_sft = kit.load_weights(straight_dir / "out" / "sft" / "final")
    want_grpo = _rows(kit, straight_dir / "out" / "metrics.jsonl")
    want_sft_rows = _rows(kit, straight_dir / "out" / "sft" / "metrics.jsonl")
    assert sorted(want_sft_rows) == list(range(0, STAGES["sft"]["steps"] + 1))  # 0: the starting evaluation
    assert "kl" in want_grpo[2][0]  # the reference is in play
    for name, (folder, _, _, _) in broken.items():
        out = folder / "out"
        got_final, got_sft = kit.load_weights(out / "final"), kit.load_weights(out / "sft" / "final")
        assert [k for k in want_sft if not torch.equal(want_sft[k], got_sft[k])] == [], name
        assert [k for k in want_final if not torch.equal(want_final[k], got_final[k])] == [], name
        assert _rows(kit, out / "sft" / "metrics.jsonl") == want_sft_rows, name
        assert _rows(kit, out / "metrics.jsonl") == want_grpo, name
