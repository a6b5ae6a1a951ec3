"""Faults injected for real, and what must survive them: a reward function that raises, a
non-finite loss or gradient, a process killed with SIGKILL mid-run (mid-checkpoint when we
can catch one), and degenerate input (no rows, empty prompts, over-long prompts, one-token
or immediately stopped completions)."""

from __future__ import annotations

import json
import math
import random
import signal
import time

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """In-process runs write nothing outside tmp_path (MLflow's ./mlruns included)."""
    monkeypatch.chdir(tmp_path)
    for name, value in {"MLFLOW_HTTP_REQUEST_TIMEOUT": "2", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}.items():
        monkeypatch.setenv(name, value)


def _write_rows(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _all_finite(weights: dict) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in weights.values())


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- rewards that raise
PICKY = '''
import os
from grpo_core import hookimpl

def picky(prompts, completions, boom, **kwargs):
    """Scores by length; cannot score a row marked 'boom' (until PICKY_FIXED is set)."""
    out = []
    for completion, bad in zip(completions, boom):
        if bad and not os.environ.get("PICKY_FIXED"):
            raise ValueError("cannot parse this completion")
        out.append(float(len(completion) % 3))
    return out

@hookimpl
def register_reward_functions(register):
    register.add("picky", picky)
'''

POISON = "Poisoned question: what is 17 + 25? Answer with the number and nothing else, please."


def _picky_spec(tmp_path, write_spec, **sections):
    (tmp_path / "picky.py").write_text(PICKY)
    rows = [{"prompt": f"What is {i} + {i}? Answer with a number.", "boom": False} for i in range(10)]
    rows[5] = {"prompt": POISON, "boom": True}  # step 3 takes rows 4 and 5: completions 4..7 fail
    _write_rows(tmp_path / "rows.jsonl", rows)
    base = {
        "plugins": ["picky.py"],
        "data": {
            "name": "file",
            "train": "rows.jsonl",
            "shuffle": False,
            "train_size": None,
            "eval_size": None,
        },
        "rewards": [{"name": "picky"}],
    }
    return write_spec(tmp_path, **{**base, **sections})


@pytest.mark.parametrize("every", [0, 1], ids=["no-periodic-checkpoints", "checkpoint-every-step"])
def test_reward_error_names_the_culprit_and_keeps_the_last_checkpoint(
    tmp_path, write_spec, mlflow_db, kit, capsys, monkeypatch, every
):
    uri = mlflow_db(tmp_path)
    spec = _picky_spec(
        tmp_path,
        write_spec,
        train={"steps": 4},
        checkpoint={"every": every},
        tracking=[{"name": "mlflow", "experiment": "picky", "tracking_uri": uri}],
    )
    out = tmp_path / "out"
    assert main([str(spec)]) == 1
    err = capsys.readouterr().err
    assert "reward function 'picky' raised ValueError: cannot parse this completion on completion 4" in err
    assert "(prompt: 'Poisoned question: what is 17 + 25?" in err
    assert "train.reward_errors: none" in err
    assert "Traceback" not in err
    # Steps 1 and 2 were completed; step 3 failed before its update. A checkpoint of step 2
    # exists and is intact, even without periodic checkpoints, and nothing is half-written.
    assert [r["step"] for r in kit.read_metrics(out / "metrics.jsonl")] == [1, 2]
    folders = ckpt.list_checkpoints(out / "checkpoints")
    assert folders and folders[-1].name == "step-000002", folders
    assert ckpt.verify(folders[-1]) is None
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")] == []
    state = torch.load(folders[-1] / ckpt.STATE, weights_only=False)
    assert state["step"] == 2 and state["data"]["position"] == 4  # step 3's prompts not consumed

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("picky").experiment_id])
    assert run.info.status == "FAILED" and state["run_id"] == run.info.run_id

    monkeypatch.setenv("PICKY_FIXED", "1")  # the user fixes the reward function and resumes
    assert main([str(spec), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"resuming from {folders[-1]} (step 2)" in err
    assert [r["step"] for r in kit.read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    (run,) = client.search_runs([client.get_experiment_by_name("picky").experiment_id])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward")) == [1, 2, 3, 4]
    # ... and ends exactly where a run that never failed ends.
    assert main([str(spec), "--set", "train.output_dir=ref", "--set", "tracking=[]"]) == 0
    assert _equal(kit.load_weights(tmp_path / "ref" / "final"), kit.load_weights(out / "final"))
    volatile = ("time/", "perf/tokens_per_second")
    rows = [
        [
            {k: v for k, v in r.items() if not k.startswith(volatile)}
            for r in kit.read_metrics(d / "metrics.jsonl")
        ]
        for d in (tmp_path / "ref", out)
    ]
    assert rows[0] == rows[1]


def test_reward_errors_none_scores_failures_none_and_counts_them(tmp_path, write_spec, kit):
    spec = _picky_spec(tmp_path, write_spec, train={"steps": 4, "reward_errors": "none"})
    assert main([str(spec)]) == 0
    rows = {r["step"]: r for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl")}
    assert sorted(rows) == [1, 2, 3, 4]
    assert [rows[s]["reward/failed"] for s in (1, 2, 3, 4)] == [0, 0, 4, 0]
    assert rows[3]["reward/unscorable_frac"] == 0.5  # the poisoned prompt's group of 4 out of 8
    assert rows[1]["reward/unscorable_frac"] == 0
    assert all(math.isfinite(rows[s]["loss"]) for s in rows)
    assert _all_finite(kit.load_weights(tmp_path / "out" / "final"))


# --------------------------------------------------------------------------- non-finite updates
NAN_LOSS = '''
import torch
from pydantic import Field
from grpo_core import hookimpl
from grpo_core.contracts import PolicyLossOutput
from grpo_core.options import Options
from grpo_plugins.losses.clip import ppo_clip_loss

class NanOptions(Options):
    nan_loss: list[int] = Field(default_factory=list, description="Steps whose loss is NaN.")
    nan_grad: list[int] = Field(default_factory=list, description="Steps with a finite loss and a NaN gradient.")
    nan_from: int = Field(10**9, description="Every step from this one has a NaN loss.")

class NanClip:
    """The clip loss, poisoned on chosen steps (one call per step: one micro-batch, no row skipping)."""

    def __init__(self, options):
        self.options = options
        self.calls = 0

    def __call__(self, inputs):
        self.calls += 1
        out = ppo_clip_loss(inputs.logp, inputs.old_logp, inputs.advantages, inputs.mask,
                            eps_low=0.2, eps_high=0.2, dual_clip=None, log_ratio_clamp=20.0)
        loss = out.loss
        if self.calls in self.options.nan_loss or self.calls >= self.options.nan_from:
            loss = loss * float("nan")
        elif self.calls in self.options.nan_grad:
            loss = loss + (inputs.logp * 0).sqrt()  # adds 0; d sqrt(x)/dx at 0 is inf, times 0: NaN
        return PolicyLossOutput(loss, out.metrics)

@hookimpl
def register_policy_losses(register):
    register.add("nan_clip", NanClip, options=NanOptions)
'''


def _nan_spec(tmp_path, write_spec, policy_loss: dict, **sections):
    (tmp_path / "nan_clip.py").write_text(NAN_LOSS)
    return write_spec(
        tmp_path,
        plugins=["nan_clip.py"],
        algorithm={"policy_loss": {"name": "nan_clip", **policy_loss}},
        **sections,
    )


def test_nonfinite_updates_are_skipped_and_counted(tmp_path, write_spec, kit):
    spec = _nan_spec(
        tmp_path,
        write_spec,
        {"nan_loss": [2], "nan_grad": [3]},
        train={"steps": 4, "max_nonfinite_updates": 3},
        checkpoint={"every": 1, "keep": 4},
    )
    assert main([str(spec)]) == 0
    out = tmp_path / "out"
    rows = {r["step"]: r for r in kit.read_metrics(out / "metrics.jsonl")}
    assert sorted(rows) == [1, 2, 3, 4]
    assert [rows[s]["train/nonfinite_updates"] for s in (1, 2, 3, 4)] == [0, 1, 1, 0]
    assert [rows[s]["train/nonfinite_streak"] for s in (1, 2, 3, 4)] == [0, 1, 2, 0]
    assert [rows[s]["train/updates"] for s in (1, 2, 3, 4)] == [1, 0, 0, 1]
    assert "grad_norm" not in rows[2] and "grad_norm" not in rows[3]
    assert math.isfinite(rows[3]["loss"])  # the NaN was in the gradient only
    # Skipped updates left weights and optimizer state exactly as they were.
    model = {s: kit.load_weights(out / "checkpoints" / f"step-{s:06d}" / "model") for s in (1, 2, 3, 4)}
    assert all(_all_finite(w) for w in model.values())
    assert _equal(model[1], model[2]) and _equal(model[2], model[3])
    assert not _equal(model[3], model[4])
    assert _equal(model[4], kit.load_weights(out / "final"))
    opt = [
        torch.load(out / "checkpoints" / f"step-{s:06d}" / ckpt.STATE, weights_only=False)["optimizer"]
        for s in (1, 3)
    ]
    for p, state in opt[0]["state"].items():
        assert all(torch.equal(v, opt[1]["state"][p][k]) for k, v in state.items())


def test_too_many_nonfinite_updates_stop_with_the_last_good_weights(tmp_path, write_spec, kit, capsys):
    spec = _nan_spec(
        tmp_path,
        write_spec,
        {"nan_from": 3},
        train={"steps": 8, "max_nonfinite_updates": 2},
        checkpoint={"every": 1, "keep": 10},
    )
    assert main([str(spec)]) == 1
    err = capsys.readouterr().err
    out = tmp_path / "out"
    stop = out / "checkpoints" / "step-000004"
    assert (
        f"2 steps in a row had a non-finite loss or gradient (train.max_nonfinite_updates = 2); "
        f"stopped with the last good weights in {stop}"
    ) in err
    assert "Traceback" not in err
    assert [r["step"] for r in kit.read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    folders = ckpt.list_checkpoints(out / "checkpoints")
    assert [f.name for f in folders] == [f"step-{s:06d}" for s in (1, 2, 3, 4)]
    assert all(ckpt.verify(f) is None for f in folders)
    model = {s: kit.load_weights(out / "checkpoints" / f"step-{s:06d}" / "model") for s in (1, 2, 3, 4)}
    assert all(_all_finite(w) for w in model.values())
    assert not _equal(model[1], model[2])
    assert _equal(model[2], model[3]) and _equal(model[2], model[4])  # the last good weights
    assert not (out / "final").exists()
    state = torch.load(stop / ckpt.STATE, weights_only=False)
    assert state["step"] == 4 and state["nonfinite_streak"] == 2


# --------------------------------------------------------------------------- SIGKILL mid-run
@pytest.mark.slow
def test_sigkill_mid_run_leaves_a_usable_checkpoint(tmp_path, write_spec, child, kit):
    """Kill -9 repeatedly (once as soon as a checkpoint write is seen in progress, then at
    random times), resuming each time: every checkpoint left verifies or is skipped with a
    message, and every redone step logs the same metrics as the first time."""
    steps = 16
    spec = write_spec(tmp_path, train={"steps": steps, "seed": 5}, checkpoint={"every": 1, "keep": 3})
    out = tmp_path / "out"
    root = out / "checkpoints"
    rng = random.Random(0)
    caught_mid_write, expect = 0, None
    for attempt in range(4):  # three kills, then a run to the end
        proc = child([spec] if attempt == 0 else [spec, "--resume"], cwd=tmp_path)
        if expect is not None:  # each resume starts from the newest good checkpoint, naming any it skips
            good, broken = expect
            proc.wait_for(lambda p=proc: "resuming from" in p.output(), 150, "the resume message")
            log = proc.output()
            assert f"resuming from {good[-1]} (step" in log, log
            for folder in broken:
                if int(folder.name[5:]) > int(good[-1].name[5:]):
                    assert f"skipping checkpoint {folder}" in log, log
        if attempt == 3:
            assert proc.wait() == 0, proc.output()
            break
        start = max(kit.last_step(out / "metrics.jsonl"), 1)  # at least one checkpoint before the first kill
        # Kills are placed by progress, not by wall time: a warm step of the tiny model takes a
        # few milliseconds, so a timed kill could land anywhere, even after the last step.
        target = start + 1 + rng.randrange(3)
        proc.wait_for(lambda t=target: kit.last_step(out / "metrics.jsonl") >= t, 150, f"step {target}")
        if attempt == 0:  # catch a checkpoint being written: a temporary folder under checkpoints/
            # Bounded by progress as well as time: on a fast machine the run must not reach its
            # end while we poll, or there is nothing left to resume.
            deadline = time.monotonic() + 20
            while proc.proc.poll() is None and time.monotonic() < deadline:
                if kit.last_step(out / "metrics.jsonl") >= target + 3:
                    break
                if any(p.name.startswith(".") for p in root.iterdir()):
                    proc.signal(signal.SIGKILL)
                    caught_mid_write += 1
                    break
        else:
            time.sleep(rng.uniform(0, 0.02))
        proc.signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, proc.output()
        folders = ckpt.list_checkpoints(root)
        good = [f for f in folders if ckpt.verify(f) is None]
        broken = [f for f in folders if f not in good]
        assert good, f"attempt {attempt}: no usable checkpoint left"
        assert int(good[-1].name[5:]) < steps, f"attempt {attempt}: the run reached its end before the kill"
        expect = (good, broken)
    # Every checkpoint verifies at the end, no temporary folder is left behind, and
    # the final weights are finite.
    failing = {f.name: ckpt.verify(f) for f in ckpt.list_checkpoints(root) if ckpt.verify(f) is not None}
    assert not failing, (failing, proc.output())
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    assert _all_finite(kit.load_weights(out / "final"))
    # Steps redone after a kill log exactly what they logged the first time (the first rows
    # were moved aside at the resume: metrics.jsonl has each step once).
    assert [r["step"] for r in kit.read_metrics(out / "metrics.jsonl")] == list(range(1, steps + 1))
    seen: dict[int, dict] = {}
    for row in kit.read_metrics(out / "metrics.superseded.jsonl") + kit.read_metrics(out / "metrics.jsonl"):
        stable = {k: v for k, v in row.items() if not k.startswith(("time/", "perf/tokens_per_second"))}
        assert seen.setdefault(row["step"], stable) == stable, f"step {row['step']} differs when redone"
    assert sorted(seen) == list(range(1, steps + 1))
    print(f"caught a checkpoint write in progress: {caught_mid_write} time(s)")


# --------------------------------------------------------------------------- bad input
EMPTY_DATA = """
from grpo_core import hookimpl

class NoRows:
    def load(self, split):
        return []

@hookimpl
def register_datasets(register):
    register.add("no_rows", NoRows())
"""


def test_empty_dataset_is_a_clear_error(tmp_path, write_spec, capsys):
    (tmp_path / "no_rows.py").write_text(EMPTY_DATA)
    spec = write_spec(
        tmp_path, plugins=["no_rows.py"], data={"name": "no_rows", "train_size": None, "eval_size": None}
    )
    assert main([str(spec)]) == 1
    err = capsys.readouterr().err
    assert "dataset 'no_rows' has no rows to train on" in err and "Traceback" not in err


def test_all_prompts_empty_is_a_clear_error(tmp_path, write_spec, capsys):
    _write_rows(tmp_path / "rows.jsonl", [{"prompt": p} for p in ["", "   ", "\n", ""]])
    spec = write_spec(
        tmp_path,
        data={"name": "file", "train": "rows.jsonl", "train_size": None, "eval_size": None},
        rewards=[{"name": "format", "pattern": "\\d"}],
    )
    assert main([str(spec)]) == 1
    err = capsys.readouterr().err
    assert "no usable prompt in dataset 'file'" in err and "'empty prompt': " in err
    assert "Traceback" not in err


SEEN = '''
import json, os
from grpo_core import hookimpl

def seen(prompts, completions, **kwargs):
    """Records every prompt it scores (one line each) and scores 1 for even lengths."""
    with open(os.environ["SEEN_FILE"], "a") as fh:
        for p in prompts:
            fh.write(json.dumps(p) + "\\n")
    return [float(len(c) % 2) for c in completions]

@hookimpl
def register_reward_functions(register):
    register.add("seen", seen)
'''


def test_over_long_prompts_are_skipped_and_counted(tmp_path, write_spec, kit, monkeypatch):
    (tmp_path / "seen.py").write_text(SEEN)
    monkeypatch.setenv("SEEN_FILE", str(tmp_path / "seen.jsonl"))
    long = "Please add these numbers carefully: " + " + ".join(str(i) for i in range(40)) + "?"
    rows = [{"prompt": long if i % 3 == 1 else f"What is {i} + 1?"} for i in range(9)]
    _write_rows(tmp_path / "rows.jsonl", rows)
    spec = write_spec(
        tmp_path,
        plugins=["seen.py"],
        rewards=[{"name": "seen"}],
        train={"steps": 3},
        data={
            "name": "file",
            "train": "rows.jsonl",
            "shuffle": False,
            "max_prompt_tokens": 24,
            "train_size": None,
            "eval_size": None,
        },
    )
    assert main([str(spec)]) == 0
    metrics = kit.read_metrics(tmp_path / "out" / "metrics.jsonl")
    # Rows 1, 4, 7 are too long: steps take rows (0, 2), (3, 5), (6, 8).
    assert [r["data/skipped_prompts"] for r in metrics] == [1, 2, 3]
    scored = {json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()}
    assert long not in scored and len(scored) == 6


@pytest.fixture(scope="module")
def parrot_model(tmp_path_factory):
    """``parrot_model(token)``: a tiny model that emits ``token`` ("7", or None for EOS)
    whatever the input: attention and MLP outputs are zeroed, so the last hidden state is
    the input embedding, the same for every token, and only the chosen row of the output
    layer sees it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.testing import save_tiny_model

    made = {}

    def make(token: str | None):
        if token not in made:
            folder = save_tiny_model(tmp_path_factory.mktemp("parrot") / "model")
            tok = AutoTokenizer.from_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder)
            target = tok.eos_token_id if token is None else tok.convert_tokens_to_ids(token)
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
                model.model.embed_tokens.weight.zero_()
                model.model.embed_tokens.weight[:, 0] = 1.0
                model.lm_head.weight.zero_()
                model.lm_head.weight[target, 0] = 10.0  # logit ~57 against 0 for every other token
            model.save_pretrained(folder)
            made[token] = folder
        return made[token]

    return make


SAW = """
import json, os
from grpo_core import hookimpl

def saw(prompts, completions, **kwargs):
    with open(os.environ["SAW_FILE"], "a") as fh:
        fh.write(json.dumps(completions) + "\\n")
    return [float(len(c)) for c in completions]

@hookimpl
def register_reward_functions(register):
    register.add("saw", saw)
"""


@pytest.mark.parametrize(
    "token, rollout, beta",
    [
        (None, {"max_new_tokens": 4}, 0.1),  # empty: EOS first, text ""
        ("7", {"max_new_tokens": 4, "stop": ["7"]}, 0.1),  # a stop string that matches at once
        ("7", {"max_new_tokens": 1}, 0.1),  # never stops: every completion truncated
        ("7", {"max_new_tokens": 2, "mask_truncated_completions": True}, 0.0),  # ... and masked out
        ("7", {"max_new_tokens": 2, "mask_truncated_completions": True}, 0.1),  # ... with KL in the loss
    ],
    ids=["empty", "stop-at-once", "never-stop", "never-stop-masked", "never-stop-masked-kl"],
)
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_degenerate_completions_keep_the_loss_finite(
    tmp_path, write_spec, kit, parrot_model, monkeypatch, token, rollout, beta, aggregation
):
    (tmp_path / "saw.py").write_text(SAW)
    monkeypatch.setenv("SAW_FILE", str(tmp_path / "saw.jsonl"))
    spec = write_spec(
        tmp_path,
        model={"path": str(parrot_model(token))},
        plugins=["saw.py"],
        data={"chat": False},
        rollout=rollout,
        rewards=[{"name": "saw"}],
        train={"steps": 2},
        algorithm={"aggregation": {"name": aggregation}, "kl": {"name": "low_var_kl", "beta": beta}},
    )
    assert main([str(spec)]) == 0
    rows = kit.read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    expected = {None: "", "7": "7" * rollout["max_new_tokens"]}[token]
    if rollout.get("stop"):
        expected = "7"
    seen = [json.loads(line) for line in (tmp_path / "saw.jsonl").read_text().splitlines()]
    assert len(seen) == 2 and all(c == expected for batch in seen for c in batch), seen
    truncated = token is not None and not rollout.get("stop")
    for row in rows:
        assert math.isfinite(row["loss"]) and row["train/nonfinite_updates"] == 0
        assert row["completions/max_length"] == row["completions/min_length"] == (len(expected) or 1)
        assert row["completions/clipped_ratio"] == float(truncated)
        assert row["advantage/abs_max"] == 0 and row["frac_reward_zero_std"] == 1
    assert _all_finite(kit.load_weights(tmp_path / "out" / "final"))
