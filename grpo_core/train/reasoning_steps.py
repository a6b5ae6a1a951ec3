"""Process supervision: completions cut into steps, and every step's end mapped to the
index of the completion token it ends at.

The step splitter (a plugin) cuts the completion *text* that reward functions see. The
token index of a character is found on the token ids the policy actually generated,
decoded incrementally: token ``k`` holds character ``c`` when ``decode(ids[:k+1])``
covers ``c`` and ``decode(ids[:k])`` does not. Re-tokenizing the text would be wrong
whenever the sampled ids are not the tokenizer's canonical encoding of their text (a
byte-level BPE happily samples ``"1", "2"`` for ``"12"``), and offsets of tokenizers that
drop or add characters when decoding (WordPiece's spaces, SentencePiece's leading space)
would not line up with the decoded text at all.

Which token a step ends at: step ``j`` ends at the token just before the one holding the
first character of step ``j+1``, so the delimiter after a step (its newline) belongs to it
(and a token that straddles the delimiter and the next step's text belongs to the next
step); the last step ends at the completion's last token, so a trailing newline and the
EOS token belong to it and every completion token gets an advantage (DeepSeekMath's process
supervision, ``A_t = sum_{index_j >= t} rhat_j``). Counting the step's start this way also handles
decoders that add characters between tokens (WordPiece joins tokens with spaces).

Shape vocabulary: ``B`` rows, ``T`` completion tokens, ``K`` steps per completion (padded).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_core.contracts import completion_text
from grpo_core.errors import RunError


@dataclass
class StepLayout:
    """Steps of ``B`` completions.

    Attributes:
        spans: per completion, the ``(start, end)`` character span of each step's text.
            A completion with no step text has one empty step at its end.
        texts: per completion, the steps' texts (what reward functions get as ``steps``).
    """

    spans: list[list[tuple[int, int]]]
    texts: list[list[str]]

    @property
    def counts(self) -> list[int]:
        return [len(s) for s in self.spans]


def _check_spans(spans: Any, text: str, name: str, index: int) -> list[tuple[int, int]]:
    problem = None
    out: list[tuple[int, int]] = []
    if not isinstance(spans, (list, tuple)):
        problem = f"returned {type(spans).__name__}, expected a list of (start, end) pairs"
    else:
        previous = 0
        for span in spans:
            ok = isinstance(span, (list, tuple)) and len(span) == 2 and all(isinstance(v, int) for v in span)
            if not ok or not previous <= span[0] < span[1] <= len(text):
                problem = (f"returned span {span!r}; spans must be (start, end) integer pairs with "
                           f"{previous} <= start < end <= {len(text)}, in order, not overlapping")
                break
            out.append((int(span[0]), int(span[1])))
            previous = span[1]
    if problem:
        raise RunError(f"step splitter '{name}' {problem} (completion {index}: {text[:60]!r})")
    return out


def split_steps(splitter: Callable[[str], Any], name: str, completions: list[Any]) -> StepLayout:
    """Cut every completion into steps with ``splitter``; see :class:`StepLayout`."""
    spans, texts = [], []
    for index, completion in enumerate(completions):
        text = completion_text(completion)
        found = _check_spans(splitter(text), text, name, index) or [(len(text), len(text))]
        spans.append(found)
        texts.append([text[s:e] for s, e in found])
    return StepLayout(spans, texts)


class _Coverage:
    """How many characters of ``text`` the first ``k + 1`` generated tokens decode to."""

    def __init__(self, tokenizer: Any, ids: list[int], text: str):
        self.tokenizer, self.ids, self.text = tokenizer, ids, text
        self._memo: dict[int, int] = {}

    def __call__(self, k: int) -> int:
        if k not in self._memo:
            decoded = self.tokenizer.decode(self.ids[: k + 1], skip_special_tokens=True)
            # A prefix may end inside a multi-byte character ("\ufffd"): it covers only
            # the characters it agrees with the text on.
            self._memo[k] = len(os.path.commonprefix([decoded, self.text]))
        return self._memo[k]

    def first_token_covering(self, chars: int) -> int:
        """The smallest ``k`` whose prefix ``ids[:k+1]`` covers ``chars`` characters
        (the last token when none does), by bisection: coverage grows with ``k``."""
        lo, hi = 0, len(self.ids) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self(mid) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo


def step_token_ends(tokenizer: Any, ids: list[int], text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Token index (into ``ids``) at which each step of ``text`` ends; see the module doc.

    Args:
        tokenizer: decodes ``ids`` as the rollout did (``skip_special_tokens=True``).
        ids: the completion's generated token ids (padding excluded), at least one.
        text: the completion text the steps were cut from (a prefix of the decoded ids).
        spans: the steps' character spans, from :func:`split_steps`.
    """
    if not ids:
        raise RunError("a completion with no token cannot be cut into steps")
    coverage = _Coverage(tokenizer, ids, text)
    # the token holding the next step's first character covers start + 1 characters
    ends = [max(0, coverage.first_token_covering(nxt[0] + 1) - 1) for nxt in spans[1:]]
    ends.append(len(ids) - 1)
    for j in range(1, len(ends)):  # steps never end before the one before them
        ends[j] = max(ends[j], ends[j - 1])
    return ends


def step_tensors(
    layout: StepLayout, tokenizer: Any, completion_ids: Tensor, completion_mask: Tensor, texts: list[str]
) -> tuple[Tensor, Tensor]:
    """``step_ends long (B, K)`` and ``step_mask bool (B, K)`` for the advantage estimator.

    ``completion_ids``/``completion_mask`` are the rollout's ``(B, T)`` tensors; ``texts``
    the ``B`` completion texts ``layout`` was cut from.
    """
    rows, k = len(layout.spans), max(layout.counts, default=0)
    ends = torch.zeros((rows, k), dtype=torch.long)
    mask = torch.zeros((rows, k), dtype=torch.bool)
    for i, spans in enumerate(layout.spans):
        ids = completion_ids[i][completion_mask[i].bool()].tolist()
        if not ids:
            continue
        row = step_token_ends(tokenizer, ids, completion_text(texts[i]), spans)
        ends[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = True
    return ends.to(completion_ids.device), mask.to(completion_ids.device)
