"""Built-in datasets: arithmetic, file, hf (grpo_plugins.datasets)."""

from __future__ import annotations

import json
import re

import pytest
from grpo_plugins.datasets import (
    ArithmeticDataset,
    ArithmeticOptions,
    FileDataset,
    FileOptions,
    HFDataset,
    HFOptions,
    _evaluate,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.errors import RunError
from grpo_core.plugin_manager import load_plugins

EXPRESSION = re.compile(r"^\d+( [-+*] \d+)+$")


def _value(question: str) -> int:
    """Independent reference: Python's own precedence on a checked '12 + 3 * 4' string."""
    assert EXPRESSION.match(question), question
    return eval(question, {"__builtins__": {}}, {})  # noqa: S307 - digits and + - * only


# --------------------------------------------------------------------------- arithmetic
def test_arithmetic_defaults_are_two_digit_additions_in_chat_form():
    dataset = ArithmeticDataset(ArithmeticOptions())
    train, eval_rows = dataset.load("train"), dataset.load("eval")
    assert (len(train), len(eval_rows)) == (1000, 100)
    for row in train + eval_rows:
        assert set(row) == {"prompt", "answer", "question"}
        [message] = row["prompt"]
        assert message["role"] == "user"
        a, b = map(int, row["question"].split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert message["content"] == f"What is {a} + {b}? Answer with just the number."
        assert row["answer"] == str(a + b)


def test_arithmetic_splits_are_disjoint_and_without_duplicates():
    dataset = ArithmeticDataset(ArithmeticOptions(train_size=3000, eval_size=500))
    train = [row["question"] for row in dataset.load("train")]
    held_out = [row["question"] for row in dataset.load("eval")]
    assert len(set(train)) == 3000 and len(set(held_out)) == 500
    assert not set(train) & set(held_out)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    low=st.integers(0, 5),
    width=st.integers(0, 3),
    terms=st.integers(2, 3),
    ops=st.lists(st.sampled_from(["+", "-", "*"]), min_size=1, max_size=3, unique=True),
    data=st.data(),
)
def test_arithmetic_small_spaces_property(seed, low, width, terms, ops, data):
    """Even when the splits use up every possible problem, they stay disjoint and right."""
    count = (width + 1) ** terms * len(ops) ** (terms - 1)
    eval_size = data.draw(st.integers(0, count - 1))
    train_size = data.draw(st.integers(1, count - eval_size))
    options = ArithmeticOptions(seed=seed, min_value=low, max_value=low + width, num_terms=terms,
                                operations=ops, train_size=train_size, eval_size=eval_size)
    dataset = ArithmeticDataset(options)
    train, held_out = dataset.load("train"), dataset.load("eval")
    questions = [row["question"] for row in train + held_out]
    assert len(train) == train_size and len(held_out) == eval_size
    assert len(set(questions)) == len(questions)
    for row in train + held_out:
        assert row["answer"] == str(_value(row["question"]))
        numbers = [int(n) for n in re.findall(r"\d+", row["question"])]
        assert len(numbers) == terms and all(low <= n <= low + width for n in numbers)
        assert set(re.findall(r" ([-+*]) ", row["question"])) <= set(ops)
    if train_size + eval_size == count:  # the whole space, each problem exactly once
        assert len(set(questions)) == count


def test_arithmetic_is_deterministic_per_seed():
    options = ArithmeticOptions(seed=7, operations=["+", "-", "*"], num_terms=3)
    first = ArithmeticDataset(options)
    again = ArithmeticDataset(ArithmeticOptions(seed=7, operations=["+", "-", "*"], num_terms=3))
    assert first.load("train") == again.load("train")
    assert first.load("eval") == again.load("eval")
    other = ArithmeticDataset(ArithmeticOptions(seed=8, operations=["+", "-", "*"], num_terms=3))
    assert other.load("train") != first.load("train")


def test_arithmetic_eval_split_does_not_depend_on_train_size():
    small = ArithmeticDataset(ArithmeticOptions(seed=3, train_size=10, eval_size=50))
    large = ArithmeticDataset(ArithmeticOptions(seed=3, train_size=5000, eval_size=50))
    assert small.load("eval") == large.load("eval")


@pytest.mark.parametrize(
    "terms, ops, value",
    [([2, 3, 4], ["+", "*"], 14), ([2, 3, 4], ["*", "+"], 10), ([10, 2, 3], ["-", "-"], 5),
     ([10, 2, 3], ["-", "*"], 4), ([5, 6], ["*"], 30), ([1, 2, 3, 4], ["*", "-", "*"], -10)],
)
def test_arithmetic_multiplication_binds_tighter(terms, ops, value):
    assert _evaluate(terms, ops) == value


def test_arithmetic_plain_prompts_and_custom_instruction():
    options = ArithmeticOptions(chat=False, instruction="Compute {question}. Braces: {{}}",
                                train_size=5, eval_size=0)
    dataset = ArithmeticDataset(options)
    rows = dataset.load("train")
    assert all(isinstance(r["prompt"], str) for r in rows)
    assert rows[0]["prompt"] == f"Compute {rows[0]['question']}. Braces: {{}}"
    assert dataset.load("eval") == []


def test_arithmetic_rows_score_with_the_accuracy_reward():
    from grpo_plugins.rewards.answers import AccuracyOptions, AccuracyReward

    rows = ArithmeticDataset(ArithmeticOptions(train_size=4, eval_size=0)).load("train")
    reward = AccuracyReward(AccuracyOptions())
    completions = [f"{r['question']} = {r['answer']}" for r in rows]
    assert reward([r["prompt"] for r in rows], completions,
                  answer=[r["answer"] for r in rows]) == [1.0] * 4


@pytest.mark.parametrize(
    "values, message",
    [
        ({"min_value": 50, "max_value": 10}, r"max_value \(10\) must be >= min_value \(50\)"),
        ({"min_value": 1, "max_value": 3, "train_size": 10},
         r"train_size \+ eval_size = 110 distinct problems, but these settings allow only 9"),
        ({"operations": ["/"]}, r"'\+', '-' or '\*'"),
        ({"operations": []}, "at least 1 item"),
        ({"operations": ["+", "+"]}, r"repeat an operator; list each of \+, -, \* once"),
        ({"instruction": "What is it?"}, r"must contain the placeholder '\{question\}'"),
        ({"instruction": "{question} {n}"}, r"'\{question\}' is the only placeholder"),
        ({"num_terms": 1}, "greater than or equal to 2"),
        ({"min_value": -1}, "greater than or equal to 0"),
        ({"size": 10}, "Extra inputs are not permitted"),
    ],
)
def test_arithmetic_invalid_options_say_what_is_valid(values, message):
    with pytest.raises(ValidationError, match=message):
        ArithmeticOptions(**values)


def test_unknown_split_lists_the_valid_ones():
    with pytest.raises(RunError, match="unknown split 'test'; valid: train, eval"):
        ArithmeticDataset(ArithmeticOptions(train_size=1, eval_size=0)).load("test")


# --------------------------------------------------------------------------- file
ROWS = [
    {"prompt": [{"role": "user", "content": "What is 1 + 2?"}], "answer": "3"},
    {"prompt": [{"role": "user", "content": "What is 30 + 4?"}], "answer": "34"},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_file_jsonl_rows_are_plain_dicts(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    dataset = FileDataset(FileOptions(train=str(train)))
    rows = dataset.load("train")
    assert rows == ROWS
    assert type(rows[0]) is dict and type(rows[0]["prompt"]) is list
    assert type(rows[0]["prompt"][0]) is dict
    assert dataset.load("eval") == []  # no eval file, no held-out split


def test_file_csv_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    csv = tmp_path / "train.csv"
    csv.write_text('prompt,answer\n"What is 1 + 2?",3\nCafé: 30 + 4?,34\n', encoding="utf-8")
    parquet = tmp_path / "eval.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    dataset = FileDataset(FileOptions(train=str(csv), eval=str(parquet)))
    assert dataset.load("train") == [
        {"prompt": "What is 1 + 2?", "answer": 3},
        {"prompt": "Café: 30 + 4?", "answer": 34},
    ]
    assert dataset.load("eval") == ROWS


def test_file_relative_paths_resolve_against_the_spec_folder(tmp_path):
    (tmp_path / "data").mkdir()
    _write_jsonl(tmp_path / "data" / "train.jsonl", ROWS)
    options = FileOptions.model_validate({"train": "data/train.jsonl"},
                                         context={"base_dir": tmp_path})
    assert options.train == tmp_path / "data" / "train.jsonl" and options.eval is None
    assert FileDataset(options).load("train") == ROWS


def test_file_explicit_format_overrides_the_extension(tmp_path):
    data = _write_jsonl(tmp_path / "train.data", ROWS[:1])
    assert FileDataset(FileOptions(train=str(data), format="jsonl")).load("train") == ROWS[:1]


def test_file_unknown_extension_lists_the_formats():
    with pytest.raises(ValidationError, match=r"known extensions are \.jsonl, \.json.*"
                                              r"or set format to json, jsonl, csv or parquet"):
        FileOptions(train="/data/train.txt")
    with pytest.raises(ValidationError, match="'auto', 'json', 'jsonl', 'csv' or 'parquet'"):
        FileOptions(train="/data/train.jsonl", format="xml")


def test_file_missing_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(RunError, match=f"dataset file {re.escape(str(missing))} does not exist"):
        FileDataset(FileOptions(train=str(missing))).load("train")


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("header.csv", "prompt,answer\n"),
                                           ("blank.jsonl", "\n\n")])
def test_file_empty_is_a_clear_error_naming_the_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(RunError, match=f"dataset file {re.escape(str(path))} is empty"):
        FileDataset(FileOptions(train=str(path))).load("train")


@pytest.mark.parametrize("name, content, line", [
    ("latin1.jsonl", b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n', 2),
    ("latin1.csv", b"prompt,answer\ncaf\xe9,1\n", 2),
])
def test_file_not_utf8_names_the_file_and_the_byte(tmp_path, name, content, line):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(RunError) as info:
        FileDataset(FileOptions(train=str(path))).load("train")
    message = str(info.value)
    offset = content.index(b"\xe9")
    assert str(path) in message and "is not valid UTF-8" in message
    assert f"byte 0xe9 at offset {offset} (line {line})" in message


def test_file_utf8_check_spans_chunk_boundaries(tmp_path):
    from grpo_plugins.datasets import check_utf8

    path = tmp_path / "split.jsonl"
    path.write_bytes(b"a\n" + "é".encode() * 3 + b"\n\xff")  # é's two bytes straddle chunks
    with pytest.raises(RunError, match=r"byte 0xff at offset 9 \(line 3\)"):
        check_utf8(path, chunk=3)


def test_file_malformed_content_names_the_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "answer": \n', encoding="utf-8")
    expected = f"could not read dataset file {re.escape(str(path))} as json"
    with pytest.raises(RunError, match=expected):
        FileDataset(FileOptions(train=str(path))).load("train")


# --------------------------------------------------------------------------- hf
@pytest.fixture
def saved_dict(tmp_path):
    import datasets

    path = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(ROWS),
        "test": datasets.Dataset.from_list(ROWS[:1]),
    }).save_to_disk(str(path))
    return path


def test_hf_loads_a_saved_dataset_dict(saved_dict):
    dataset = HFDataset(HFOptions(path=str(saved_dict), eval_split="test"))
    assert dataset.load("train") == ROWS
    assert dataset.load("eval") == ROWS[:1]
    assert type(dataset.load("train")[0]) is dict
    assert HFDataset(HFOptions(path=str(saved_dict))).load("eval") == []


def test_hf_relative_saved_dir_resolves_but_hub_ids_do_not(saved_dict):
    context = {"base_dir": saved_dict.parent}
    local = HFOptions.model_validate({"path": saved_dict.name}, context=context)
    assert local.path == str(saved_dict)
    hub = HFOptions.model_validate({"path": "openai/gsm8k"}, context=context)
    assert hub.path == "openai/gsm8k"


def test_hf_missing_split_lists_the_available_ones(saved_dict):
    dataset = HFDataset(HFOptions(path=str(saved_dict), eval_split="validation"))
    with pytest.raises(RunError, match="has no split 'validation'; available: train, test"):
        dataset.load("eval")


def test_hf_loads_a_saved_single_dataset(tmp_path):
    import datasets

    path = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    assert HFDataset(HFOptions(path=str(path))).load("train") == ROWS
    with pytest.raises(RunError, match="single saved Dataset.*unset eval_split"):
        HFDataset(HFOptions(path=str(path), eval_split="test")).load("eval")


def test_hf_hub_names_go_to_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load(name, config=None, *, split, revision, keep_in_memory):
        calls.append((name, config, split, revision))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    options = HFOptions(path="openai/gsm8k", config="main", eval_split="test", revision="v1")
    assert HFDataset(options).load("eval") == ROWS
    assert calls == [("openai/gsm8k", "main", "test", "v1")]


def test_hf_network_error_names_the_dataset_and_the_way_out(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RunError) as info:
        HFDataset(HFOptions(path="openai/gsm8k", config="main")).load("train")
    message = str(info.value)
    assert "'openai/gsm8k' (config 'main') split 'train'" in message
    assert "needs the network, or a local copy" in message and "save_to_disk" in message


def test_hf_other_errors_name_the_dataset_without_a_network_hint(monkeypatch):
    import datasets

    def bad_split(*args, **kwargs):
        raise ValueError('Unknown split "dev". Should be one of [\'train\', \'test\'].')

    monkeypatch.setattr(datasets, "load_dataset", bad_split)
    expected = r"'org/data' split 'train': ValueError: Unknown split"
    with pytest.raises(RunError, match=expected) as info:
        HFDataset(HFOptions(path="org/data")).load("train")
    assert "network" not in str(info.value)


# --------------------------------------------------------------------------- registration
REGISTERED = {
    "arithmetic": (ArithmeticOptions, {}),
    "file": (FileOptions, {"train": "/data/train.jsonl"}),
    "hf": (HFOptions, {"path": "openai/gsm8k"}),
}


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_registered_and_buildable_from_options(name):
    registry = load_plugins(external=False).registry
    component = registry.get("dataset", name)
    options_model, values = REGISTERED[name]
    assert component.plugin == "grpo_plugins.datasets"
    assert component.options is options_model
    assert component.description
    built = component.build(options_model(**values))
    assert callable(built.load)


@pytest.mark.parametrize("model", [m for m, _ in REGISTERED.values()])
def test_every_option_has_a_description(model):
    for field_name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{field_name} has no description"
