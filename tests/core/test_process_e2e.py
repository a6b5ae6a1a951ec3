"""Process supervision in the engine: per-step scores from reward functions, step ends on
the generated tokens, DeepSeekMath's process advantage end to end, and specs/process.yaml on a
tiny model with its metrics read back from MLflow."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from grpo_plugins.advantages.grpo import GRPOAdvantage, GRPOOptions
from grpo_plugins.advantages.process import ProcessAdvantage, ProcessOptions
from grpo_plugins.step_splitters import SeparatorSplitter

from grpo_core.cli import main
from grpo_core.contracts import RolloutBatch
from grpo_core.errors import RunError
from grpo_core.testing import build_tokenizer, save_tiny_model
from grpo_core.train.actor.scoring import RewardFn, score
from grpo_core.train.experience import Scored
from grpo_core.train.learner.learner import advantage_inputs
from grpo_core.train.reasoning_steps import split_steps

torch.set_num_threads(1)
SPECS = Path(__file__).resolve().parents[2] / "specs"
NEWLINE = SeparatorSplitter(r"\n", name="newline")


def steps_of(texts):
    return split_steps(NEWLINE, "newline", texts)


def per_step(prompts, completions, steps, **kwargs):
    """1 per step holding a '3', else 0."""
    return [[1.0 if "3" in s else 0.0 for s in row] for row in steps]


def outcome(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


# --------------------------------------------------------------------------- scoring
def test_per_step_and_outcome_scores_combine_with_weights_on_the_steps():
    completions = ["1 + 2 = 3\nx", "3", "a\nb\nc"]
    layout = steps_of(completions)
    fns = [RewardFn.of("steps", 2.0, per_step), RewardFn.of("len", 0.5, outcome)]
    got = score(fns, ["p"] * 3, completions, {}, [[1]] * 3, steps=layout.texts)
    nan = math.nan
    expected = torch.tensor(
        [[2.0, 0.0 + 0.5 * 11, nan], [2.0 + 0.5, nan, nan], [0.0, 0.0, 0.5 * 5]]
    )
    torch.testing.assert_close(got.step_scores, expected, equal_nan=True)
    # a process reward's per-completion score is the mean of its steps
    torch.testing.assert_close(got.per_function[:, 0], torch.tensor([0.5, 1.0, 0.0]))
    torch.testing.assert_close(got.total, torch.tensor([2 * 0.5 + 5.5, 2.5, 2.5]))


def test_none_steps_and_none_completions_are_unscored():
    def holes(prompts, completions, steps, **kwargs):
        return [[None, 1.0], None]

    got = score(
        [RewardFn.of("holes", 1.0, holes)],
        ["p"] * 2,
        ["a\nb", "c"],
        {},
        [[1]] * 2,
        steps=[["a", "b"], ["c"]],
    )
    assert torch.isnan(got.step_scores[0, 0]) and got.step_scores[0, 1] == 1.0
    assert torch.isnan(got.step_scores[1]).all() and torch.isnan(got.total[1])


def test_a_step_count_mismatch_names_the_function():
    def short(prompts, completions, steps, **kwargs):
        return [[1.0] for _ in steps]

    with pytest.raises(
        RunError,
        match=r"reward function 'short' returned 1 step scores for completion 0, "
        r"which has 2 steps \(algorithm.step_splitter\)",
    ):
        score([RewardFn.of("short", 1.0, short)], ["p"], ["a\nb"], {}, [[1]], steps=[["a", "b"]])


def test_per_step_scores_without_a_steps_parameter_say_how_to_get_steps():
    def lists(prompts, completions, **kwargs):
        return [[1.0, 0.0] for _ in completions]

    with pytest.raises(
        RunError, match="'lists' returned a list of 2 scores .* name a `steps` parameter"
    ):
        score([RewardFn.of("lists", 1.0, lists)], ["p"], ["a\nb"], {}, [[1]])


def test_a_dataset_column_named_steps_is_refused_when_steps_are_cut():
    fn = RewardFn.of("steps", 1.0, per_step)
    with pytest.raises(RunError, match="dataset has a column 'steps'.*rename the column"):
        score([fn], ["p"], ["3"], {"steps": ["gold"]}, [[1]], steps=[["3"]])

    # without process supervision the column passes through as any other
    def column(prompts, completions, **kwargs):
        return [float(len(kwargs["steps"][0]))]

    got = score([RewardFn.of("col", 1.0, column)], ["p"], ["3"], {"steps": ["gold"]}, [[1]])
    assert got.total.tolist() == [4.0]


def test_evaluation_cuts_steps_itself_with_the_functions_splitter():
    fn = RewardFn.of("steps", 1.0, per_step, splitter=steps_of)
    assert fn.takes_steps and not RewardFn.of("len", 1.0, outcome).takes_steps
    got = score([fn], ["p"], ["3\n4\n"], {}, [[1]])  # no steps given, as evaluate() calls it
    assert got.total.tolist() == [0.5]


# --------------------------------------------------------------------------- formula
def rollout_of(tokenizer, groups: list[list[str]]) -> RolloutBatch:
    texts = [t for group in groups for t in group]
    rows = [
        tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in texts
    ]
    width = max(map(len, rows)) + 1
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), True
    prompts = torch.ones((len(groups), 1), dtype=torch.long)
    return RolloutBatch(
        prompts, prompts.bool(), ids, mask, torch.zeros(len(rows), dtype=torch.bool), texts
    )


def seed_formula(
    step_scores: list[list[float]], step_ends: list[list[int]], groups: list[list[int]], width: int
):
    """DeepSeekMath's process advantage, literally: one mean and population std over all
    steps of a group, then A_t = sum of the normalized scores of steps ending at or after t."""
    out = [[0.0] * width for _ in step_scores]
    for rows in groups:
        flat = [r for i in rows for r in step_scores[i]]
        mu = sum(flat) / len(flat)
        sigma = math.sqrt(sum((r - mu) ** 2 for r in flat) / len(flat))
        for i in rows:
            for t in range(width):
                out[i][t] = sum(
                    (r - mu) / sigma for r, end in zip(step_scores[i], step_ends[i]) if end >= t
                )
    return torch.tensor(out)


def test_the_engine_gives_the_process_estimator_deepseekmaths_formula_on_real_tokens():
    tokenizer = build_tokenizer()
    groups = [["1 + 2 = 3\n3 + 4 = 7\n", "12 + 3 = 15", "3\n\n33\nno"], ["x", "3 3\n3", "4\n3\n"]]
    rollout = rollout_of(tokenizer, groups)
    layout = steps_of(rollout.completions)
    scores = score(
        [RewardFn.of("steps", 1.0, per_step)],
        ["p"] * 6,
        rollout.completions,
        {},
        [[1]] * 6,
        steps=layout.texts,
    )
    estimator = ProcessAdvantage(ProcessOptions(eps=0.0))
    mask = rollout.completion_mask
    inputs = advantage_inputs(Scored([], rollout, scores, layout), scores.total, None, mask,
                              with_steps=estimator.needs_step_scores, tokenizer=tokenizer)
    got = estimator(inputs)

    # the step ends by hand, from the byte-level tokens: the newline token ends a step,
    # the last token (EOS) the last step
    ends = []
    for i in range(6):
        pieces = tokenizer.convert_ids_to_tokens(rollout.completion_ids[i][mask[i]].tolist())
        newlines = [k for k, p in enumerate(pieces) if "Ċ" in p]
        found = [k for k in newlines if k + 1 < len(pieces) - 1 and "Ċ" not in pieces[k + 1]]
        ends.append(found[: len(layout.spans[i]) - 1] + [len(pieces) - 1])
    assert inputs.step_ends[inputs.step_mask].tolist() == [e for row in ends for e in row]
    values = [[v for v in row if not math.isnan(v)] for row in scores.step_scores.tolist()]
    expected = seed_formula(values, ends, [[0, 1, 2], [3, 4, 5]], mask.shape[1]) * mask
    torch.testing.assert_close(got, expected.to(got.dtype), atol=1e-5, rtol=1e-5)
    assert (got[~mask] == 0).all()


def test_outcome_rewards_alone_under_the_process_estimator_are_grpo():
    """An outcome score counts on the last step, so with no process reward the process
    advantage is the outcome advantage on every token."""
    tokenizer = build_tokenizer()
    rollout = rollout_of(tokenizer, [["1\n2", "33", "4\n5\n6"], ["7", "8\n9", "10 11"]])
    layout = steps_of(rollout.completions)
    scores = score(
        [RewardFn.of("len", 1.0, outcome)],
        ["p"] * 6,
        rollout.completions,
        {},
        [[1]] * 6,
        steps=layout.texts,
    )
    estimator = ProcessAdvantage(ProcessOptions())
    inputs = advantage_inputs(Scored([], rollout, scores, layout), scores.total, None, rollout.completion_mask,
                              with_steps=estimator.needs_step_scores, tokenizer=tokenizer)
    torch.testing.assert_close(estimator(inputs), GRPOAdvantage(GRPOOptions())(inputs))


def test_kl_in_the_reward_counts_on_the_last_step():
    tokenizer = build_tokenizer()
    rollout = rollout_of(tokenizer, [["3\n3", "3"]])
    layout = steps_of(rollout.completions)
    scores = score(
        [RewardFn.of("steps", 1.0, per_step)],
        ["p"] * 2,
        rollout.completions,
        {},
        [[1]] * 2,
        steps=layout.texts,
    )
    seq_kl = torch.tensor([0.25, 0.5])
    inputs = advantage_inputs(Scored([], rollout, scores, layout), scores.total - seq_kl, seq_kl,
                              rollout.completion_mask, with_steps=True, tokenizer=tokenizer)
    expected = torch.tensor([[1.0, 0.75], [0.5, math.nan]])  # row 1 has one step
    torch.testing.assert_close(inputs.step_scores, expected, equal_nan=True)
    assert scores.step_scores[0, 1] == 1.0  # the scores themselves are left alone


# --------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-process") / "model")


SIGNAL = '''
from grpo_core import hookimpl

def digit_steps(prompts, completions, steps, **kwargs):
    """1 per step that holds a digit."""
    return [[1.0 if any(ch.isdigit() for ch in s) else 0.0 for s in row] for row in steps]

@hookimpl
def register_reward_functions(register):
    register.add("digit_steps", digit_steps)
'''


def test_process_spec_runs_with_a_tiny_model_and_logs_to_mlflow(tiny_model, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    (tmp_path / "signal.py").write_text(SIGNAL)
    code = main(
        [
            str(SPECS / "process.yaml"),
            "--set",
            "model.package=null",
            "--set",
            "model.gguf_file=null",
            "--set",
            f"model.path={tiny_model}",
            "--set",
            "train.steps=3",
            "--set",
            "eval.max_prompts=2",
            "--set",
            "eval.every=0",
            "--set",
            "rollout.max_new_tokens=10",
            "--set",
            "train.threads=1",
            "--set",
            "train.lr=0.02",
            "--set",
            "train.progress=false",
            # a step reward the random tiny model earns sometimes, so the policy moves
            "--set",
            f"plugins=[{tmp_path / 'signal.py'}]",
            "--set",
            "rewards.2.name=digit_steps",
            "--set",
            f"train.output_dir={tmp_path / 'out'}",
        ]
    )
    assert code == 0

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("process").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["algorithm.advantage.name"] == "process"
    assert run.data.params["algorithm.step_splitter.name"] == "newline"
    metrics = run.data.metrics
    for key in [
        "steps/per_completion",
        "steps/score_mean",
        "rewards/arithmetic-steps/mean",
        "rewards/accuracy/mean",
        "rewards/digit_steps/mean",
        "advantage/std",
        "kl",
        "loss",
        "eval/rewards/arithmetic-steps",
        "eval/rewards/digit_steps",
        "time/advantage",
    ]:
        assert key in metrics, key
    history = {
        k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
        for k in ["kl", "advantage/abs_max", "steps/per_completion"]
    }
    assert sorted(history["kl"]) == [1, 2, 3]
    assert max(history["advantage/abs_max"].values()) > 0  # the step scores made advantages
    assert all(v >= 1 for v in history["steps/per_completion"].values())
    # the reference is the initial policy throughout: KL is 0 before the first update and
    # grows after it (an iterative run would bring it back to 0)
    assert history["kl"][1] == 0.0 and history["kl"][3] > 1e-6
    assert not any(k.startswith(("iterative/", "rm/")) for k in metrics)
