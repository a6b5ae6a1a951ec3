"""Iterative GRPO: the spec section, the trainable reward model and its replay buffer,
specs/iterative.yaml on tiny models (metrics read back from MLflow, reference resets,
exact resume), and a reward model whose held-out accuracy rises over iterations."""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import pytest
import torch
from grpo_plugins.rewards.trainable import (
    TrainableRewardModel,
    TrainableRewardModelOptions,
    class_weights,
    replay_count,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.cli import main
from grpo_core.contracts import RewardExample, TrainableReward
from grpo_core.errors import RunError, SpecError
from grpo_core.plugin_manager import load_plugins
from grpo_core.spec import load_spec
from grpo_core.testing import save_tiny_model

torch.set_num_threads(1)
SPECS = Path(__file__).resolve().parents[2] / "specs"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny-iterative")
    return save_tiny_model(root / "policy"), save_tiny_model(
        root / "rm", kind="sequence-classification", seed=1
    )


def spec_dict(rm: Path, **changes) -> dict:
    spec = {
        "model": {"path": "policy"},
        "rewards": [{"name": "trainable_reward_model", "path": str(rm)}],
        "iterative": {
            "iterations": 3,
            "steps_per_iteration": 2,
            "reward_model": "trainable_reward_model",
        },
    }
    for key, value in changes.items():
        section, _, field = key.partition(".")
        if field:
            spec.setdefault(section, {})[field] = value
        else:
            spec[section] = value
    return spec


# --------------------------------------------------------------------------- spec
def test_train_steps_default_to_iterations_times_steps(models):
    loaded = load_spec(spec_dict(models[1]), external_plugins=False)
    assert loaded.spec.train.steps == 6
    assert loaded.spec.iterative.verifier.name == "accuracy"
    assert (
        load_spec(
            spec_dict(models[1], **{"train.steps": 6}), external_plugins=False
        ).spec.train.steps
        == 6
    )


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"train.steps": 5},
            r"train.steps \(5\) must equal iterative.iterations x iterative.steps_per_iteration "
            r"\(3 x 2 = 6\)",
        ),
        (
            {"iterative.reward_model": "rm"},
            r"iterative.reward_model 'rm' must name one entry of rewards "
            r"\(trainable_reward_model\); it is not one of them",
        ),
        (
            {"model.lora": {"r": 4}, "algorithm": {"kl": {"beta": 0.1}}},
            r"under model.lora the reference is the base model .* drop model.lora, or set algorithm.kl.beta: 0",
        ),
        (
            {"iterative.verifier": {"name": "acuracy"}},
            r"spec.iterative.verifier.name: unknown reward function "
            r"'acuracy'; did you mean 'accuracy'",
        ),
    ],
)
def test_iterative_spec_errors_say_what_is_valid(models, changes, message):
    data = spec_dict(models[1])
    for key, value in changes.items():
        section, _, field = key.partition(".")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    with pytest.raises(SpecError, match=message):
        load_spec(data, external_plugins=False)


def test_lora_without_a_reference_is_allowed(models):
    data = spec_dict(models[1], **{"model.lora": {"r": 4}})
    assert load_spec(data, external_plugins=False).spec.model.lora.r == 4


def test_an_untrainable_reward_model_is_refused_before_training(models, tmp_path):
    data = spec_dict(
        models[1],
        **{
            "rewards": [{"name": "accuracy"}],
            "iterative.reward_model": "accuracy",
            "model.path": str(models[0]),
            "train.output_dir": str(tmp_path),
            "tracking": [],
        },
    )
    from grpo_core.train.loop.assemble import build_run

    with pytest.raises(
        RunError, match="iterative.reward_model: reward function 'accuracy' cannot be trained"
    ):
        build_run(load_spec(data, external_plugins=False))


# --------------------------------------------------------------------------- replay
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 500), st.floats(0.0, 0.9), st.integers(0, 1000))
def test_replay_count_makes_history_the_given_fraction(fresh, fraction, available):
    h = replay_count(fresh, fraction, available)
    assert 0 <= h <= available
    ideal = fresh * fraction / (1 - fraction)
    if available >= ideal + 1:
        assert abs(h - ideal) <= 0.5
        # the mix is the fraction, to within one sample
        assert abs(h / (fresh + h) - fraction) <= 1 / (fresh + h)


def examples(n: int, offset: int = 0) -> list[RewardExample]:
    return [
        RewardExample(f"What is {i}?", f" {i}" if i % 2 else f" x{i}", float(i % 2))
        for i in range(offset, offset + n)
    ]


def saved_and_loaded(state: dict) -> dict:
    """``state`` through torch.save and torch.load, as a checkpoint carries it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_trainable_reward_model_fits_with_replay_and_resumes_exactly(models):
    options = TrainableRewardModelOptions(
        path=models[1], lr=1e-3, batch_size=8, history_size=50, seed=3
    )
    rm = TrainableRewardModel(options)
    assert isinstance(rm, TrainableReward)
    first = rm.fit(examples(36))
    assert first["buffer/historical"] == 0 and first["buffer/size"] == 36 and first["history"] == 36
    second = rm.fit(examples(36, 36))
    assert second["buffer/historical"] == 4 and second["buffer/size"] == 40  # round(36 * 0.1 / 0.9)
    assert second["buffer/historical_frac"] == pytest.approx(0.1)
    assert second["history"] == 50  # a reservoir of at most history_size
    scores = rm(["What is 1?", "What is 2?"], [" 1", " x2"])
    assert all(0 < s < 1 for s in scores)

    copy = TrainableRewardModel(options)
    copy.load_state_dict(saved_and_loaded(rm.state_dict()))
    assert copy(["What is 1?", "What is 2?"], [" 1", " x2"]) == scores
    # the optimizer, the history and the replay draws carry on identically
    assert copy.fit(examples(20, 72)) == rm.fit(examples(20, 72))
    assert copy(["What is 3?"], [" 3"]) == rm(["What is 3?"], [" 3"])
    assert copy.evaluate(examples(10))["accuracy"] == rm.evaluate(examples(10))["accuracy"]


@given(labels=st.lists(st.sampled_from([0.0, 1.0, 0.3, 0.8]), min_size=1, max_size=40))
def test_class_weights_give_each_class_half_of_the_total(labels):
    w = class_weights(labels)
    assert len(w) == len(labels) and sum(w) == pytest.approx(len(labels))  # mean 1
    pos = sum(x for x, y in zip(w, labels) if y > 0.5)
    if 0 < sum(y > 0.5 for y in labels) < len(labels):
        assert pos == pytest.approx(len(labels) / 2)
    else:
        assert w == [1.0] * len(labels)


def test_class_weights_by_hand():
    assert class_weights([1.0, 0.0, 0.0, 0.0]) == [2.0, 2 / 3, 2 / 3, 2 / 3]


def test_balanced_classes_weight_the_loss_and_balanced_accuracy_is_per_class(models):
    """One right sample in eight: the loss ``fit`` reports is the class-weighted BCE of the
    model's logits (one batch, a learning rate too small to move them), and balanced
    accuracy is the mean of the per-class accuracies."""
    import torch.nn.functional as F

    data = [RewardExample(f"What is {i}?", f" {i}" if i % 8 == 0 else f" x{i}", float(i % 8 == 0))
            for i in range(16)]
    labels = torch.tensor([e.label for e in data])
    for balance in (False, True):
        rm = TrainableRewardModel(TrainableRewardModelOptions(
            path=models[1], lr=1e-12, batch_size=64, seed=1, balance_classes=balance))
        rm._ready()
        with torch.no_grad():
            logits = rm._logits(data)
        weight = torch.tensor(class_weights(labels.tolist())) if balance else None
        expected = F.binary_cross_entropy_with_logits(logits, labels, weight=weight)
        assert rm.fit(data)["train_loss"] == pytest.approx(float(expected), rel=1e-4)
        if balance:
            plain = F.binary_cross_entropy_with_logits(logits, labels)
            assert float(expected) != pytest.approx(float(plain), rel=1e-3)  # the weights matter here
    got = rm.evaluate(data)
    with torch.no_grad():
        predicted = rm._logits(data) > 0
    right = labels > 0.5
    per_class = [float((predicted[right == c] == c).float().mean()) for c in (True, False)]
    assert got["balanced_accuracy"] == pytest.approx(sum(per_class) / 2)
    assert got["accuracy"] == pytest.approx(float((predicted == right).float().mean()))


def test_labels_outside_zero_one_are_refused(models):
    rm = TrainableRewardModel(TrainableRewardModelOptions(path=models[1]))
    with pytest.raises(RunError, match="labels in \\[0, 1\\] .* the verifier gave 2.0"):
        rm.fit([RewardExample("p", "c", 2.0)])


def test_trainable_reward_model_is_registered():
    component = load_plugins(external=False).registry.get(
        "reward_function", "trainable_reward_model"
    )
    assert component.options is TrainableRewardModelOptions


# --------------------------------------------------------------------------- end to end
def history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def run_iterative_spec(models, out: Path, *extra: str) -> int:
    policy, rm = models
    return main(
        [
            str(SPECS / "iterative.yaml"),
            "--set",
            "model.package=null",
            "--set",
            "model.gguf_file=null",
            "--set",
            f"model.path={policy}",
            "--set",
            "rewards.0.package=null",
            "--set",
            "rewards.0.gguf_file=null",
            "--set",
            f"rewards.0.path={rm}",
            "--set",
            "rewards.0.lr=1e-3",
            "--set",
            "iterative.iterations=2",
            "--set",
            "iterative.steps_per_iteration=2",
            "--set",
            "iterative.prompts=9",
            "--set",
            "iterative.heldout_prompts=2",
            "--set",
            "rollout.group_size=4",
            "--set",
            "rollout.max_new_tokens=4",
            "--set",
            "eval.max_prompts=2",
            "--set",
            "eval.every=0",
            "--set",
            "train.lr=0.02",
            "--set",
            "train.threads=1",
            "--set",
            "train.progress=false",
            "--set",
            "checkpoint.every=1",
            "--set",
            "checkpoint.keep=4",
            "--set",
            f"train.output_dir={out}",
            *extra,
        ]
    )


def test_iterative_spec_logs_each_iteration_resets_the_reference_and_resumes(
    models, tmp_path, monkeypatch
):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert run_iterative_spec(models, tmp_path / "a") == 0

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("iterative").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["iterative.iterations"] == "2" and run.data.params["train.steps"] == "4"
    rid = run.info.run_id
    # the reward model's update is logged with the first step of each iteration
    for key in [
        "rm/train_loss",
        "rm/heldout_accuracy",
        "rm/heldout_accuracy_before",
        "rm/buffer/size",
        "rm/buffer/historical_frac",
        "iterative/iteration",
        "iterative/reference_resets",
    ]:
        assert sorted(history(client, rid, key)) == [1, 3], key
    assert sorted(history(client, rid, "reward")) == [1, 2, 3, 4]  # policy metrics as usual
    assert history(client, rid, "iterative/reference_resets") == {1: 1.0, 3: 2.0}
    assert history(client, rid, "rm/buffer/size") == {
        1: 36.0,
        3: 40.0,
    }  # 9 prompts x 4 (+ 4 replayed)
    frac = history(client, rid, "rm/buffer/historical_frac")
    assert frac[1] == 0.0 and frac[3] == pytest.approx(0.1)
    assert history(client, rid, "rm/heldout_size") == {1: 8.0, 3: 8.0}
    # the reference is the policy again at each iteration start: KL is exactly 0 on the
    # first step of an iteration, and not after an update
    kl = history(client, rid, "kl")
    assert kl[1] == 0.0 and kl[3] == 0.0, kl
    assert kl[2] > 1e-6 and kl[4] > 1e-6, kl

    # resuming at an iteration boundary retrains the reward model from its checkpointed
    # weights, optimizer and replay buffer, and ends where the uninterrupted run did
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'other.db'}")
    resume = str(tmp_path / "a" / "checkpoints" / "step-000002")
    assert (
        run_iterative_spec(models, tmp_path / "b", "--set", "tracking=[]", "--resume", resume) == 0
    )
    a = torch.load(tmp_path / "a" / "checkpoints" / "step-000004" / "state.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoints" / "step-000004" / "state.pt", weights_only=False)
    rm_a, rm_b = (
        a["components"]["rewards.trainable_reward_model"],
        b["components"]["rewards.trainable_reward_model"],
    )
    assert rm_a["history"] == rm_b["history"] and len(rm_a["history"]) == 72
    for name, tensor in rm_a["model"].items():
        assert torch.equal(tensor, rm_b["model"][name]), name
    assert (
        a["components"]["iterative"]["iteration"] == b["components"]["iterative"]["iteration"] == 2
    )
    for name, tensor in a["components"]["iterative"]["reference"].items():
        assert torch.equal(tensor, b["components"]["iterative"]["reference"][name]), name
    from safetensors.torch import load_file

    final_a, final_b = (
        load_file(str(tmp_path / "a" / "final" / "model.safetensors")),
        load_file(str(tmp_path / "b" / "final" / "model.safetensors")),
    )
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)

    # ... and so does resuming mid-iteration (after the first step of iteration 2: the
    # reference is that iteration's, not the policy at the resumed step)
    resume = str(tmp_path / "a" / "checkpoints" / "step-000003")
    assert run_iterative_spec(models, tmp_path / "c", "--set", "tracking=[]", "--resume", resume) == 0
    final_c = load_file(str(tmp_path / "c" / "final" / "model.safetensors"))
    assert all(torch.equal(final_a[k], final_c[k]) for k in final_a)
    c = torch.load(tmp_path / "c" / "checkpoints" / "step-000004" / "state.pt", weights_only=False)
    assert c["components"]["iterative"]["resets"] == a["components"]["iterative"]["resets"] == 2


LEARNABLE = '''
from grpo_core import hookimpl

def ends_alnum(prompts, completions, **kwargs):
    """1 when the completion's last visible character is a letter or digit."""
    return [1.0 if c.strip()[-1:].isalnum() else 0.0 for c in completions]

@hookimpl
def register_reward_functions(register):
    register.add("ends_alnum", ends_alnum)
'''


def test_reward_model_heldout_accuracy_rises_over_iterations(models, tmp_path):
    """A label the reward model can learn (the last character of the completion): each
    update makes it more accurate on fresh samples of the policy it has not seen."""
    policy, rm = models
    (tmp_path / "verifier.py").write_text(LEARNABLE)
    spec = tmp_path / "learn.yaml"
    spec.write_text(
        textwrap.dedent(f"""
        plugins: [verifier.py]
        model: {{path: {policy}}}
        data: {{name: arithmetic, chat: false, train_size: 400, eval_size: 0}}
        rollout: {{group_size: 4, max_new_tokens: 3, sampler: multinomial}}  # the draw this curve was checked with
        rewards:
          - {{name: trainable_reward_model, path: {rm}, lr: 3.0e-4, epochs: 2, batch_size: 16}}
        iterative:
          iterations: 6
          steps_per_iteration: 1
          reward_model: trainable_reward_model
          verifier: {{name: ends_alnum}}
          prompts: 16
          heldout_prompts: 24
        algorithm: {{kl: {{beta: 0.0}}}}
        train: {{prompts_per_step: 2, lr: 1.0e-3, progress: false, threads: 1, seed: 0,
                 output_dir: out, log_completions_every: 0}}
        eval: {{at_start: false, at_end: false}}
        tracking: []
    """)
    )
    assert main([str(spec)]) == 0
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    rm_rows = [r for r in rows if "rm/heldout_accuracy" in r]
    assert len(rm_rows) == 6
    accuracy = [r["rm/heldout_accuracy"] for r in rm_rows]
    losses = [r["rm/train_loss"] for r in rm_rows]
    assert rm_rows[0]["rm/heldout_accuracy_before"] < accuracy[0], accuracy  # the untrained model
    assert accuracy[-1] >= accuracy[0] + 0.15, accuracy
    assert sum(accuracy[3:]) / 3 >= sum(accuracy[:3]) / 3 + 0.05, accuracy
    assert losses[-1] < losses[0] - 0.1, losses
    base_rate = rm_rows[-1]["rm/heldout_positive_rate"]
    assert accuracy[-1] > max(base_rate, 1 - base_rate) + 0.1  # better than a constant guess
    assert all(r["rm/buffer/historical_frac"] == pytest.approx(0.1, abs=0.02) for r in rm_rows[1:])


def test_iterative_grpo_runs_asynchronously_and_generates_nothing_an_iteration_start_drops(models, tmp_path):
    """max_staleness 1: an iteration start is a rest the loop foresees (before steps 1 and 3,
    the first before the actor has started), so the actor generates no batch there that the
    rest would drop, and staleness restarts at each."""
    from .conftest import read_metrics

    out = tmp_path / "a"
    assert run_iterative_spec(models, out, "--set", "tracking=[]", "--set", "rollout.max_staleness=1",
                              "--set", "checkpoint.every=0") == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["async/staleness"] for r in rows] == [0, 1, 0, 1]
    assert [r["async/dropped_batches"] for r in rows] == [0, 0, 0, 0]
    assert [r["step"] for r in rows if "iterative/iteration" in r] == [1, 3]
