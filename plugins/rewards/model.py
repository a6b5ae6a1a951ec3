"""Reward function ``reward_model``: the first logit of a transformers sequence-classification
model reading the prompt and the completion."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Literal

from grpo_plugins.rewards.common import resolve_device
from pydantic import Field, ValidationInfo, field_validator

from grpo_core import hookimpl
from grpo_core.contracts import completion_text
from grpo_core.errors import RunError
from grpo_core.options import Options

__all__ = ["RewardModelOptions", "RewardModelReward", "is_path_like", "local_or_hub_id"]


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


def is_path_like(value: str) -> bool:
    """Whether ``value`` names a folder (it exists, or looks like a path) rather than a Hub id:
    a folder loads as it is (``local_files_only``), a Hub id through transformers' resolution."""
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
        local = is_path_like(path)
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


@hookimpl
def register_reward_functions(register) -> None:
    register.add("reward_model", RewardModelReward, options=RewardModelOptions)
