"""Demonstrations of the SFT stage: dataset rows turned into (prompt ids, completion ids, loss
mask), in a seeded per-epoch order whose position is checkpointed.

The prompt is rendered exactly as a GRPO prompt is (:class:`~grpo_core.train.actor.data.PromptSource`:
the chat template with its generation prompt, the system prompt), so that SFT trains the
tokens the policy will later be asked to generate after the same prompt ids. The completion:

- ``completion_column`` holding a string (or a list of assistant messages) after a chat prompt:
  the chat template applied to prompt + answer, minus the prompt's text (the assistant turn
  and its end-of-turn tokens); after a plain-string prompt: the text and the EOS token.
  Every completion token trains.
- ``messages_column`` holding a whole conversation: the prompt is every message before the
  first assistant turn; then each later message is rendered by the chat template in turn,
  the assistant turns trained and the others (user, tool, the next generation prompt)
  context. The template must render each conversation as a prefix of its continuation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_core.errors import RunError
from grpo_core.spec.sft import SftSection
from grpo_core.train.actor.data import PromptSource

#: The column a conversation's prompt part is put in (messages_column rows).
_PROMPT = "__sft_prompt"


@dataclass
class Demo:
    """One encoded demonstration: prompt ids, completion ids and the completion's loss mask."""

    prompt: list[int]
    completion: list[int]
    mask: list[bool]
    truncated: bool = False


class Demonstrations:
    """The demonstrations of one split, encoded lazily (see the module doc)."""

    def __init__(self, rows: list[dict], tokenizer, section: SftSection, *, seed: int, eos_id: int,
                 split: str = "training", shuffle: bool | None = None):
        self.section = section
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.split = split
        self.truncated = 0
        slot = section.data
        if section.messages_column is not None:
            rows = [_conversation(row, section.messages_column, split) for row in rows]
            slot = slot.model_copy(update={"prompt_column": _PROMPT})
        self.source = PromptSource(rows, tokenizer, slot, seed=seed, max_tokens=section.max_length - 1,
                                   shuffle=section.shuffle if shuffle is None else shuffle, split=split)

    @property
    def rows(self) -> list[dict]:
        return self.source.rows

    def next(self, n: int) -> list[Demo]:
        """The next ``n`` usable demonstrations, a new shuffled epoch starting as needed."""
        return [self.encode(p) for p in self.source.next(n)]

    def all(self) -> list[Demo]:
        """Every usable demonstration, in order (the held-out set)."""
        return [self.encode(p) for p in map(self.source.render, self.rows) if p is not None]

    def encode(self, prompt) -> Demo:
        s = self.section
        if s.messages_column is not None:
            completion, mask = self._conversation_tokens(prompt)
        else:
            completion = self._completion_tokens(prompt)
            mask = [True] * len(completion)
        room = s.max_length - len(prompt.ids)
        cut = len(completion) > room
        self.truncated += cut
        return Demo(list(prompt.ids), completion[:room], mask[:room], cut)

    def state_dict(self) -> dict[str, Any]:
        return {**self.source.state_dict(), "truncated": self.truncated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)
        self.truncated = int(state.get("truncated", 0))

    # ----------------------------------------------------------------- encoding
    def _templated(self, prompt) -> bool:
        return (isinstance(prompt.prompt, list) and self.section.data.chat_template
                and bool(getattr(self.tokenizer, "chat_template", None)))

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.section.data.chat_template_kwargs)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _completion_tokens(self, prompt) -> list[int]:
        column = self.section.completion_column
        if column not in prompt.row:
            raise RunError(f"sft.completion_column '{column}' is not a column of the {self.split} demonstrations; "
                           f"their columns are: {', '.join(prompt.row)}")
        answer = prompt.row[column]
        if isinstance(answer, str):
            messages = [{"role": "assistant", "content": answer}]
        elif isinstance(answer, list) and all(isinstance(m, dict) for m in answer):
            messages = answer
        else:
            raise RunError(f"sft.completion_column '{column}' must hold strings or lists of assistant messages; "
                           f"got {type(answer).__name__}")
        if not self._templated(prompt):
            text = answer if isinstance(answer, str) else "\n".join(str(m.get("content", "")) for m in answer)
            return self._ids(text) + [self.eos_id]
        full = self._render(list(prompt.prompt) + messages, False)
        return self._ids(self._after(full, prompt.text))

    def _conversation_tokens(self, prompt) -> tuple[list[int], list[bool]]:
        if not self._templated(prompt):
            raise RunError("sft.messages_column: conversations are rendered by the tokenizer's chat template, "
                           "which this tokenizer lacks (or sft.data.chat_template is false); use completion_column")
        shown, text = list(prompt.prompt), prompt.text
        rest = prompt.row[_PROMPT + "_rest"]
        ids: list[int] = []
        mask: list[bool] = []
        for i, message in enumerate(rest):
            shown.append(message)
            trained = message.get("role") == "assistant"
            then_assistant = i + 1 < len(rest) and rest[i + 1].get("role") == "assistant"
            longer = self._render(shown, generation_prompt=not trained and then_assistant)
            piece = self._ids(self._after(longer, text))
            ids += piece
            mask += [trained] * len(piece)
            text = longer
        return ids, mask

    def _after(self, longer: str, prefix: str) -> str:
        if not longer.startswith(prefix):
            raise RunError(
                f"sft: the chat template does not render a conversation as a prefix of its continuation ({self.split} "
                f"demonstrations: {prefix[-60:]!r} is not continued by {longer[len(prefix) - 60:len(prefix) + 20]!r}), "
                "so the trained tokens cannot be told apart; give prompt + completion rows with a string prompt, or "
                "a template that keeps earlier turns as they are")
        return longer[len(prefix):]


def _conversation(row: dict, column: str, split: str) -> dict:
    """``row`` with its conversation split at the first assistant turn: the messages before it
    as the prompt, the rest kept beside."""
    messages = row.get(column)
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RunError(f"sft.messages_column '{column}' must hold lists of chat messages in every {split} "
                       f"demonstration; got {type(messages).__name__}"
                       + (f" (columns: {', '.join(row)})" if column not in row else ""))
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise RunError(f"sft.messages_column '{column}': a {split} conversation "
                       + ("has no assistant turn to train" if first is None else "starts with an assistant turn")
                       + " (each needs a prompt, then an assistant turn)")
    return {**row, _PROMPT: messages[:first], _PROMPT + "_rest": messages[first:]}
