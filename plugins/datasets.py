"""Built-in datasets (tasks): synthetic arithmetic, local files, Hugging Face datasets.

A component is a :class:`grpo_core.contracts.Dataset`: ``load(split)`` for ``"train"``
or ``"eval"`` returns a list of plain Python dicts, each with a ``prompt`` (a string or a
list of chat messages ``{"role", "content"}``) plus any other columns; ``"eval"`` is
``[]`` when there is no held-out split; with ``streaming: true`` (``file``, ``hf``) the
training split is a :class:`grpo_core.contracts.RowStream` instead. Chat templates, system
prompts and column checks are the engine's job, and so is resolving relative paths: path
fields are ``SpecPath``, which the spec loader resolves against the spec file's folder.
"""

from __future__ import annotations

import codecs
import random
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from grpo_core import hookimpl
from grpo_core.contracts import RowStream
from grpo_core.errors import RunError
from grpo_core.options import Options
from grpo_core.spec import SpecPath

__all__ = [
    "ArithmeticOptions",
    "ArithmeticDataset",
    "MultiStepArithmeticOptions",
    "FileOptions",
    "FileDataset",
    "HFOptions",
    "HFDataset",
    "check_utf8",
]

SPLITS = ("train", "eval")


def _check_split(dataset: str, split: str) -> None:
    if split not in SPLITS:
        raise RunError(f"dataset '{dataset}': unknown split {split!r}; valid: train, eval")


# --------------------------------------------------------------------------- arithmetic
Operation = Literal["+", "-", "*"]
DEFAULT_INSTRUCTION = "What is {question}? Answer with just the number."
STEPS_INSTRUCTION = (
    "Compute {question} one operation at a time, left to right, one step per line. "
    "For example, 12 + 30 - 5 is:\n12 + 30 = 42\n42 - 5 = 37\nNow compute {question}:"
)


class ArithmeticOptions(Options):
    """Options of the ``arithmetic`` task."""

    seed: int = Field(0, description="Seed of the problem generator; same seed, same rows.")
    operations: tuple[Operation, ...] = Field(
        ("+",),
        min_length=1,
        description="Operators drawn between terms: a non-empty subset of '+', '-', '*'. "
        "'*' binds tighter than '+' and '-', as usual.",
    )
    min_value: int = Field(10, ge=0, description="Smallest term, an integer >= 0.")
    max_value: int = Field(99, ge=0, description="Largest term, an integer >= min_value.")
    num_terms: int = Field(2, ge=2, le=16, description="Terms per problem, 2..16.")
    train_size: int = Field(1000, ge=1, description="Training problems, an integer >= 1.")
    eval_size: int = Field(
        100,
        ge=0,
        description="Held-out problems (an integer >= 0), none of them identical to a "
        "training problem; 0 means no eval split.",
    )
    instruction: str = Field(
        DEFAULT_INSTRUCTION,
        description="Prompt template whose only placeholder '{question}' becomes the problem ('34 + 57'); "
        "write '{{' and '}}' for literal braces.",
    )
    chat: bool = Field(
        True,
        description="True: prompts are chat messages [{'role': 'user', 'content': ...}]; "
        "False: plain strings.",
    )
    solutions: bool = Field(
        False,
        description="Add a `solution` column: the worked solution, one operation per line in the order of "
        "evaluation ('*' first, then left to right: '12 + 30 = 42' ...), then the answer alone on the last line; "
        "demonstrations for an SFT stage (sft.completion_column: solution).",
    )

    @field_validator("operations")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(
                f"operations {list(value)} repeat an operator; list each of +, -, * once"
            )
        return value

    @field_validator("instruction")
    @classmethod
    def _template(cls, value: str) -> str:
        if "{question}" not in value:
            raise ValueError("instruction must contain the placeholder '{question}'")
        try:
            value.format(question="1 + 2")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"instruction {value!r} is not a valid template ({type(exc).__name__}: {exc}); "
                "'{question}' is the only placeholder, write '{{' and '}}' for literal braces"
            ) from None
        return value

    @model_validator(mode="after")
    def _enough_problems(self) -> ArithmeticOptions:
        if self.max_value < self.min_value:
            raise ValueError(
                f"max_value ({self.max_value}) must be >= min_value ({self.min_value})"
            )
        needed, available = self.train_size + self.eval_size, self.problem_count
        if needed > available:
            raise ValueError(
                f"train_size + eval_size = {needed} distinct problems, but these settings "
                f"allow only {available}: widen min_value..max_value, add operations or terms"
            )
        return self

    @property
    def problem_count(self) -> int:
        """How many distinct problems these settings can produce."""
        values = self.max_value - self.min_value + 1
        return values**self.num_terms * len(self.operations) ** (self.num_terms - 1)


class MultiStepArithmeticOptions(ArithmeticOptions):
    """Options of the ``arithmetic-steps`` task: ``arithmetic`` with three terms of + and
    - by default and a prompt that asks for one step `a op b = c` per line (for the
    ``arithmetic-steps`` process reward and the ``newline`` step splitter)."""

    operations: tuple[Operation, ...] = Field(
        ("+", "-"),
        min_length=1,
        description="Operators drawn between terms: a non-empty subset of '+', '-', '*' "
        "(default + and -, which left to right is also the order of evaluation).",
    )
    num_terms: int = Field(3, ge=2, le=16, description="Terms per problem, 2..16 (default 3: two steps).")
    instruction: str = Field(
        STEPS_INSTRUCTION,
        description="Prompt template; '{question}' is replaced by the problem. The default "
        "asks for one step 'a op b = c' per line and shows one worked example (SmolLM2-135M "
        "writes equations far more often with it).",
    )


def _evaluate(terms: list[int], ops: list[str]) -> int:
    """Value of ``terms[0] ops[0] terms[1] ...`` with '*' before '+' and '-'."""
    total, sign, product = 0, 1, terms[0]
    for op, term in zip(ops, terms[1:]):
        if op == "*":
            product *= term
        else:
            total += sign * product
            sign, product = (1 if op == "+" else -1), term
    return total + sign * product


def _worked(terms: list[int], ops: list[str]) -> str:
    """The worked solution of ``terms ops``: each '*' first, then '+' and '-' left to right,
    one ``a op b = c`` line per operation, then the answer on a line of its own."""
    terms, ops, lines = list(terms), list(ops), []
    for group in (("*",), ("+", "-")):
        i = 0
        while i < len(ops):
            if ops[i] not in group:
                i += 1
                continue
            a, b, op = terms[i], terms[i + 1], ops[i]
            value = a * b if op == "*" else a + b if op == "+" else a - b
            lines.append(f"{a} {op} {b} = {value}")
            terms[i:i + 2], ops[i:i + 1] = [value], []
    return "\n".join(lines + [str(terms[0])])


class ArithmeticDataset:
    """Synthetic arithmetic problems with exact integer answers (seeded, offline).

    Problems are distinct draws from every combination of terms and operators. The eval
    split is drawn first and the train split after it, without replacement, so the two
    never share a problem and the eval split does not change with ``train_size``.
    """

    def __init__(self, options: ArithmeticOptions | None = None):
        self.options = options or ArithmeticOptions()
        self._problems: list[tuple[list[int], list[str]]] | None = None

    def _decode(self, index: int) -> tuple[list[int], list[str]]:
        o = self.options
        radix = o.max_value - o.min_value + 1
        ops = []
        for _ in range(o.num_terms - 1):
            index, k = divmod(index, len(o.operations))
            ops.append(o.operations[k])
        terms = []
        for _ in range(o.num_terms):
            index, k = divmod(index, radix)
            terms.append(o.min_value + k)
        return terms, ops

    def problems(self) -> list[tuple[list[int], list[str]]]:
        """Eval problems then train problems: a prefix of a seeded random permutation
        of all problems (a partial Fisher-Yates shuffle over a sparse pool)."""
        if self._problems is None:
            o = self.options
            rng = random.Random(o.seed)
            count, swapped = o.problem_count, {}
            chosen = []
            for i in range(o.eval_size + o.train_size):
                j = i + rng.randrange(count - i)
                chosen.append(swapped.get(j, j))
                swapped[j] = swapped.get(i, i)
            self._problems = [self._decode(index) for index in chosen]
        return self._problems

    def row(self, terms: list[int], ops: list[str]) -> dict[str, Any]:
        parts = [str(terms[0])]
        for op, term in zip(ops, terms[1:]):
            parts += [op, str(term)]
        question = " ".join(parts)
        content = self.options.instruction.format(question=question)
        prompt: Any = [{"role": "user", "content": content}] if self.options.chat else content
        row = {"prompt": prompt, "answer": str(_evaluate(terms, ops)), "question": question}
        if self.options.solutions:
            row["solution"] = _worked(terms, ops)
        return row

    def load(self, split: str) -> list[dict[str, Any]]:
        _check_split("arithmetic", split)
        problems = self.problems()
        n_eval = self.options.eval_size
        chosen = problems[:n_eval] if split == "eval" else problems[n_eval:]
        return [self.row(terms, ops) for terms, ops in chosen]


# --------------------------------------------------------------------------- files
FileFormat = Literal["auto", "json", "jsonl", "csv", "parquet"]
_EXTENSIONS = {
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}


def _builder(path: str | Path, fmt: str) -> str:
    """The ``datasets`` builder for ``path``: ``json``, ``csv`` or ``parquet``."""
    if fmt != "auto":
        return "json" if fmt == "jsonl" else fmt
    suffix = Path(path).suffix.lower()
    if suffix not in _EXTENSIONS:
        known = ", ".join(_EXTENSIONS)
        raise ValueError(
            f"cannot tell the format of {path!r} from its extension {suffix or '(none)'!r}: "
            f"known extensions are {known}; or set format to json, jsonl, csv or parquet"
        )
    return _EXTENSIONS[suffix]


class FileOptions(Options):
    """Options of the ``file`` dataset."""

    train: SpecPath = Field(
        description="Path of the training file: JSON Lines (.jsonl/.json), CSV (.csv) or "
        "Parquet (.parquet); one row per prompt, with a prompt column.",
    )
    eval: SpecPath | None = Field(
        None, description="Path of the held-out file, same formats; unset: no eval split."
    )
    format: FileFormat = Field(
        "auto",
        description="auto (from each file's extension), json, jsonl (same as json), csv or "
        "parquet.",
    )
    streaming: bool = Field(
        False, description="Stream the training file instead of reading it into memory (datasets' "
        "streaming=True): rows read once per epoch, each process reading its share, through a shuffle buffer "
        "(data.shuffle_buffer); a resume continues from the exact row. The eval file is still read into memory. "
        "Not with data.sampler or data.more_sources."
    )

    @model_validator(mode="after")
    def _known_format(self) -> FileOptions:
        for path in (self.train, self.eval):
            if path is not None:
                _builder(path, self.format)
        return self


def check_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """A RunError naming the file and the first undecodable byte, if it is not UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 1
    with path.open("rb") as f:
        while True:
            data = f.read(chunk)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                # exc.start indexes the decoder's buffered bytes plus this chunk
                buffered = len(exc.object) - len(data)
                at = offset - buffered + exc.start
                line = lines + exc.object[: exc.start].count(b"\n")
                bad = exc.object[exc.start : exc.start + 1].hex()
                raise RunError(
                    f"dataset file {path} is not valid UTF-8: byte 0x{bad} at offset {at} "
                    f"(line {line}): {exc.reason}; re-encode it as UTF-8 "
                    f"(e.g. iconv -f latin1 -t utf-8)"
                ) from None
            if not data:
                return
            lines += data.count(b"\n")
            offset += len(data)


def _checked_file(path: Path, fmt: str) -> str:
    """The ``datasets`` builder of ``path``, once it is a non-empty file (UTF-8 for text)."""
    path_str = str(path)
    if not path.exists():
        raise RunError(f"dataset file {path_str} does not exist")
    if not path.is_file():
        raise RunError(f"dataset file {path_str} is not a file")
    builder = _builder(path, fmt)
    if path.stat().st_size == 0:
        raise RunError(f"dataset file {path_str} is empty: it has no rows (0 bytes)")
    if builder in ("json", "csv"):
        check_utf8(path)
    return builder


def _read_error(path: Path, builder: str, exc: Exception) -> RunError:
    detail = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        detail += f" (caused by {type(cause).__name__}: {cause})"
    return RunError(f"could not read dataset file {path} as {builder}: {detail}")


def _stream_file(path: Path, fmt: str) -> RowStream:
    """The file as a stream: ``datasets``' streaming reader, opened anew for each epoch (and on
    a resume), rows in the file's order; a row it cannot read names the file."""
    import datasets

    builder = _checked_file(path, fmt)
    try:
        iterable = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    except Exception as exc:
        raise _read_error(path, builder, exc) from exc

    def rows():
        try:
            yield from iterable
        except Exception as exc:
            raise _read_error(path, builder, exc) from exc

    return RowStream(rows, f"dataset file {path}")


def _read_file(path: Path, fmt: str) -> list[dict[str, Any]]:
    import datasets

    path_str = str(path)
    builder = _checked_file(path, fmt)
    empty = RunError(f"dataset file {path_str} is empty: it has no rows")
    try:
        with tempfile.TemporaryDirectory(prefix="grpo-data-") as cache:
            ds = datasets.load_dataset(
                builder, data_files=str(path), split="train", keep_in_memory=True, cache_dir=cache
            )
            rows = ds.to_list()
    except Exception as exc:
        if "corresponds to no data" in str(exc):  # datasets' words for zero rows (CSV header only)
            raise empty from None
        raise _read_error(path, builder, exc) from exc
    if not rows:
        raise empty
    return rows


class FileDataset:
    """Rows from local JSON Lines, CSV or Parquet files, read with ``datasets``."""

    def __init__(self, options: FileOptions):
        self.options = options

    def load(self, split: str) -> list[dict[str, Any]] | RowStream:
        _check_split("file", split)
        path = self.options.train if split == "train" else self.options.eval
        if path is None:
            return []
        if self.options.streaming and split == "train":
            return _stream_file(path, self.options.format)
        return _read_file(path, self.options.format)


# --------------------------------------------------------------------------- hub
class HFOptions(Options):
    """Options of the ``hf`` dataset (``path`` as in ``datasets.load_dataset(path, name)``;
    the spec's ``data.name`` is the plugin's name, ``hf``)."""

    path: str = Field(
        min_length=1,
        description="Hub dataset id (e.g. 'openai/gsm8k'), or a local directory written by "
        "Dataset.save_to_disk / DatasetDict.save_to_disk (the offline way).",
    )
    config: str | None = Field(
        None, description="Hub configuration (subset) name, e.g. 'main'; unset: the default."
    )
    train_split: str = Field("train", min_length=1, description="Split used for training.")
    eval_split: str | None = Field(
        None, description="Held-out split (e.g. 'test'); unset: no eval split."
    )
    revision: str | None = Field(
        None, description="Hub git revision (branch, tag or commit); unset: the default branch."
    )
    streaming: bool = Field(
        False, description="Stream the training split instead of loading it into memory (datasets' "
        "streaming=True; a saved local copy is read lazily from its files): rows read once per epoch, each "
        "process reading its share, through a shuffle buffer (data.shuffle_buffer); a resume continues from the "
        "exact row. The eval split is still read into memory. Not with data.sampler or data.more_sources."
    )

    @field_validator("path")
    @classmethod
    def _local_copy(cls, value: str, info: ValidationInfo) -> str:
        """A relative path to a saved dataset resolves against the spec's folder; a Hub
        id (which looks like a relative path too) is left alone."""
        base = (info.context or {}).get("base_dir")
        if base is not None and not Path(value).is_absolute():
            candidate = Path(base) / Path(value).expanduser()
            if _is_saved(candidate):
                return str(candidate)
        return value


def _is_saved(path: Path) -> bool:
    from datasets import config

    return path.is_dir() and (
        (path / config.DATASETDICT_JSON_FILENAME).is_file()
        or (path / config.DATASET_STATE_JSON_FILENAME).is_file()
    )


_NETWORK_ERRORS = {
    "OfflineModeIsEnabled",
    "LocalEntryNotFoundError",
    "ConnectError",
    "ConnectTimeout",
}


def _is_network_error(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        module = type(exc).__module__.split(".")[0]
        if type(exc).__name__ in _NETWORK_ERRORS or module in ("requests", "httpx", "urllib3"):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class HFDataset:
    """A Hugging Face dataset: from the Hub by name, or a local ``save_to_disk`` copy."""

    def __init__(self, options: HFOptions):
        self.options = options

    def _from_disk(self, split: str) -> list[dict[str, Any]]:
        import datasets

        name = self.options.path
        try:
            saved = datasets.load_from_disk(name, keep_in_memory=True)
        except Exception as exc:
            raise RunError(
                f"could not load the saved dataset in {name}: {type(exc).__name__}: {exc}"
            ) from exc
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                available = ", ".join(saved) or "(none)"
                raise RunError(
                    f"dataset '{name}' has no split {split!r}; available: {available}"
                )
            return saved[split].to_list()
        if split != self.options.train_split:
            raise RunError(
                f"dataset '{name}' is a single saved Dataset, used as the training split; "
                f"it has no split {split!r}: unset eval_split or save a DatasetDict"
            )
        return saved.to_list()

    def _from_hub(self, split: str) -> list[dict[str, Any]]:
        import datasets

        o = self.options
        where = f"'{o.path}'" + (f" (config '{o.config}')" if o.config else "")
        try:
            ds = datasets.load_dataset(
                o.path, o.config, split=split, revision=o.revision, keep_in_memory=True
            )
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            if _is_network_error(exc):
                raise RunError(
                    f"could not load dataset {where} split '{split}' from the Hugging Face "
                    f"Hub ({detail}): it needs the network, or a local copy: the Hub cache, "
                    "or a directory written by save_to_disk given as name"
                ) from exc
            raise RunError(f"could not load dataset {where} split '{split}': {detail}") from exc
        return ds.to_list()

    def _stream(self, split: str) -> RowStream:
        """The split as a stream: a saved copy read lazily from its Arrow files, or the Hub's
        streaming reader."""
        import datasets

        o = self.options
        if _is_saved(Path(o.path)):
            saved = datasets.load_from_disk(o.path)
            if isinstance(saved, datasets.DatasetDict):
                if split not in saved:
                    raise RunError(f"dataset '{o.path}' has no split {split!r}; available: {', '.join(saved)}")
                saved = saved[split]
            iterable = saved.to_iterable_dataset()
        else:
            try:
                iterable = datasets.load_dataset(o.path, o.config, split=split, revision=o.revision, streaming=True)
            except Exception as exc:
                raise RunError(f"could not stream dataset '{o.path}' split '{split}': "
                               f"{type(exc).__name__}: {exc}") from exc
        return RowStream(lambda: iter(iterable), f"dataset hf '{o.path}' split '{split}'")

    def load(self, split: str) -> list[dict[str, Any]] | RowStream:
        _check_split("hf", split)
        name = self.options.train_split if split == "train" else self.options.eval_split
        if name is None:
            return []
        if self.options.streaming and split == "train":
            return self._stream(name)
        if _is_saved(Path(self.options.path)):
            return self._from_disk(name)
        return self._from_hub(name)


# --------------------------------------------------------------------------- registration
@hookimpl
def register_datasets(register) -> None:
    register.add("arithmetic", ArithmeticDataset, options=ArithmeticOptions)
    register.add("arithmetic-steps", ArithmeticDataset, options=MultiStepArithmeticOptions,
                 description="multi-step arithmetic, one step 'a op b = c' per line")
    register.add("file", FileDataset, options=FileOptions)
    register.add("hf", HFDataset, options=HFOptions)
