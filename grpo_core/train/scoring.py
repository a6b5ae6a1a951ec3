"""Scoring completions with the spec's reward functions (TRL's calling convention)."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from grpo_core.errors import RunError


@dataclass
class RewardFn:
    """A built reward function with its spec name and weight."""

    name: str
    weight: float
    fn: Callable[..., list]
    takes_kwargs: bool
    params: frozenset[str]

    @classmethod
    def of(cls, name: str, weight: float, fn: Callable[..., list]) -> "RewardFn":
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return cls(name, weight, fn, True, frozenset())
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        return cls(name, weight, fn, takes_kwargs, frozenset(sig.parameters))

    def call(self, kwargs: dict[str, Any]) -> list:
        if not self.takes_kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k in self.params}
        return self.fn(**kwargs)

    @property
    def required_columns(self) -> list[str]:
        return list(getattr(self.fn, "required_columns", []) or [])


@dataclass
class Scores:
    """Rewards of ``B`` completions.

    ``total``: ``float (B,)`` weighted sum, NaN where every function said None.
    ``per_function``: ``float (B, F)``, NaN where a function said None.
    ``failed``: completions whose reward function raised and were scored None.
    """

    total: torch.Tensor
    per_function: torch.Tensor
    names: list[str]
    failed: int = 0


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


def score(
    fns: list[RewardFn],
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list],
    completion_ids: list[list[int]],
    on_error: str = "raise",
) -> Scores:
    """Call every reward function once on all ``B`` completions and combine them."""
    size = len(completions)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    table = torch.full((size, len(fns)), math.nan, dtype=torch.float32)
    failed = 0
    for j, fn in enumerate(fns):
        values, n_failed = _call_one(fn, kwargs, on_error)
        failed += n_failed
        if not isinstance(values, (list, tuple)) or len(values) != size:
            got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else repr(values)
            raise RunError(f"reward function '{fn.name}' returned {got}; expected a list of {size} floats or None")
        for i, v in enumerate(values):
            table[i, j] = _to_float(v, fn, i)
    weights = torch.tensor([fn.weight for fn in fns], dtype=torch.float32)
    weighted = table * weights
    scored = ~torch.isnan(table)
    total = torch.where(scored, weighted, torch.zeros(())).sum(dim=1)
    total = torch.where(scored.any(dim=1), total, torch.full((), math.nan))
    return Scores(total, table, [fn.name for fn in fns], failed)
