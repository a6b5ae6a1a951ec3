"""The reward contracts: reward functions (TRL's signature), step splitters, trainable reward
models, and what a completion's text is."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


# --------------------------------------------------------------------------- rewards
@runtime_checkable
class RewardFunction(Protocol):
    """TRL's signature: ``reward(prompts, completions, **columns) -> list[float | None]``.

    ``prompts`` and ``completions`` have ``B`` entries each (a prompt repeated ``G`` times):
    strings, or lists of chat messages when the dataset's prompts are conversational.
    Every other dataset column arrives as a keyword argument, also repeated per completion,
    with ``completion_ids`` (list of token id lists). ``None`` marks an unscorable completion.

    A process reward names a ``steps`` parameter: the engine then passes ``steps``, one list
    of step texts per completion (cut by the spec's step splitter), and expects one score
    (or None) per step back for each completion. A completion whose text has no step gets
    one empty step ``""``, so it is still scored.

    Attributes:
        required_columns: dataset columns the function reads; the engine checks every row
            has them before the first step and names the missing one. Default ``()``.
    """

    required_columns: Sequence[str] = ()

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list: ...


#: The largest reward magnitude: scores are float32 tensors, and a larger finite Python float
#: (``1e300``) has no float32 value.
REWARD_MAX = 3.4028234663852886e38


def reward_value(value: Any) -> float | None:
    """The one rule for a reward value, whatever its source (a local function, a process
    reward's step score, the ``remote`` reward's answer): None (unscorable) stays None; a
    finite real number (``int``, ``float``, ``bool``, a numpy scalar, a one-element tensor or
    array) within float32's range (``|r| <=`` :data:`REWARD_MAX`, about ``3.4e38``) becomes a
    float. Anything else raises ``ValueError`` saying what it is: a string (even ``"0.5"``),
    NaN, an infinity, an integer too large for a float (``10**400``), a number beyond float32
    (``1e300``)."""
    if value is None:
        return None
    if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # a 0-d tensor or array, numpy's bool
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise ValueError(f"{type(value).__name__} {value!r:.60}")
    try:
        out = float(value)
    except OverflowError:
        raise ValueError(f"{type(value).__name__} too large for a float ({str(value)[:20]}...)") from None
    if not math.isfinite(out):
        raise ValueError(str(out))
    if abs(out) > REWARD_MAX:
        raise ValueError(f"{out!r}, beyond the float32 range of rewards (|r| <= {REWARD_MAX:.4g})")
    return out


@runtime_checkable
class StepSplitter(Protocol):
    """``split(text) -> [(start, end), ...]``: character spans of the steps of one
    completion's text, in order, non-overlapping, each non-empty (``start < end``).

    ``text[start:end]`` is the step's text (delimiters and surrounding blanks left out).
    For the advantage, a step runs up to where the next one starts (its delimiter is part
    of it) and the last step runs to the completion's last token (EOS included), so every
    completion token gets an advantage.
    """

    def __call__(self, text: str) -> list[tuple[int, int]]: ...


@dataclass
class RewardExample:
    """One labelled sample for training a reward model (iterative GRPO).

    ``prompt`` and ``completion`` are what reward functions receive (strings, or chat
    messages for conversational data); ``label`` is the verifier's score.
    """

    prompt: Any
    completion: Any
    label: float


@runtime_checkable
class TrainableReward(Protocol):
    """A reward function that can be trained (iterative GRPO): it is called like any
    reward function and, at each iteration start, ``fit`` trains it on fresh labelled
    samples of the latest policy (plus whatever replay it keeps) and ``evaluate`` scores
    it on held-out samples. Both return metrics (name -> float; ``fit`` reports at least
    ``train_loss``, ``evaluate`` at least ``accuracy``). Its ``state_dict`` covers the
    weights, the optimizer and any replay buffer, so checkpoints and resume include them.
    """

    def fit(self, examples: list[RewardExample]) -> dict[str, float]: ...

    def evaluate(self, examples: list[RewardExample]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _content_text(content: Any) -> str:
    """The text of a message's ``content``: a string, or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: [{"type": "text", "text": ...}]
        return "".join(
            part.get("text", "") if isinstance(part, dict) else str(part) for part in content
        )
    return str(content)


def completion_text(completion: Any) -> str:
    """The text of one completion, whatever its representation.

    A string is returned as is; a chat message ``{"role", "content"}`` gives its content;
    a list of messages (TRL's conversational completion, ``[{"role": "assistant",
    "content": text}]``) gives the concatenated contents of its assistant messages: in a
    multi-turn episode the tool results and user turns are the environment's text, not
    the model's.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        return "".join(
            completion_text(message) for message in completion
            if not isinstance(message, dict) or message.get("role", "assistant") == "assistant"
        )
    raise TypeError(
        f"a completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )
