"""Built-in reward functions: accuracy, format, overlong, reward_model (grpo_plugins.rewards)."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from grpo_plugins.rewards import (
    AccuracyOptions,
    AccuracyReward,
    FormatOptions,
    FormatReward,
    OverlongOptions,
    OverlongReward,
    RewardModelOptions,
    RewardModelReward,
    completion_text,
    overlong_punishment,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.errors import RunError
from grpo_core.plugin_manager import load_plugins


def chat(text: str) -> list[dict[str, str]]:
    """A completion in TRL's conversational form."""
    return [{"role": "assistant", "content": text}]


# --------------------------------------------------------------------------- completion_text
@pytest.mark.parametrize(
    "completion, text",
    [
        ("plain 19", "plain 19"),
        (chat("it is 19"), "it is 19"),
        ({"role": "assistant", "content": "one message"}, "one message"),
        ([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "ab"),
        ([{"role": "assistant", "content": [{"type": "text", "text": "parts"}]}], "parts"),
        ([], ""),
    ],
)
def test_completion_text_of_each_representation(completion, text):
    assert completion_text(completion) == text


def test_completion_text_rejects_other_types():
    with pytest.raises(TypeError, match="string or a list of chat messages"):
        completion_text(19)


# --------------------------------------------------------------------------- accuracy
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


# --------------------------------------------------------------------------- format
def test_format_search_and_fullmatch():
    pattern = r"<think>.*</think>\s*<answer>\d+</answer>"
    text = "<think>\n12 + 7\n</think>\n<answer>19</answer>"
    search = FormatReward(FormatOptions(pattern=pattern))
    full = FormatReward(FormatOptions(pattern=pattern, mode="fullmatch"))
    completions = [text, "preamble " + text, "<answer>19</answer>", chat(text)]
    assert search(["q"] * 4, completions) == [1.0, 1.0, 0.0, 1.0]
    assert full(["q"] * 4, completions) == [1.0, 0.0, 0.0, 1.0]


def test_format_dotall_is_the_default_and_can_be_turned_off():
    text = "<think>line one\nline two</think>"
    assert FormatReward(FormatOptions(pattern="<think>.*</think>"))(["q"], [text]) == [1.0]
    no_dotall = FormatReward(FormatOptions(pattern="<think>.*</think>", flags=[]))
    assert no_dotall(["q"], [text]) == [0.0]
    ignorecase = FormatReward(FormatOptions(pattern="ANSWER", flags=["IGNORECASE"]))
    assert ignorecase(["q", "q"], ["the answer", "nothing"]) == [1.0, 0.0]


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40), needle=st.text(min_size=1, max_size=4))
def test_format_matches_literal_substrings_property(text, needle):
    search = FormatReward(FormatOptions(pattern=re.escape(needle)))
    full = FormatReward(FormatOptions(pattern=re.escape(needle), mode="fullmatch"))
    assert search(["q"], [text]) == [1.0 if needle in text else 0.0]
    assert full(["q"], [chat(text)]) == [1.0 if needle == text else 0.0]


def test_format_invalid_regex_names_the_pattern_and_the_re_error():
    with pytest.raises(ValidationError) as info:
        FormatOptions(pattern="<answer>(\\d+</answer>")
    message = str(info.value)
    assert "'<answer>(\\\\d+</answer>'" in message
    assert "not a valid Python regular expression" in message
    assert "missing ), unterminated subpattern" in message


def test_format_options_list_what_is_valid():
    with pytest.raises(ValidationError, match="Field required"):
        FormatOptions()
    with pytest.raises(ValidationError, match="'search' or 'fullmatch'"):
        FormatOptions(pattern="x", mode="match")
    with pytest.raises(ValidationError, match="'DOTALL', 'IGNORECASE', 'MULTILINE'"):
        FormatOptions(pattern="x", flags=["DOTAL"])


# --------------------------------------------------------------------------- overlong
@pytest.mark.parametrize(
    "length, expected",
    # L_max = 10, buffer = 4: free up to 6 tokens, then -1/4 per token, -1 beyond 10
    [(0, 0.0), (5, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (9, -0.75), (10, -1.0), (11, -1.0),
     (500, -1.0)],
)
def test_overlong_hand_values(length, expected):
    reward = OverlongReward(OverlongOptions(max_length=10, buffer=4))
    out = reward(["q"], ["text"], completion_ids=[list(range(length))])
    assert out == [pytest.approx(expected)]


def test_overlong_counts_tokens_not_characters():
    reward = OverlongReward(OverlongOptions(max_length=10, buffer=4))
    out = reward(["q", "q"], ["x" * 1000, chat("y")], completion_ids=[[1, 2], list(range(9))])
    assert out == [0.0, pytest.approx(-0.75)]


def test_overlong_default_buffer_is_a_fifth_of_max_length():
    assert OverlongReward(OverlongOptions(max_length=20480)).buffer == 4096  # DAPO's setting
    assert OverlongReward(OverlongOptions(max_length=256)).buffer == 51
    assert OverlongReward(OverlongOptions(max_length=3)).buffer == 1


def _reference_punishment(length: int, l_max: int, l_cache: int) -> float:
    # DAPO eq. 13, written out case by case
    if length <= l_max - l_cache:
        return 0.0
    if l_max - l_cache < length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@settings(max_examples=200, deadline=None)
@given(data=st.data(), l_max=st.integers(1, 4096))
def test_overlong_matches_the_piecewise_formula_property(data, l_max):
    buffer = data.draw(st.integers(1, l_max))
    length = data.draw(st.integers(0, 2 * l_max + 2))
    value = overlong_punishment(length, l_max, buffer)
    assert value == pytest.approx(_reference_punishment(length, l_max, buffer))
    assert -1.0 <= value <= 0.0
    # non-increasing in the length, continuous where the pieces meet
    assert overlong_punishment(length + 1, l_max, buffer) <= value
    assert overlong_punishment(l_max, l_max, buffer) == pytest.approx(-1.0)
    assert overlong_punishment(l_max - buffer, l_max, buffer) == 0.0


def test_overlong_needs_completion_ids():
    with pytest.raises(RunError, match="'overlong' needs the dataset column 'completion_ids'"):
        OverlongReward(OverlongOptions(max_length=8))(["q"], ["text"])


def test_overlong_options_say_what_is_valid():
    with pytest.raises(ValidationError, match=r"buffer \(9\) must be at most max_length \(8\)"):
        OverlongOptions(max_length=8, buffer=9)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        OverlongOptions(max_length=0)
    with pytest.raises(ValidationError, match="max_length\n  Field required"):
        OverlongOptions()


# --------------------------------------------------------------------------- reward model
def _tiny_reward_model(tokenizer):
    from grpo_core.testing import build_model

    try:
        return build_model(tokenizer, kind="sequence-classification")
    except AttributeError:
        # grpo_core.testing sets generation_config, which a transformers 5
        # sequence-classification model lacks; build the same tiny Llama here.
        from transformers import LlamaConfig, LlamaForSequenceClassification

        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id, num_labels=1,
        )
        torch.manual_seed(0)
        return LlamaForSequenceClassification(config)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from grpo_core.testing import build_tokenizer

    path = tmp_path_factory.mktemp("reward-model")
    tokenizer = build_tokenizer()
    model = _tiny_reward_model(tokenizer).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def _direct_score(model, tokenizer, text: str, add_special_tokens: bool = True) -> float:
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)
    with torch.no_grad():
        return float(model(**ids).logits[0, 0])


def test_reward_model_scores_equal_a_direct_forward(reward_model_dir):
    path, model, tokenizer = reward_model_dir
    reward = RewardModelReward(RewardModelOptions(path=str(path), batch_size=2))
    assert reward._model is None  # loads lazily, on the first call
    prompts = ["What is 1 + 2? ", "What is 1 + 2? ", "What is 30 + 4? "]
    completions = ["3", "It is 4, I think.", "34"]
    scores = reward(prompts, completions, answer=["3", "3", "34"], completion_ids=[[1]] * 3)
    expected = [_direct_score(model, tokenizer, p + c) for p, c in zip(prompts, completions)]
    assert all(isinstance(s, float) for s in scores)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == 3  # really per completion


def test_reward_model_applies_the_chat_template_to_conversations(reward_model_dir):
    path, model, tokenizer = reward_model_dir
    reward = RewardModelReward(RewardModelOptions(path=str(path), batch_size=8))
    prompts = [[{"role": "user", "content": "What is 1 + 2?"}]] * 2
    completions = [chat("3"), chat("The answer is 4.")]
    scores = reward(prompts, completions)
    expected = [
        _direct_score(model, tokenizer, "<|user|>What is 1 + 2?<|end|>\n<|assistant|>" + text
                      + "<|end|>\n", add_special_tokens=False)
        for text in ("3", "The answer is 4.")
    ]
    assert scores == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(("option", "plain", "templated"), [(None, True, False), (False, False, False),
                                                          (True, True, True)])
def test_reward_model_special_tokens_follow_the_option(reward_model_dir, option, plain, templated):
    """null: special tokens on plain text only (the chat template writes its own); false: never
    (TRL's GRPOTrainer); true: always. The test tokenizer adds none, so the call is watched."""
    path, _, _ = reward_model_dir
    reward = RewardModelReward(RewardModelOptions(path=str(path), add_special_tokens=option))
    reward(["1 + 2 = "], ["3"])  # loads the model
    seen = []
    tokenizer = reward._tokenizer

    class Spy:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, texts, **kwargs):
            seen.append(kwargs["add_special_tokens"])
            return tokenizer(texts, **kwargs)

    reward._tokenizer = Spy()
    reward(["1 + 2 = "], ["3"])
    reward([[{"role": "user", "content": "1 + 2?"}]], [chat("3")])
    assert seen == [plain, templated]


def test_reward_model_truncation_keeps_the_end(reward_model_dir):
    path, model, tokenizer = reward_model_dir
    text = "What is 12 + 7? Think step by step. 12 + 7 = 19"
    ids = tokenizer(text).input_ids
    reward = RewardModelReward(RewardModelOptions(path=str(path), max_length=5))
    with torch.no_grad():
        tail = float(model(input_ids=torch.tensor([ids[-5:]])).logits[0, 0])
    assert reward([text[:10]], [text[10:]]) == [pytest.approx(tail, abs=1e-5)]


def test_reward_model_missing_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    reward = RewardModelReward(RewardModelOptions(path=str(missing)))
    with pytest.raises(RunError, match=re.escape(repr(str(missing)))):
        reward(["q"], ["a"])


def test_reward_model_options_say_what_is_valid():
    with pytest.raises(ValidationError, match="'auto', 'bfloat16', 'float16' or 'float32'"):
        RewardModelOptions(path="m", dtype="fp8")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        RewardModelOptions(path="m", batch_size=0)
    assert RewardModelOptions(path="m").trust_remote_code is False


# --------------------------------------------------------------------------- registration
REGISTERED = {
    "accuracy": (AccuracyOptions, {}),
    "format": (FormatOptions, {"pattern": r"\d+"}),
    "overlong": (OverlongOptions, {"max_length": 16}),
    "reward_model": (RewardModelOptions, {"path": "/nonexistent"}),
}


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_registered_and_buildable_from_options(name):
    registry = load_plugins(external=False).registry
    component = registry.get("reward_function", name)
    options_model, values = REGISTERED[name]
    assert component.plugin == "grpo_plugins.rewards"
    assert component.options is options_model
    assert component.description
    built = component.build(options_model(**values))
    assert callable(built) and built.__name__ == name and name in repr(built)


@pytest.mark.parametrize("model", [m for m, _ in REGISTERED.values()])
def test_every_option_has_a_description(model):
    for field_name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{field_name} has no description"


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
    from grpo_plugins.rewards import AccuracyReward

    assert AccuracyReward()(["What is 87 + 86?"], [completion], answer=["173"]) == [expected]
