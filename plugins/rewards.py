"""Built-in reward functions: answer accuracy, format, overlong punishment, reward model.

Every component has TRL's signature ``reward(prompts, completions, **columns) ->
list[float | None]`` (see :data:`grpo_core.contracts.RewardFunction`): ``B`` prompts and
``B`` completions, each a string or, for conversational data, a list of chat messages
(a completion is then ``[{"role": "assistant", "content": text}]``); every other dataset
column arrives as a keyword list with one entry per completion, plus ``completion_ids``.
Unknown keyword arguments are accepted and ignored. ``None`` marks an unscorable
completion (the advantage estimator leaves it out of its group's statistics).
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from grpo_core import hookimpl
from grpo_core.contracts import completion_text
from grpo_core.errors import RunError
from grpo_core.options import Options

__all__ = [
    "completion_text",
    "AccuracyOptions",
    "AccuracyReward",
    "FormatOptions",
    "FormatReward",
    "OverlongOptions",
    "OverlongReward",
    "RewardModelOptions",
    "RewardModelReward",
    "resolve_device",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- helpers
def _column(reward: str, columns: dict[str, Any], name: str, size: int) -> list:
    """Keyword column ``name`` with ``size`` entries, or a RunError naming the reward."""
    if name not in columns:
        available = ", ".join(sorted(columns)) or "(none)"
        raise RunError(
            f"reward function '{reward}' needs the dataset column '{name}', which the batch "
            f"does not have; columns available: {available}"
        )
    values = list(columns[name])
    if len(values) != size:
        raise RunError(
            f"reward function '{reward}': column '{name}' has {len(values)} entries for "
            f"{size} completions"
        )
    return values


# --------------------------------------------------------------------------- accuracy
class AccuracyOptions(Options):
    """Options of the ``accuracy`` reward."""

    answer_column: str = Field(
        "answer",
        min_length=1,
        description="Dataset column holding the gold answer of each prompt (a string or a "
        "number, e.g. '91' or '\\frac{1}{2}'); any non-empty column name.",
    )
    timeout: int = Field(
        5,
        ge=0,
        description="Seconds math-verify may spend parsing or comparing one answer (an "
        "integer >= 0). math-verify enforces it with SIGALRM, which only works on the main "
        "thread: 0 turns it off, and off the main thread it is always off.",
    )


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class AccuracyReward:
    """Final-answer correctness checked with math-verify: 1.0 right, 0.0 wrong.

    The completion's answer is extracted by ``math_verify.parse`` (``\\boxed{}``, "the
    answer is X", LaTeX, else the last expression of the text) and compared with the gold
    answer by ``math_verify.verify`` (numeric and symbolic equality). When math-verify
    extracts nothing (it rejects, e.g., a bare parenthesised ``(19)``), or extracts an
    unevaluated expression while the gold is a plain number (the question restated, such
    as ``87 + 86 = ?``), the last number in the text is tried instead. A completion with no
    answer at all scores 0.0.

    Returns ``None`` (unscorable) when the *gold* answer itself cannot be parsed: that
    row says nothing about the policy, so it is left out of its group's statistics.
    """

    def __init__(self, options: AccuracyOptions | None = None):
        self.options = options or AccuracyOptions()
        self.__name__ = "accuracy"

    def __repr__(self) -> str:
        return f"accuracy(answer_column={self.options.answer_column!r})"

    @property
    def required_columns(self) -> list[str]:
        """Dataset columns this reward reads; the engine checks them before training."""
        return [self.options.answer_column]

    def _timeout(self) -> int | None:
        if self.options.timeout <= 0:
            return None
        if threading.current_thread() is not threading.main_thread():
            return None  # signal.alarm raises ValueError off the main thread
        return self.options.timeout

    def _parse(self, text: str) -> list:
        from math_verify import parse

        return parse(text, parsing_timeout=self._timeout())

    def _predicted(self, text: str, numeric_gold: bool) -> list:
        """The completion's answer. Against a plain-number gold the answer must itself be
        a number: math-verify would otherwise evaluate a restated problem ("87 + 86 = ?"
        parses as 87 + 86) and pay a policy for copying the question, which GRPO learns
        within a few dozen steps. Such text falls back to its last number."""
        parsed = self._parse(text)
        if parsed and (not numeric_gold or _NUMBER.fullmatch(str(parsed[-1]).strip())):
            return parsed
        numbers = _NUMBER.findall(text)
        return self._parse(numbers[-1].replace(",", "")) if numbers else []

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float | None]:
        from math_verify import verify

        golds = _column(self.__name__, columns, self.options.answer_column, len(completions))
        parsed_golds: dict[str, list] = {}  # a prompt's gold repeats G times: parse it once
        rewards: list[float | None] = []
        for completion, gold in zip(completions, golds):
            gold_text = "" if gold is None else str(gold).strip()
            if gold_text not in parsed_golds:
                parsed_golds[gold_text] = self._parse(gold_text) if gold_text else []
            gold_parsed = parsed_golds[gold_text]
            if not gold_parsed:
                rewards.append(None)
                continue
            predicted = self._predicted(completion_text(completion), bool(_NUMBER.fullmatch(gold_text)))
            if not predicted:
                rewards.append(0.0)
                continue
            ok = verify(gold_parsed, predicted, timeout_seconds=self._timeout())
            rewards.append(1.0 if ok else 0.0)
        return rewards


# --------------------------------------------------------------------------- format
_FLAGS = {
    "DOTALL": re.DOTALL,
    "IGNORECASE": re.IGNORECASE,
    "MULTILINE": re.MULTILINE,
    "ASCII": re.ASCII,
    "VERBOSE": re.VERBOSE,
}
FlagName = Literal["DOTALL", "IGNORECASE", "MULTILINE", "ASCII", "VERBOSE"]


class FormatOptions(Options):
    """Options of the ``format`` reward."""

    pattern: str = Field(
        description="Python regular expression (``re`` syntax) the completion text must "
        "match, e.g. '<think>.*</think>\\s*<answer>.*</answer>'."
    )
    mode: Literal["search", "fullmatch"] = Field(
        "search",
        description="'search': the pattern may match anywhere in the completion; "
        "'fullmatch': it must match the whole completion.",
    )
    flags: tuple[FlagName, ...] = Field(
        ("DOTALL",),
        description="re flags, any of DOTALL, IGNORECASE, MULTILINE, ASCII, VERBOSE; "
        "DOTALL (the default) lets '.' cross newlines.",
    )

    @model_validator(mode="after")
    def _compiles(self) -> FormatOptions:
        try:
            self.compile()
        except re.error as exc:
            raise ValueError(
                f"pattern {self.pattern!r} is not a valid Python regular expression: {exc}"
            ) from None
        return self

    def compile(self) -> re.Pattern[str]:
        value = 0
        for name in self.flags:
            value |= _FLAGS[name]
        return re.compile(self.pattern, value)


class FormatReward:
    """1.0 when the completion text matches a regular expression, else 0.0."""

    def __init__(self, options: FormatOptions):
        self.options = options
        self.__name__ = "format"
        regex = options.compile()
        self._match = regex.fullmatch if options.mode == "fullmatch" else regex.search

    def __repr__(self) -> str:
        return f"format(pattern={self.options.pattern!r}, mode={self.options.mode!r})"

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        return [1.0 if self._match(completion_text(c)) else 0.0 for c in completions]


# --------------------------------------------------------------------------- overlong
class OverlongOptions(Options):
    """Options of the ``overlong`` reward."""

    max_length: int = Field(
        ge=1,
        description="L_max: the completion length (in tokens) that gets the full -1 "
        "punishment; normally the rollout's max_new_tokens. An integer >= 1.",
    )
    buffer: int | None = Field(
        None,
        ge=1,
        description="L_cache: length of the soft-punishment interval just below max_length, "
        "in tokens; an integer in 1..max_length. Unset: max_length // 5 (at least 1), "
        "DAPO's ratio (a 4,096-token buffer for 20,480 tokens).",
    )

    @model_validator(mode="after")
    def _buffer_fits(self) -> OverlongOptions:
        if self.buffer is not None and self.buffer > self.max_length:
            raise ValueError(
                f"buffer ({self.buffer}) must be at most max_length ({self.max_length}): "
                "the soft-punishment interval lies inside 0..max_length"
            )
        return self

    @property
    def effective_buffer(self) -> int:
        return self.buffer if self.buffer is not None else max(1, self.max_length // 5)


def overlong_punishment(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13).

    With ``L_max = max_length`` and ``L_cache = buffer``: 0 when ``|o| <= L_max - L_cache``;
    ``((L_max - L_cache) - |o|) / L_cache`` (from 0 down to -1) when
    ``L_max - L_cache < |o| <= L_max``; -1 beyond ``L_max``.
    """
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer
    return -1.0


class OverlongReward:
    """DAPO's soft overlong punishment on the completion's token count (0 to -1)."""

    def __init__(self, options: OverlongOptions):
        self.options = options
        self.max_length = options.max_length
        self.buffer = options.effective_buffer
        self.__name__ = "overlong"

    def __repr__(self) -> str:
        return f"overlong(max_length={self.max_length}, buffer={self.buffer})"

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        ids = _column(self.__name__, columns, "completion_ids", len(completions))
        return [overlong_punishment(len(row), self.max_length, self.buffer) for row in ids]


# --------------------------------------------------------------------------- reward model
class RewardModelOptions(Options):
    """Options of the ``reward_model`` reward."""

    path: str = Field(
        min_length=1,
        description="A transformers sequence-classification model and its tokenizer: a local "
        "directory (save_pretrained format; relative to the spec's folder) or a Hugging Face Hub "
        "id, resolved as transformers does (the local HF cache first; HF_HUB_OFFLINE=1 never "
        "downloads).",
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit) of a Hub id; unset: the default branch."
    )
    batch_size: int = Field(
        8, ge=1, description="Completions scored per forward pass; an integer >= 1."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "float32",
        description="Weights' dtype: float32, bfloat16, float16, or auto (the checkpoint's).",
    )
    max_length: int | None = Field(
        2048,
        ge=1,
        description="Longest input in tokens (an integer >= 1, or null for no limit); longer "
        "inputs lose their *start*, so the end of the completion, where the "
        "classification head reads, is kept.",
    )
    device: str = Field(
        "auto",
        min_length=1,
        description="torch device for the reward model ('cpu', 'cuda', 'cuda:1', ...); "
        "'auto' is cuda:LOCAL_RANK when CUDA is available, else cpu.",
    )
    trust_remote_code: bool = Field(
        False,
        description="Run modelling code shipped with the checkpoint; off unless you trust it.",
    )
    add_special_tokens: bool | None = Field(
        None,
        description="Whether the tokenizer adds its special tokens (BOS, ...) to the input. null (default): "
        "to plain prompt + completion text, not to chat-templated text (the template writes them); false: "
        "never, as TRL's GRPOTrainer scores with a reward model; true: always.",
    )

    @field_validator("path")
    @classmethod
    def _local_or_hub(cls, value: str, info: ValidationInfo) -> str:
        """A folder relative to the spec file resolves against it; a Hub id (which looks
        like a relative path too) is left alone."""
        return local_or_hub_id(value, (info.context or {}).get("base_dir"))


def local_or_hub_id(value: str, base_dir: Any) -> str:
    """``value`` as an absolute folder when it names an existing one (relative ones against
    ``base_dir``), else unchanged: a Hub id, or a path that does not exist."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    if base_dir is not None and (Path(base_dir) / path).exists():
        return str(Path(base_dir) / path)
    return value


def _is_path_like(value: str) -> bool:
    return value.startswith((".", "/", "~")) or Path(value).is_absolute() or Path(value).exists()


class RewardModelReward:
    """Scores from a sequence-classification reward model: its first logit per completion.

    The model input is the prompt followed by the completion: the tokenizer's chat
    template applied to ``prompt + completion`` messages when the data is conversational
    and the tokenizer has a template (the template supplies any BOS token), else the two
    texts concatenated and tokenized with the tokenizer's special tokens (``add_special_tokens``
    decides otherwise). The model and tokenizer load on the first call (``local_files_only``).
    """

    def __init__(self, options: RewardModelOptions):
        self.options = options
        self.__name__ = "reward_model"
        self._model = None
        self._tokenizer = None
        self._device = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"reward_model(path={str(self.options.path)!r})"

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        opts = self.options
        path = str(opts.path)
        dtype = "auto" if opts.dtype == "auto" else getattr(torch, opts.dtype)
        local = _is_path_like(path)
        # A folder is read as it is; a Hub id goes through transformers' resolution
        # (the HF cache, then the Hub unless HF_HUB_OFFLINE=1).
        where = {"local_files_only": True} if local else {"revision": opts.revision}
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=opts.trust_remote_code, **where)
            model = AutoModelForSequenceClassification.from_pretrained(
                path, trust_remote_code=opts.trust_remote_code, dtype=dtype, **where
            )
        except (OSError, ValueError) as exc:
            hint = "" if local else (
                " (a Hub id: it must be in the local HF cache, or the Hub reachable with HF_HUB_OFFLINE unset)"
            )
            raise RunError(
                f"reward function 'reward_model' could not load a sequence-classification "
                f"model from {path!r}{hint}: {exc}"
            ) from exc
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:  # needed to find each row's last token
            model.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"
        self._device = torch.device(resolve_device(opts.device))
        self._model = model.to(self._device).eval()
        self._tokenizer = tokenizer

    def templated(self, prompts: list) -> bool:
        """Whether the chat template builds the inputs (conversational prompts + template)."""
        conversational = bool(prompts) and isinstance(prompts[0], list)
        return conversational and bool(getattr(self._tokenizer, "chat_template", None))

    def text(self, prompt: Any, completion: Any, templated: bool) -> str:
        """The string the reward model reads for one (prompt, completion) pair."""
        if templated:
            if isinstance(completion, list):
                reply = list(completion)
            else:
                reply = [{"role": "assistant", "content": completion_text(completion)}]
            return self._tokenizer.apply_chat_template(list(prompt) + reply, tokenize=False)
        return completion_text(prompt) + completion_text(completion)

    def encode(self, texts: list[str], templated: bool) -> Any:
        """The model's inputs for ``texts`` (padded, truncated to ``max_length``; special
        tokens added unless a chat template already put them in, or as ``add_special_tokens``
        says)."""
        limit, special = self.options.max_length, self.options.add_special_tokens
        return self._tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=limit is not None,
            max_length=limit,
            add_special_tokens=(not templated) if special is None else special,
        ).to(self._device)

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        import torch

        with self._lock:
            if self._model is None:
                self._load()
        templated = self.templated(prompts)
        texts = [self.text(p, c, templated) for p, c in zip(prompts, completions)]
        size = self.options.batch_size
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), size):
                batch = self.encode(texts[start : start + size], templated)
                logits = self._model(**batch).logits
                scores.extend(float(x) for x in logits[:, 0].float().cpu())
        return scores


def resolve_device(device: str) -> str:
    """``device``, or for ``"auto"`` this process's GPU (``LOCAL_RANK``) when there is one, else the CPU."""
    if device != "auto":
        return device
    import os

    import torch

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


# --------------------------------------------------------------------------- registration
@hookimpl
def register_reward_functions(register) -> None:
    register.add("accuracy", AccuracyReward, options=AccuracyOptions)
    register.add("format", FormatReward, options=FormatOptions)
    register.add("overlong", OverlongReward, options=OverlongOptions)
    register.add("reward_model", RewardModelReward, options=RewardModelOptions)
