"""Prompts: rows of the dataset plugin turned into token ids, in a seeded order whose
position can be saved and restored."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from grpo_core.errors import RunError
from grpo_core.spec.data import DataSlot
from grpo_core.train.actor.drivers.episodes import with_tools
from grpo_core.train.actor.images import load_row_images, render_images
from grpo_core.train.experience import Prompt
from grpo_core.train.model import check_processor

if TYPE_CHECKING:
    from grpo_core.contracts import PromptSampler


def check_columns(rows: list[dict], needed: dict[str, str], split: str) -> None:
    """Raise naming the first missing column and listing the ones that exist.

    ``needed`` maps a column to who needs it (``"data.prompt_column"``, ``"reward function 'accuracy'"``).
    """
    if not rows:
        return
    columns = list(rows[0])
    for column, who in needed.items():
        if column not in rows[0]:
            raise RunError(
                f"{who} needs column '{column}', which the {split} data does not have; "
                f"its columns are: {', '.join(columns)}"
            )


class PromptSource:
    """Renders and tokenizes prompts lazily, in a seeded per-epoch order.

    Empty prompts and prompts longer than the limit are skipped and counted in
    ``self.skipped`` (reason -> count).

    With ``slot.image_column`` every row's images are loaded and checked here (a bad one
    raises, naming its row), and prompts are rendered by ``processor`` (the model's, which
    must be given): the images placed by its chat template, their tokens and tensors in the
    prompt (:mod:`grpo_core.train.actor.images`).
    """

    def __init__(
        self, rows: list[dict], tokenizer, slot: DataSlot, *, seed: int, max_tokens: int,
        shuffle: bool | None = None, tools: list[dict] | Callable[[dict], list[dict]] | None = None,
        sampler: PromptSampler | None = None, processor: Any = None, split: str = "training",
    ):
        if not rows:
            raise RunError(f"data: dataset '{slot.name}' has no rows to train on")
        self.processor = processor
        column = getattr(slot, "image_column", None)
        # the images of each row (by the row's identity: rows are rendered by value, not index)
        self._images: dict[int, list] | None = None
        if column is not None and rows != [{}]:
            check_processor(processor, "model.path")
            found = load_row_images(rows, column, split, getattr(slot, "max_image_pixels", None))
            self._images = {id(row): images for row, images in zip(rows, found)}
        self.rows = rows
        self.tokenizer = tokenizer
        self.slot = slot
        self.seed = seed
        self.max_tokens = max_tokens
        self.shuffle = slot.shuffle if shuffle is None else shuffle
        self.epoch = 0
        self.position = 0
        self.skipped: dict[str, int] = {}
        # JSON schemas shown to the model: the environment's, or a row's route's (row -> schemas)
        self.tools = tools if callable(tools) else list(tools or [])
        self.sampler = sampler  # chooses the rows instead of the epochs' shuffle
        if sampler is not None:
            sampler.start(rows, seed)
        self._order = self._make_order()

    def _make_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    def render(self, row: dict) -> Prompt | None:
        """The prompt of ``row``, or None (counted) when it cannot be used."""
        prompt = row[self.slot.prompt_column]
        tools = self.tools(row) if callable(self.tools) else self.tools
        if isinstance(prompt, str) and (self.slot.as_user_message or self._images is not None):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list):
            messages = list(prompt)
            if self.slot.system_prompt and not (messages and messages[0].get("role") == "system"):
                messages = [{"role": "system", "content": self.slot.system_prompt}] + messages
            if not any(str(m.get("content", "")).strip() for m in messages if m.get("role") != "system"):
                return self._skip("empty prompt")
            if self._images is not None:
                text, ids, images = render_images(self.processor, messages, self._images.get(id(row), []),
                                                  self.slot.chat_template_kwargs)
                if len(ids) > self.max_tokens:
                    return self._skip("prompt too long")
                return Prompt(row, messages, text, ids, source=self._source_of(row), images=images)
            if self.slot.chat_template and getattr(self.tokenizer, "chat_template", None):
                messages, extra = with_tools(self.tokenizer, messages, tools)
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, **self.slot.chat_template_kwargs, **extra
                )
            else:
                text = "\n".join(str(m.get("content", "")) for m in messages)
            prompt = messages
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, str):
            if tools:
                raise RunError(
                    "rollout.environment offers tools, which the chat template shows to the model: the "
                    f"prompts (column '{self.slot.prompt_column}') must be chat messages, not strings"
                )
            if not prompt.strip():
                return self._skip("empty prompt")
            text = prompt
            ids = self.tokenizer(text)["input_ids"]
        else:
            raise RunError(
                f"data.prompt_column '{self.slot.prompt_column}' must hold strings or lists of chat "
                f"messages; got {type(prompt).__name__}"
            )
        if len(ids) > self.max_tokens:
            return self._skip("prompt too long")
        return Prompt(row, prompt, text, ids, source=self._source_of(row))

    def _source_of(self, row: dict) -> str | None:
        column = self.slot.source_column
        return None if column is None else str(row.get(column))

    def _skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        return None

    def next(self, n: int) -> list[Prompt]:
        """The next ``n`` usable prompts, starting a new (reshuffled) epoch as needed (or as
        the sampler draws them)."""
        if self.sampler is not None:
            return self._drawn(n)
        out: list[Prompt] = []
        misses = 0
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._make_order()
            row = self.rows[int(self._order[self.position])]
            self.position += 1
            prompt = self.render(row)
            if prompt is not None:
                prompt.index = int(self._order[self.position - 1])
            if prompt is None:
                misses += 1
                if misses > len(self.rows):
                    raise RunError(
                        f"data: no usable prompt in dataset '{self.slot.name}' (skipped: {self.skipped})"
                    )
                continue
            out.append(prompt)
        return out

    def _drawn(self, n: int) -> list[Prompt]:
        """``n`` usable prompts of the rows the sampler draws (unusable rows drawn again are
        replaced by further draws)."""
        out: list[Prompt] = []
        misses = 0
        while len(out) < n:
            for index in self.sampler.draw(n - len(out)):
                if not 0 <= index < len(self.rows):
                    raise RunError(f"data.sampler: drew row {index}, outside the {len(self.rows)} training rows")
                prompt = self.render(self.rows[index])
                if prompt is None:
                    misses += 1
                    if misses > 10 * len(self.rows):
                        raise RunError(f"data: the sampler drew no usable prompt in {misses} draws from dataset "
                                       f"'{self.slot.name}' (skipped: {self.skipped})")
                    continue
                prompt.index = index
                out.append(prompt)
        return out

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "position": self.position, "skipped": dict(self.skipped)}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.skipped = dict(state.get("skipped", {}))
        self._order = self._make_order()
        if self.sampler is not None and "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])
