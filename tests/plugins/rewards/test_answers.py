"""The ``accuracy`` reward: hand cases, conversational completions, the gold column, off the main
thread and without a timeout, and no pay for restating the question."""

from __future__ import annotations

import threading

import pytest
from grpo_plugins.rewards.answers import AccuracyOptions, AccuracyReward
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.errors import RunError

from .conftest import chat

ACCURACY_CASES = [
    ("34 + 57 = 91", "91", 1.0),  # plain text, the answer is the last number
    ("Let me add: 12 + 7 = 19", "19", 1.0),
    ("12 + 7 = 20", "19", 0.0),
    ("The answer is 19.", "19", 1.0),
    ("First 3, then 16 more: \\boxed{19}", "19", 1.0),
    ("The answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("so it is 0.5", "\\frac{1}{2}", 1.0),  # numeric equality, not string equality
    ("I get 19 apples, wait, no: 21", "19", 0.0),  # the last number counts
    ("The total is 1,234", "1234", 1.0),
    ("(19)", "19", 1.0),  # math-verify extracts nothing here: the last-number fallback
    ("no idea", "19", 0.0),
    ("", "19", 0.0),
    ("-45", "-45", 1.0),
]


@pytest.mark.parametrize("completion, gold, expected", ACCURACY_CASES)
def test_accuracy_hand_cases(completion, gold, expected):
    reward = AccuracyReward(AccuracyOptions())
    assert reward(["q"], [completion], answer=[gold]) == [expected]


def test_accuracy_conversational_completions_score_like_strings():
    reward = AccuracyReward(AccuracyOptions())
    prompts = [[{"role": "user", "content": "What is 12 + 7?"}]] * 3
    completions = [chat("12 + 7 = 19"), chat("20"), chat("\\boxed{19}")]
    assert reward(prompts, completions, answer=["19"] * 3) == [1.0, 0.0, 1.0]


def test_accuracy_unparseable_gold_is_unscorable_not_zero():
    reward = AccuracyReward(AccuracyOptions())
    out = reward(["q"] * 4, ["19", "19", "19", "19"], answer=["no answer", "", None, "19"])
    assert out == [None, None, None, 1.0]


def test_accuracy_reads_the_configured_column_and_numeric_golds():
    reward = AccuracyReward(AccuracyOptions(answer_column="solution"))
    out = reward(["q", "q"], ["= 19", "= 19"], solution=[19, 20], answer=["19", "19"],
                 completion_ids=[[1, 2], [3]], unknown_column=["x", "y"])
    assert out == [1.0, 0.0]


def test_accuracy_declares_its_column_for_the_engine_check():
    assert AccuracyReward(AccuracyOptions(answer_column="solution")).required_columns == ["solution"]


def test_accuracy_missing_column_names_it_and_lists_what_exists():
    reward = AccuracyReward(AccuracyOptions())
    with pytest.raises(RunError, match=r"'accuracy' needs the dataset column 'answer'.*"
                                       r"available: completion_ids, solution"):
        reward(["q"], ["19"], solution=["19"], completion_ids=[[1]])


def test_accuracy_column_of_wrong_length_is_an_error():
    with pytest.raises(RunError, match="2 entries for 1 completions"):
        AccuracyReward(AccuracyOptions())(["q"], ["19"], answer=["19", "20"])


def test_accuracy_works_off_the_main_thread():
    """math-verify's SIGALRM timeout raises off the main thread; the reward drops it there."""
    reward = AccuracyReward(AccuracyOptions(timeout=5))
    results, errors = [], []

    def work():
        try:
            results.append(reward(["q", "q"], ["12 + 7 = 19", "18"], answer=["19", "19"]))
        except Exception as exc:  # pragma: no cover - the failure being tested
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert errors == [] and results == [[1.0, 0.0]]


def test_accuracy_without_timeout_scores_the_same():
    reward = AccuracyReward(AccuracyOptions(timeout=0))
    assert reward(["q", "q"], ["= 19", "= 18"], answer=["19", "19"]) == [1.0, 0.0]


@settings(max_examples=40, deadline=None)
@given(a=st.integers(0, 9999), b=st.integers(0, 9999), off=st.integers(1, 50))
def test_accuracy_on_plain_equations_property(a, b, off):
    reward = AccuracyReward(AccuracyOptions())
    right, wrong = f"{a} + {b} = {a + b}", f"{a} + {b} = {a + b + off}"
    assert reward(["q", "q"], [right, chat(wrong)], answer=[str(a + b)] * 2) == [1.0, 0.0]


def test_accuracy_options_validation_says_what_is_valid():
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        AccuracyOptions(timeout=-1)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AccuracyOptions(answer_col="answer")


@pytest.mark.parametrize("completion, expected", [
    ("87 + 86 = ?", 0.0),            # the question restated: math-verify would evaluate it to 173
    ("87 + 86", 0.0),
    ("\\boxed{87+86}", 0.0),
    ("To compute 87 + 86 we add them.", 0.0),
    ("87 + 86 = 173", 1.0),
    ("The answer is 173.", 1.0),
    ("\\boxed{173}", 1.0),
    ("173", 1.0),
])
def test_accuracy_does_not_pay_for_restating_the_question(completion, expected):
    """A policy learned to answer '87 + 86 = ?' within 40 steps when this paid 1.0."""
    assert AccuracyReward()(["What is 87 + 86?"], [completion], answer=["173"]) == [expected]
