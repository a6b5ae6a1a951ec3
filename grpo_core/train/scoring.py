"""Scoring completions with the spec's reward functions (TRL's calling convention).

Process supervision: a reward function that names a ``steps`` parameter gets the steps of
every completion and returns, per completion, one score per step (a list) instead of a
float. With steps, :func:`score` also returns ``step_scores (B, K)``: the weighted sum
over functions of each step's score, where an outcome (float) score counts on the last
step. A completion's per-function score of a process reward (for metrics and for outcome
estimators) is the mean of its step scores.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.contracts import masked_fill_zero
from grpo_core.errors import RunError
from grpo_core.registry import conform


@dataclass
class RewardFn:
    """A built reward function with its spec name and weight."""

    name: str
    weight: float
    fn: Callable[..., list]
    takes_kwargs: bool
    params: frozenset[str]
    splitter: Callable[[list], Any] | None = None  # completions -> StepLayout

    @classmethod
    def of(
        cls, name: str, weight: float, fn: Callable[..., list], splitter: Callable[[list], Any] | None = None
    ) -> RewardFn:
        fn = conform("reward_function", fn, f"reward function '{name}'")  # declared flags present
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return cls(name, weight, fn, True, frozenset(), splitter)
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        return cls(name, weight, fn, takes_kwargs, frozenset(sig.parameters), splitter)

    @property
    def takes_steps(self) -> bool:
        """A process reward: it names a ``steps`` parameter."""
        return "steps" in self.params

    def call(self, kwargs: dict[str, Any]) -> list:
        if not self.takes_kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k in self.params}
        return self.fn(**kwargs)

    @property
    def required_columns(self) -> list[str]:
        return list(self.fn.required_columns)


@dataclass
class Scores:
    """Rewards of ``B`` completions.

    ``total``: ``float (B,)`` weighted sum, NaN where every function said None.
    ``per_function``: ``float (B, F)``, NaN where a function said None.
    ``failed``: completions whose reward function raised and were scored None.
    ``step_scores``: ``float (B, K)`` weighted step scores when steps were given, else None.
    """

    total: torch.Tensor
    per_function: torch.Tensor
    names: list[str]
    failed: int = 0
    step_scores: torch.Tensor | None = None  # float (B, K), NaN where no function scored


def _to_float(value: Any, fn: RewardFn, index: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return float(value)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise RunError(
            f"reward function '{fn.name}' returned {value!r} for completion {index}; "
            "expected a float or None"
        ) from None
    return out


def _prompt_head(prompt: Any, width: int = 60) -> str:
    if isinstance(prompt, list):
        prompt = " ".join(str(m.get("content", "")) for m in prompt if m.get("role") != "system")
    text = " ".join(str(prompt).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _call_one(fn: RewardFn, kwargs: dict[str, Any], on_error: str) -> tuple[list, int]:
    """Call ``fn`` on the batch; when it raises, find the completion it fails on."""
    size = len(kwargs["completions"])
    try:
        return fn.call(kwargs), 0
    except Exception:
        pass
    out, failed = [], 0
    for i in range(size):
        one = {k: v[i:i + 1] if isinstance(v, list) else v for k, v in kwargs.items()}
        try:
            result = fn.call(one)
            out.append(result[0] if isinstance(result, (list, tuple)) and len(result) == 1 else result)
        except Exception as exc:
            if on_error == "raise":
                raise RunError(
                    f"reward function '{fn.name}' raised {type(exc).__name__}: {exc} on completion {i} "
                    f"(prompt: {_prompt_head(kwargs['prompts'][i])!r}); set train.reward_errors: none "
                    "to score such completions None instead"
                ) from exc
            out.append(None)
            failed += 1
    return out, failed


def _step_values(value: Any, fn: RewardFn, index: int, steps: list[list[str]] | None) -> list[float]:
    """A process reward's per-step scores for completion ``index``, checked against its steps."""
    values = list(value)
    if steps is None:
        raise RunError(
            f"reward function '{fn.name}' returned a list of {len(values)} scores for completion "
            f"{index}; per-step scores need the completion's steps: name a `steps` parameter "
            "in the function (the engine then passes the steps of every completion)"
        )
    if len(values) != len(steps[index]):
        raise RunError(
            f"reward function '{fn.name}' returned {len(values)} step scores for completion "
            f"{index}, which has {len(steps[index])} steps (algorithm.step_splitter); return one "
            "score (or None) per entry of its `steps`"
        )
    return [_to_float(v, fn, index) for v in values]


def _is_per_step(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (getattr(value, "ndim", 0) == 1 and hasattr(value, "tolist"))


def _weighted(table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over the last dim (functions) of the scored entries; NaN where none is."""
    scored = ~torch.isnan(table)
    total = masked_fill_zero(table * weights, scored).sum(dim=-1)
    return torch.where(scored.any(dim=-1), total, torch.full((), math.nan))


def _default_steps(fns: list[RewardFn], completions: list[Any]) -> list[list[str]] | None:
    """The steps for callers that did not cut them (evaluation), when a function takes them."""
    takers = [fn for fn in fns if fn.takes_steps]
    if not takers:
        return None
    if takers[0].splitter is None:
        raise RunError(f"reward function '{takers[0].name}' takes `steps` but no step splitter was given")
    return takers[0].splitter(completions).texts


def score(
    fns: list[RewardFn],
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list],
    completion_ids: list[list[int]],
    on_error: str = "raise",
    steps: list[list[str]] | None = None,
) -> Scores:
    """Call every reward function once on all ``B`` completions and combine them.

    ``steps``: the step texts of each completion (process supervision), passed to the
    functions as ``steps``; cut with the functions' splitter when None and one takes them.
    """
    size = len(completions)
    steps = steps if steps is not None else _default_steps(fns, completions)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    if steps is not None:
        if "steps" in columns:
            raise RunError(
                "the dataset has a column 'steps', which would hide the completions' steps that "
                "process rewards receive as `steps`; rename the column"
            )
        kwargs["steps"] = steps
    table = torch.full((size, len(fns)), math.nan, dtype=torch.float32)
    k = max((len(s) for s in steps), default=0) if steps is not None else 0
    step_table = torch.full((size, k, len(fns)), math.nan, dtype=torch.float32)
    failed = 0
    for j, fn in enumerate(fns):
        values, n_failed = _call_one(fn, kwargs, on_error)
        failed += n_failed
        if not isinstance(values, (list, tuple)) or len(values) != size:
            got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else repr(values)
            raise RunError(f"reward function '{fn.name}' returned {got}; expected a list of {size} floats or None")
        for i, v in enumerate(values):
            if _is_per_step(v):
                per_step = torch.tensor(_step_values(v, fn, i, steps), dtype=torch.float32)
                step_table[i, : len(per_step), j] = per_step
                table[i, j] = per_step.nanmean() if len(per_step) else math.nan
            else:
                table[i, j] = _to_float(v, fn, i)
                if steps is not None and steps[i]:  # an outcome score counts on the last step
                    step_table[i, len(steps[i]) - 1, j] = table[i, j]
    weights = torch.tensor([fn.weight for fn in fns], dtype=torch.float32)
    step_scores = _weighted(step_table, weights) if steps is not None else None
    return Scores(_weighted(table, weights), table, [fn.name for fn in fns], failed, step_scores)
