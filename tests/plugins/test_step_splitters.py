"""Step splitters (grpo_plugins.step_splitters) and the mapping of step ends to the
generated tokens (grpo_core.train.reasoning_steps), for several kinds of tokenizer."""

from __future__ import annotations

import pytest
import torch
from grpo_plugins.step_splitters import RegexOptions, SeparatorSplitter
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.errors import RunError
from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_tokenizer
from grpo_core.train.reasoning_steps import split_steps, step_tensors, step_token_ends

torch.set_num_threads(1)


def registry():
    return load_plugins(external=False).registry


def splitter(name: str, **options):
    component = registry().get("step_splitter", name)
    return component.build(component.options(**options) if component.options else None)


def texts(split, text: str) -> list[str]:
    return [text[s:e] for s, e in split(text)]


# --------------------------------------------------------------------------- splitters
def test_builtins_are_registered_with_descriptions():
    found = registry().components("step_splitter")
    assert [c.name for c in found] == ["newline", "blank-line", "regex"]
    assert all(c.description and c.plugin == "grpo_plugins.step_splitters" for c in found)


@pytest.mark.parametrize(
    "text, steps",
    [
        ("1 + 2 = 3\n3 + 4 = 7", ["1 + 2 = 3", "3 + 4 = 7"]),
        ("1 + 2 = 3\n3 + 4 = 7\n", ["1 + 2 = 3", "3 + 4 = 7"]),
        ("\n  a  \n\n\tb\r\n", ["a", "b"]),
        ("", []),
        (" \n \n", []),
    ],
)
def test_newline_gives_the_stripped_non_blank_lines(text, steps):
    assert texts(splitter("newline"), text) == steps


def test_blank_line_splits_paragraphs_only():
    text = "first line\nsecond line\n\n  \n\nnext paragraph\n"
    assert texts(splitter("blank-line"), text) == ["first line\nsecond line", "next paragraph"]


def test_regex_splits_on_the_separator_and_drops_it():
    split = splitter("regex", pattern=r"\s*Step \d+:\s*")
    assert texts(split, "Step 1: 2 + 2 = 4 Step 2: 4 * 3 = 12") == ["2 + 2 = 4", "4 * 3 = 12"]
    ignore_case = splitter("regex", pattern=r"\bthen\b", flags=["IGNORECASE"])
    assert texts(ignore_case, "a THEN b then c") == ["a", "b", "c"]


def test_regex_option_errors_say_what_is_valid():
    with pytest.raises(ValidationError, match="not a valid Python regular expression"):
        RegexOptions(pattern="(")
    with pytest.raises(ValidationError, match="IGNORECASE"):
        RegexOptions(pattern="x", flags=["DOTALL"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=" \tab1=+\n", max_size=8), max_size=6))
def test_newline_spans_are_ordered_and_match_str_split(lines):
    text = "\n".join(lines)
    spans = SeparatorSplitter(r"\n")(text)
    assert [text[s:e] for s, e in spans] == [line.strip() for line in text.split("\n") if line.strip()]
    assert all(s < e for s, e in spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_split_steps_gives_a_completion_without_steps_one_empty_step():
    layout = split_steps(
        splitter("newline"), "newline", ["a\nb", "  \n", [{"role": "assistant", "content": "x"}]]
    )
    assert layout.texts == [["a", "b"], [""], ["x"]]
    assert layout.spans[1] == [(3, 3)]
    assert layout.counts == [2, 1, 1]


@pytest.mark.parametrize("bad", [[(2, 1)], [(0, 99)], [(0, 2), (1, 3)], "nope", [(0.0, 1.0)]])
def test_a_splitter_returning_bad_spans_is_named(bad):
    with pytest.raises(RunError, match="step splitter 'mine' .*completion 0"):
        split_steps(lambda text: bad, "mine", ["abc"])


# --------------------------------------------------------------------------- tokenizers
def char_tokenizer():
    """One token per character; decoding concatenates."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list("0123456789+-=*. \nabcdefghijklmnopqrstuvwxyzé")
    vocab = {"[UNK]": 0, "[EOS]": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")


def wordpiece_tokenizer():
    """WordPiece: blanks are dropped, newlines are tokens, decoding joins words with spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[EOS]", "\n", "+", "-", "=", "*"] + [str(i) for i in range(10)]
    words += [f"##{i}" for i in range(10)]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
            pre_tokenizers.Punctuation("isolated"),
        ]
    )
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")


TOKENIZERS = {"byte-level-bpe": build_tokenizer, "char": char_tokenizer}
NEWLINE = SeparatorSplitter(r"\n", name="newline")


def ends_from_offsets(tokenizer, text: str, eos: bool) -> tuple[list[int], str, list[int]]:
    """The ids of ``text`` (plus EOS), the decoded text, and the expected step ends
    computed from the tokenizer's offsets: a step ends at the token before the one whose
    offsets hold the next step's first character; the last step at the last token."""
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids = list(enc.input_ids) + ([tokenizer.eos_token_id] if eos else [])
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded == text  # concatenative decoders: offsets index the decoded text
    starts = [s for s, _ in NEWLINE(text)][1:]
    holder = [next(i for i, (a, b) in enumerate(enc.offset_mapping) if a <= c < b) for c in starts]
    return ids, decoded, [h - 1 for h in holder] + [len(ids) - 1]


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("trailing_newline", [False, True])
@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize(
    "text", ["1 + 2 = 3\n3 + 4 = 7", "12 + 34 = 46\n\n46 - 5 = 41\n41 * 2 = 82", "café = 1\nok"]
)
def test_step_ends_match_the_tokenizers_offsets(kind, trailing_newline, eos, text):
    tokenizer = TOKENIZERS[kind]()
    text = text + ("\n" if trailing_newline else "")
    ids, decoded, expected = ends_from_offsets(tokenizer, text, eos)
    got = step_token_ends(tokenizer, ids, decoded, NEWLINE(decoded))
    assert got == expected
    assert got[-1] == len(ids) - 1  # the last step keeps the trailing newline and EOS


def test_step_ends_with_the_byte_level_bpe_by_hand():
    tokenizer = build_tokenizer()
    text = "1 + 2 = 3\n3 + 4 = 7\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    newline = pieces.index("Ċ")  # byte-level's newline
    assert step_token_ends(tokenizer, ids, text, NEWLINE(text)) == [newline, len(ids) - 1]


def test_step_ends_on_non_canonical_generated_ids():
    """A policy may sample '1','2' where the tokenizer would write '12': the mapping works
    on the ids generated, not on a re-tokenization of the text."""
    tokenizer = build_tokenizer()
    text = "12 + 34 = 46\n46 - 5 = 41"
    ids = [t for ch in text for t in tokenizer(ch, add_special_tokens=False).input_ids]
    assert ids != tokenizer(text, add_special_tokens=False).input_ids
    assert step_token_ends(tokenizer, ids, text, NEWLINE(text)) == [text.index("\n"), len(ids) - 1]


@pytest.mark.parametrize("trailing_newline", [False, True])
def test_step_ends_with_a_wordpiece_tokenizer_whose_decoder_adds_spaces(trailing_newline):
    tokenizer = wordpiece_tokenizer()
    text = "12 + 3 = 15\n15 + 4 = 19" + ("\n" if trailing_newline else "")
    ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded.startswith("12 + 3 = 15 \n 15 + 4 = 19")
    pieces = tokenizer.convert_ids_to_tokens(ids)
    # 1 ##2 + 3 = 1 ##5 \n | 1 ##5 + 4 = 1 ##9 [\n] [EOS]
    assert pieces.index("\n") == 7
    layout = NEWLINE(decoded)
    assert [decoded[s:e] for s, e in layout] == ["12 + 3 = 15", "15 + 4 = 19"]
    assert step_token_ends(tokenizer, ids, decoded, layout) == [7, len(ids) - 1]


def test_step_tensors_pad_to_the_longest_row_and_index_completion_tokens():
    tokenizer = char_tokenizer()
    texts_ = ["1+1=2\n2+2=4\n4+4=8", "7", ""]
    eos = tokenizer.eos_token_id
    rows = [tokenizer(t, add_special_tokens=False).input_ids + [eos] for t in texts_]
    width = max(map(len, rows)) + 2  # right padding beyond every row
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    layout = split_steps(NEWLINE, "newline", texts_)
    ends, step_mask = step_tensors(layout, tokenizer, ids, mask, texts_)
    assert ends.shape == step_mask.shape == (3, 3)
    assert ends.dtype == torch.long and step_mask.dtype == torch.bool
    assert ends[0].tolist() == [5, 11, 17] and step_mask[0].all()
    assert ends[1, 0] == 1 and step_mask[1].tolist() == [True, False, False]
    assert ends[2, 0] == 0 and step_mask[2].tolist() == [
        True,
        False,
        False,
    ]  # EOS only: one empty step
    assert (ends[step_mask] < mask.sum(dim=1).repeat_interleave(step_mask.sum(dim=1))).all()
