"""Built-in process (per-step) rewards: ``arithmetic-steps`` and ``process_reward_model``.

A process reward has TRL's signature plus a ``steps`` parameter: ``reward(prompts,
completions, steps, **columns)``, where ``steps[i]`` is the list of step texts of
completion ``i`` (cut by the spec's ``algorithm.step_splitter``). It returns, for each
completion, one score (or None) per step. With the ``process`` advantage estimator the
scores become per-token advantages (DeepSeekMath's process supervision); with an outcome
estimator a completion's score is the mean of its step scores.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Literal

from grpo_plugins.rewards.common import resolve_device
from pydantic import Field, model_validator

from grpo_core import hookimpl
from grpo_core.contracts import completion_text
from grpo_core.errors import RunError
from grpo_core.options import Options
from grpo_core.spec import SpecPath

__all__ = [
    "parse_step",
    "check_step",
    "ArithmeticStepsOptions",
    "ArithmeticStepsReward",
    "ProcessRewardModelOptions",
    "ProcessRewardModel",
]


# --------------------------------------------------------------------------- arithmetic
# ``a op b`` at the end of the text before the first '=', not preceded by a number or an
# operator (so "1 + 2 + 3" is not read as "2 + 3"); ``c``: the integer right after it.
_LEFT = re.compile(r"(?:^|[^\d.+\-*×=\s])\s*(-?\d+)\s*([-+*×])\s*(-?\d+)\s*$")
_RIGHT = re.compile(r"\s*(-?\d+)(?!\.?\d)")


def parse_step(text: str) -> tuple[int, str, int, int] | None:
    """``(a, op, b, c)`` of the step's equation ``a op b = c`` (integers, ``op`` one of
    ``+ - * ×``), or None when the step has none.

    The equation is the first ``=`` of the step, with ``a op b`` just before it and the
    integer ``c`` just after it; words around it are allowed ("Step 2: 46 - 5 = 41, so"),
    a longer expression before the ``=`` ("1 + 2 + 3 = 6") or decimals are not the form.
    """
    left, equals, right = text.partition("=")
    lhs, rhs = _LEFT.search(left), _RIGHT.match(right)
    if not equals or lhs is None or rhs is None:
        return None
    return int(lhs[1]), lhs[2], int(lhs[3]), int(rhs[1])


def check_step(text: str) -> bool | None:
    """Whether the step's equation ``a op b = c`` is right; None when it has none."""
    parsed = parse_step(text)
    if parsed is None:
        return None
    a, op, b, c = parsed
    return (a + b if op == "+" else a - b if op == "-" else a * b) == c


_NUMBER = re.compile(r"\d+")
_TERMS = re.compile(r"^\s*(\d+)((?:\s*[-+*×]\s*\d+)+)\s*$")
_OP_TERM = re.compile(r"\s*([-+*×])\s*(\d+)")


def _left_to_right(question: str) -> list[tuple[int, str, int, int]] | None:
    """The steps ``(a, op, b, c)`` of ``question`` ('20 + 5 - 6') evaluated left to right,
    or None when it is not such a chain of non-negative integers and operators."""
    match = _TERMS.match(question)
    if match is None:
        return None
    value, steps = int(match[1]), []
    for op, term in _OP_TERM.findall(match[2]):
        op, b = ("*" if op == "×" else op), int(term)
        result = value + b if op == "+" else value - b if op == "-" else value * b
        steps.append((value, op, b, result))
        value = result
    return steps


class ArithmeticStepsOptions(Options):
    """Options of the ``arithmetic-steps`` process reward.

    ``wrong`` matters only beside other rewards: step scores are normalized per group, so
    an affine change of all of them leaves the process advantages unchanged. With
    ``order: left-to-right``, step ``j`` must be the ``j``-th operation of the problem
    evaluated left to right (the previous result, or the first term, then the next
    operator and term): a right step that skips the rest does not pass for a solution,
    steps past the last operation are wrong, and so is the last step of a completion
    that stops early (otherwise stopping after one right step pays more than going on).
    """

    correct: float = Field(1.0, description="Score of a right step `a op b = c`.")
    wrong: float = Field(
        0.0,
        description="Score of a wrong step `a op b = c`: 0 (default) or e.g. -1; lower than correct.",
    )
    unparsed: float | None = Field(
        0.0,
        description="Score of a step that is not an equation `a op b = c` (prose, an empty "
        "completion's single empty step); null leaves such steps unscored.",
    )
    question_column: str | None = Field(
        "question",
        description="Dataset column holding the problem ('47 - 92 + 93'): a step is right only if its "
        "operands come from the problem or earlier right steps. null checks the arithmetic alone.",
    )

    order: Literal["left-to-right", "any"] = Field(
        "left-to-right",
        description="With question_column: left-to-right (default) wants step j to be the problem's "
        "j-th operation, evaluated left to right; any accepts any right step on the problem's numbers.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ArithmeticStepsOptions:
        if not self.wrong < self.correct:
            raise ValueError(f"wrong ({self.wrong}) must be lower than correct ({self.correct})")
        return self


class ArithmeticStepsReward:
    """Verifiable process reward: each step `a op b = c` scores `correct` (1) when it is
    right (and, by default, works on the problem's numbers), `wrong` (0, or -1) when not;
    a step without such an equation scores `unparsed`."""

    def __init__(self, options: ArithmeticStepsOptions | None = None):
        self.options = options or ArithmeticStepsOptions()
        self.__name__ = "arithmetic-steps"

    def __repr__(self) -> str:
        o = self.options
        return (
            f"arithmetic-steps(correct={o.correct}, wrong={o.wrong}, unparsed={o.unparsed}, "
            f"question_column={o.question_column!r})"
        )

    @property
    def required_columns(self) -> list[str]:
        """Dataset columns this reward reads; the engine checks them before training."""
        column = self.options.question_column
        return [column] if column else []

    def score_steps(self, steps: list[str], question: Any = None) -> list[float | None]:
        """Scores of one completion's steps; ``question`` grounds the operands (None: not)."""
        o = self.options
        if question is not None and o.order == "left-to-right":
            expected = _left_to_right(str(question))
            if expected is not None:
                return self._score_in_order(steps, expected)
        known = None if question is None else {int(n) for n in _NUMBER.findall(str(question))}
        out: list[float | None] = []
        for step in steps:
            parsed, ok = parse_step(step), check_step(step)
            if parsed is None:
                out.append(o.unparsed)
                continue
            a, _, b, c = parsed
            if known is not None:
                ok = ok and abs(a) in known and abs(b) in known
                if ok:
                    known.add(abs(c))
            out.append(o.correct if ok else o.wrong)
        return out

    def _score_in_order(self, steps: list[str], expected: list[tuple[int, str, int, int]]) -> list[float | None]:
        o = self.options
        out: list[float | None] = []
        done = 0  # right steps so far, in order
        for step in steps:
            parsed = parse_step(step)
            if parsed is None:
                out.append(o.unparsed)
                continue
            a, op, b, c = parsed
            op = "*" if op == "×" else op
            ok = done < len(expected) and (a, op, b, c) == expected[done]
            done += ok
            out.append(o.correct if ok else o.wrong)
        if done < len(expected):  # stopped short of the answer: the last step did not end it
            last = max((i for i, score in enumerate(out) if score is not None), default=None)
            if last is not None:
                out[last] = o.wrong
        return out

    def __call__(
        self, prompts: list, completions: list, steps: list[list[str]], **columns: Any
    ) -> list[list[float | None]]:
        column = self.options.question_column
        if column is None:
            return [self.score_steps(row) for row in steps]
        if column not in columns:
            available = ", ".join(sorted(columns)) or "(none)"
            raise RunError(
                f"reward function 'arithmetic-steps' needs the dataset column '{column}' "
                f"(question_column; null checks the arithmetic alone); columns available: {available}"
            )
        return [self.score_steps(row, q) for row, q in zip(steps, columns[column])]


# --------------------------------------------------------------------------- reward model
class ProcessRewardModelOptions(Options):
    """Options of the ``process_reward_model`` reward."""

    path: SpecPath = Field(
        description="Local directory of a transformers token-classification model (a trained "
        "PRM) and its fast tokenizer, save_pretrained format; nothing is downloaded.",
    )
    positive_label: int = Field(
        1,
        ge=0,
        description="Index of the 'step is good' class; a one-label model is read with a sigmoid.",
    )
    step_separator: str | None = Field(
        None,
        description="For step-tag PRMs (Math-Shepherd's ' ки\\n', Qwen's '<extra_0>'): appended to every "
        "step, each scored at its last token. Unset: the completion as generated, scored at step ends.",
    )
    batch_size: int = Field(8, ge=1, description="Completions per forward pass.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "float32", description="Weights' dtype, or auto (the checkpoint's)."
    )
    max_length: int | None = Field(
        2048,
        ge=1,
        description="Longest input in tokens; longer inputs lose their start, and the "
        "steps cut off with it are scored None. null: no limit.",
    )
    device: str = Field(
        "auto",
        min_length=1,
        description="torch device; auto: cuda:LOCAL_RANK if available, else cpu.",
    )
    trust_remote_code: bool = Field(
        False, description="Run modelling code shipped with the checkpoint."
    )


def _token_at(offsets: list[tuple[int, int]], char: int) -> int | None:
    """The token holding ``char`` (or the last one before it, for a character the tokenizer
    drops); None when ``char`` lies before the first token kept (truncated away)."""
    starts = [(index, s) for index, (s, e) in enumerate(offsets) if e > s]  # special tokens: (0, 0)
    if not starts or char < starts[0][1]:
        return None
    return max(index for index, s in starts if s <= char)


class ProcessRewardModel:
    """Step scores from a token-classification PRM: the positive class's probability at
    each step's last token (or at the step separator's last token)."""

    def __init__(self, options: ProcessRewardModelOptions):
        self.options = options
        self.__name__ = "process_reward_model"
        self._model = self._tokenizer = self._device = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"process_reward_model(path={str(self.options.path)!r})"

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        o, path = self.options, str(self.options.path)
        dtype = "auto" if o.dtype == "auto" else getattr(torch, o.dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=o.trust_remote_code
            )
            model = AutoModelForTokenClassification.from_pretrained(
                path, local_files_only=True, trust_remote_code=o.trust_remote_code, dtype=dtype
            )
        except (OSError, ValueError) as exc:
            raise RunError(
                "reward function 'process_reward_model' could not load a token-classification model "
                f"from {path!r}: {exc}"
            ) from exc
        if not tokenizer.is_fast:
            raise RunError(
                f"reward function 'process_reward_model': the tokenizer in {path!r} is not a fast "
                "tokenizer; character offsets are needed"
            )
        if o.positive_label >= max(2, model.config.num_labels):
            raise RunError(
                f"reward function 'process_reward_model': positive_label {o.positive_label} but the "
                f"model has {model.config.num_labels} labels"
            )
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
        self._device = torch.device(resolve_device(o.device))
        self._model, self._tokenizer = model.to(self._device).eval(), tokenizer

    def layout(self, prompt: Any, completion: Any, steps: list[str]) -> tuple[str, list[int], bool]:
        """The input text, the character at which each step is scored, and whether the
        chat template built it (then the tokenizer adds no special tokens)."""
        sep = self.options.step_separator
        body = completion_text(completion) if sep is None else "".join(s + sep for s in steps)
        templated = isinstance(prompt, list) and bool(
            getattr(self._tokenizer, "chat_template", None)
        )
        if templated:
            text = self._tokenizer.apply_chat_template(
                list(prompt) + [{"role": "assistant", "content": body}], tokenize=False
            )
            offset = text.rfind(body) if body else len(text)
        else:
            prefix = completion_text(prompt)
            text, offset = prefix + body, len(prefix)
        chars, cursor = [], 0
        for step in steps:
            if sep is not None:
                cursor += len(step) + len(sep)
                chars.append(offset + cursor - 1)
                continue
            found = body.find(step, cursor) if step else -1
            cursor = found + len(step) if found >= 0 else len(body)
            chars.append(offset + max(cursor, 1) - 1)
        return text, chars, templated

    def _probabilities(self, logits):
        import torch

        if logits.shape[-1] == 1:
            return torch.sigmoid(logits[..., 0].float())
        return torch.softmax(logits.float(), dim=-1)[..., self.options.positive_label]

    def __call__(
        self, prompts: list, completions: list, steps: list[list[str]], **columns: Any
    ) -> list[list[float | None]]:
        import torch

        with self._lock:
            if self._model is None:
                self._load()
        layouts = [self.layout(p, c, s) for p, c, s in zip(prompts, completions, steps)]
        out: list[list[float | None]] = []
        size, limit = self.options.batch_size, self.options.max_length
        with torch.inference_mode():
            for start in range(0, len(layouts), size):
                chunk = layouts[start : start + size]
                batch = self._tokenizer(
                    [text for text, _, _ in chunk],
                    return_tensors="pt",
                    padding=True,
                    truncation=limit is not None,
                    max_length=limit,
                    add_special_tokens=not chunk[0][2],
                    return_offsets_mapping=True,
                )
                offsets = batch.pop("offset_mapping").tolist()
                probs = self._probabilities(self._model(**batch.to(self._device)).logits).cpu()
                for row, (_, chars, _) in enumerate(chunk):
                    tokens = [_token_at([tuple(o) for o in offsets[row]], c) for c in chars]
                    out.append([None if t is None else float(probs[row, t]) for t in tokens])
        return out


# --------------------------------------------------------------------------- registration
@hookimpl
def register_reward_functions(register) -> None:
    register.add("arithmetic-steps", ArithmeticStepsReward, options=ArithmeticStepsOptions)
    register.add("process_reward_model", ProcessRewardModel, options=ProcessRewardModelOptions)
