"""Process rewards (grpo_plugins.rewards.process) and the multi-step arithmetic task."""

from __future__ import annotations

import pytest
import torch
from grpo_plugins.advantages.process import process_advantages
from grpo_plugins.datasets import ArithmeticDataset, MultiStepArithmeticOptions
from grpo_plugins.rewards.process import (
    ArithmeticStepsOptions,
    ArithmeticStepsReward,
    ProcessRewardModel,
    ProcessRewardModelOptions,
    check_step,
)
from hypothesis import assume, given
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.errors import RunError
from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_model, build_tokenizer

torch.set_num_threads(1)


# --------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize(
    "step, ok",
    [
        ("12 + 34 = 46", True),
        ("12 + 34 = 47", False),
        ("46 - 50 = -4", True),
        ("-3 - -3 = 0", True),
        ("7 * 6 = 42", True),
        ("7 × 6 = 42", True),
        ("Step 2: 46 - 5 = 41.", True),
        ("  5+5=10  ", True),
        ("5 + 5 = 11", False),
        ("48 + 5 = 53, since we started with 48", True),
        ("Then 11 + 50 = 11", False),
        ("1 + 2 = 3 = 3", True),
    ],
)
def test_check_step_verifies_a_op_b_equals_c(step, ok):
    assert check_step(step) is ok


@pytest.mark.parametrize(
    "step",
    [
        "",
        "the answer is 41",
        "41",
        "1 + 2 + 3 = 6",
        "11 + 50 - 64 = 5 + 6 = 11",
        "a + b = c",
        "= 3",
        "1.5 + 2 = 3.5",
        "1 + 2 = 3.5",
        "3 + 4 =",
        "7x6=42",
    ],
)
def test_check_step_is_none_for_other_forms(step):
    assert check_step(step) is None


def test_arithmetic_steps_scores_each_step():
    reward = ArithmeticStepsReward(ArithmeticStepsOptions(question_column=None))
    steps = [["1 + 2 = 3", "3 + 4 = 8"], ["so"], [""]]
    assert reward(["p"] * 3, ["c"] * 3, steps=steps) == [[1.0, 0.0], [0.0], [0.0]]
    minus = ArithmeticStepsReward(
        ArithmeticStepsOptions(wrong=-1.0, unparsed=None, question_column=None)
    )
    assert minus(["p"] * 3, ["c"] * 3, steps=steps) == [[1.0, -1.0], [None], [None]]


def test_arithmetic_steps_wants_the_problems_numbers_by_default():
    reward = ArithmeticStepsReward()
    assert reward.required_columns == ["question"]
    steps = [
        ["47 - 92 = -45", "-45 + 93 = 48"],  # the left-to-right path
        ["92 - 47 = 45", "45 + 93 = 138"],  # right arithmetic on the problem's numbers
        ["12 + 30 = 42", "42 - 5 = 37"],  # the prompt's example, copied
        ["47 - 92 = -44", "-44 + 93 = 49"],  # a wrong result is no operand for later steps
        ["47 + 1 = 48"],  # a number from nowhere
    ]
    got = reward(["p"] * 5, ["c"] * 5, steps=steps, question=["47 - 92 + 93"] * 5)
    # left to right by default: only the first row follows the problem's order
    assert got == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0]]
    lax = ArithmeticStepsReward(ArithmeticStepsOptions(order="any"))
    got = lax(["p"] * 5, ["c"] * 5, steps=steps, question=["47 - 92 + 93"] * 5)
    assert got == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0]]
    with pytest.raises(
        RunError, match="needs the dataset column 'question' .*columns available: answer"
    ):
        reward(["p"], ["c"], steps=[["1 + 1 = 2"]], answer=["2"])


def test_arithmetic_steps_options_say_what_is_valid():
    with pytest.raises(ValidationError, match=r"wrong \(1.0\) must be lower than correct \(1.0\)"):
        ArithmeticStepsOptions(wrong=1.0)


def test_wrong_zero_or_minus_one_give_the_same_process_advantages():
    """What the option's description claims: the group normalization of the process
    estimator removes an affine change of every step score."""
    steps = [
        ["1 + 2 = 3", "3 + 4 = 8"],
        ["2 + 2 = 4", "4 + 4 = 8", "x"],
        ["9 - 1 = 7"],
        ["5 * 5 = 25"],
    ]
    mask = torch.ones((4, 6), dtype=torch.bool)
    ends = torch.tensor([[1, 5, 0], [0, 2, 5], [5, 0, 0], [5, 0, 0]])
    step_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    group_ids = torch.tensor([0, 0, 1, 1])
    out = []
    for wrong, unparsed in [(0.0, 0.0), (-1.0, -1.0)]:
        options = ArithmeticStepsOptions(wrong=wrong, unparsed=unparsed, question_column=None)
        scores = ArithmeticStepsReward(options)(None, None, steps=steps)
        table = torch.zeros((4, 3))
        for i, row in enumerate(scores):
            table[i, : len(row)] = torch.tensor(row)
        out.append(process_advantages(table, ends, step_mask, group_ids, mask))
    assert out[0].abs().max() > 0.5
    torch.testing.assert_close(out[0], out[1])


def test_the_multi_step_task_asks_for_one_step_per_line():
    data = ArithmeticDataset(MultiStepArithmeticOptions(train_size=20, eval_size=5, chat=False))
    rows = data.load("train")
    assert len(rows) == 20 and len(data.load("eval")) == 5
    for row in rows:
        terms = row["question"].split()
        assert len(terms) == 5 and set(terms[1::2]) <= {"+", "-"}
        value = int(terms[0])
        for op, term in zip(terms[1::2], terms[2::2]):
            value = value + int(term) if op == "+" else value - int(term)
        assert row["answer"] == str(value)  # left to right, one step per operator
        assert "one step per line" in row["prompt"] and row["question"] in row["prompt"]


def test_builtins_are_registered():
    registry = load_plugins(external=False).registry
    assert (
        registry.get("reward_function", "arithmetic-steps").plugin == "grpo_plugins.rewards.process"
    )
    assert (
        registry.get("reward_function", "process_reward_model").options is ProcessRewardModelOptions
    )
    assert registry.get("dataset", "arithmetic-steps").options is MultiStepArithmeticOptions


# --------------------------------------------------------------------------- PRM
@pytest.fixture(scope="module")
def prm(tmp_path_factory):
    path = tmp_path_factory.mktemp("prm")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, kind="token-classification", seed=3).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def direct(
    model, tokenizer, text: str, chars: list[int], add_special_tokens: bool = True
) -> list[float]:
    """P(label 1) at the token whose offsets hold each character, by a plain forward."""
    enc = tokenizer(
        text,
        return_offsets_mapping=True,
        add_special_tokens=add_special_tokens,
        return_tensors="pt",
    )
    offsets = enc.pop("offset_mapping")[0].tolist()
    with torch.no_grad():
        probs = torch.softmax(model(**enc).logits[0], dim=-1)[:, 1]
    return [float(probs[next(i for i, (a, b) in enumerate(offsets) if a <= c < b)]) for c in chars]


def test_prm_scores_each_step_at_its_last_token(prm):
    path, model, tokenizer = prm
    reward = ProcessRewardModel(ProcessRewardModelOptions(path=path))
    prompt, completion = "What is 1 + 2 + 4?\n", "1 + 2 = 3\n3 + 4 = 7\n"
    steps = ["1 + 2 = 3", "3 + 4 = 7"]
    got = reward([prompt, prompt], [completion, "nothing"], steps=[steps, ["nothing"]])
    text = prompt + completion
    expected = direct(model, tokenizer, text, [len(prompt) + 8, len(prompt) + 18])
    assert got[0] == pytest.approx(expected, abs=1e-6)
    assert got[1] == pytest.approx(
        direct(model, tokenizer, prompt + "nothing", [len(prompt) + 6]), abs=1e-6
    )
    assert all(0.0 < p < 1.0 for p in got[0])


def test_prm_with_chat_prompts_uses_the_template(prm):
    path, model, tokenizer = prm
    reward = ProcessRewardModel(ProcessRewardModelOptions(path=path))
    prompt = [{"role": "user", "content": "What is 1 + 2?"}]
    completion = [{"role": "assistant", "content": "1 + 2 = 3"}]
    got = reward([prompt], [completion], steps=[["1 + 2 = 3"]])
    text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    last = text.rfind("1 + 2 = 3") + len("1 + 2 = 3") - 1
    assert got[0] == pytest.approx(
        direct(model, tokenizer, text, [last], add_special_tokens=False), abs=1e-6
    )


def test_prm_step_tag_mode_reads_the_separator(prm):
    path, model, tokenizer = prm
    reward = ProcessRewardModel(ProcessRewardModelOptions(path=path, step_separator=" <tag>\n"))
    got = reward(["Q: "], ["a\n\nb"], steps=[["a", "b"]])
    text = "Q: a <tag>\nb <tag>\n"
    first = text.index("\n")
    assert got[0] == pytest.approx(direct(model, tokenizer, text, [first, len(text) - 1]), abs=1e-6)


def test_prm_steps_truncated_away_are_none(prm):
    path, _, _ = prm
    reward = ProcessRewardModel(ProcessRewardModelOptions(path=path, max_length=6))
    steps = ["1 + 2 = 3", "3 + 4 = 7", "7 + 1 = 8"]
    got = reward(["What is 1 + 2 + 4 + 1?\n"], ["\n".join(steps)], steps=[steps])
    assert got[0][0] is None and got[0][-1] is not None


def test_prm_with_a_model_of_too_few_labels_is_an_error(prm):
    path, _, _ = prm
    reward = ProcessRewardModel(ProcessRewardModelOptions(path=path, positive_label=2))
    with pytest.raises(RunError, match="positive_label 2 but the model has 2 labels"):
        reward(["p"], ["c"], steps=[["c"]])


def test_prm_missing_model_names_the_reward(tmp_path):
    reward = ProcessRewardModel(ProcessRewardModelOptions(path=tmp_path / "none"))
    with pytest.raises(
        RunError, match="'process_reward_model' could not load a token-classification model"
    ):
        reward(["p"], ["c"], steps=[["c"]])


def test_arithmetic_steps_left_to_right_by_hand():
    """The hack a lax check pays for: one right equation on the problem's numbers that
    skips the rest ('20 + 6 = 26' for 20 + 5 - 6) is wrong in order."""
    reward = ArithmeticStepsReward()
    steps = [
        ["20 + 6 = 26"],  # right arithmetic, wrong operation
        ["20 + 5 = 25"],  # the first step, then stopped: the last step did not end it
        ["20 + 5 = 25", "25 - 6 = 19"],  # the solution
        ["20 + 5 = 25", "25 - 6 = 19", "19 + 1 = 20"],  # a step past the last operation
        ["so:", "20 + 5 = 25", "25 - 6 = 19"],  # prose does not break the order
        ["20 + 5 = 24", "24 - 6 = 18"],  # a wrong result: the next step has no right operand
    ]
    got = reward(["p"] * 6, ["c"] * 6, steps=steps, question=["20 + 5 - 6"] * 6)
    assert got == [[0.0], [0.0], [1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0]]
    # stopping after the first right step is no better than a wrong step; a right first
    # step followed by an attempt at the next one keeps its credit
    got = reward(["p"] * 2, ["c"] * 2, steps=[["20 + 5 = 25", "25 - 6 = 18"], ["20 + 5 = 25", "so 25"]],
                 question=["20 + 5 - 6"] * 2)
    assert got == [[1.0, 0.0], [1.0, 0.0]]
    times = reward(["p"], ["c"], steps=[["3 × 4 = 12", "12 + 1 = 13"]], question=["3 * 4 + 1"])
    assert times == [[1.0, 1.0]]
    # a question that is not a chain of numbers and operators falls back to the lax check
    assert reward(["p"], ["c"], steps=[["2 + 3 = 5"]], question=["What is 2 + 3?"]) == [[1.0]]


@given(
    terms=st.lists(st.integers(1, 99), min_size=2, max_size=6),  # no "+ 0": a step equal to the one before
    ops=st.lists(st.sampled_from(["+", "-"]), min_size=5, max_size=5),
    error=st.integers(1, 5),
    data=st.data(),
)
def test_arithmetic_steps_left_to_right_scores_the_solution_and_stops_at_an_error(terms, ops, error, data):
    ops = ops[: len(terms) - 1]
    question = " ".join([str(terms[0])] + [f"{o} {t}" for o, t in zip(ops, terms[1:])])
    lines, value = [], terms[0]
    for op, term in zip(ops, terms[1:]):
        result = value + term if op == "+" else value - term
        lines.append(f"{value} {op} {term} = {result}")
        value = result
    # a later step that repeats an earlier one word for word (1 + 1 = 2, 2 - 1 = 1, 1 + 1 = 2)
    # is a right step on the problem's numbers wherever it stands: not what this test is about
    assume(len(set(lines)) == len(lines))
    reward = ArithmeticStepsReward()
    assert reward(["p"], ["c"], steps=[lines], question=[question]) == [[1.0] * len(lines)]
    k = data.draw(st.integers(0, len(lines) - 1))  # step k gets a wrong result
    broken = list(lines)
    head, _, c = broken[k].rpartition("= ")
    broken[k] = f"{head}= {int(c) + error}"
    got = reward(["p"], ["c"], steps=[broken], question=[question])[0]
    assert got[:k] == [1.0] * k and got[k] == 0.0
    assert all(score == 0.0 for score in got[k + 1:])  # later steps have no right operand
    if len(lines) > 1:  # a right prefix that stops early: its last step is marked wrong
        stopped = reward(["p"], ["c"], steps=[lines[:-1]], question=[question])[0]
        assert stopped == [1.0] * (len(lines) - 2) + [0.0]
