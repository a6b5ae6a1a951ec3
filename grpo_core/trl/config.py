"""``GRPOConfig``: TRL 1.16's configuration object, as grpo-core reads it.

It takes TRL's field names with TRL's defaults (every field of TRL's ``GRPOConfig``, its own
and those it inherits from ``transformers.TrainingArguments``), refuses a misspelt name with
a did-you-mean, and turns its values into spec data through the field table
(:data:`grpo_core.trl.FIELDS`). A value grpo-core cannot honour is refused when the config
is made, every such value at once, each naming the spec key or value to use instead.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from grpo_core.errors import UsageError, did_you_mean
from grpo_core.trl import grpo_fields, training_fields
from grpo_core.trl.table import Context, Refusal, TRLField, convert, nest

#: Every TRL field the door knows, TrainingArguments' first (as TRL's dataclass orders them).
FIELDS: list[TRLField] = [*training_fields.FIELDS, *grpo_fields.FIELDS]
BY_NAME: dict[str, TRLField] = {f.name: f for f in FIELDS}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in FIELDS}


class TRLConfigError(UsageError):
    """TRL arguments grpo-core cannot honour (or does not know), every one of them."""

    def __init__(self, problems: Iterable[str], what: str = "GRPOConfig"):
        self.problems = list(problems)
        n = len(self.problems)
        body = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{what}: {n} argument{'s' if n != 1 else ''} grpo-core cannot take as given "
                         f"(docs/coming-from-trl.md):\n{body}")


def world_size() -> int:
    """The process count a launcher set (``WORLD_SIZE``), as TRL's ``args.world_size``."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _unknown(name: str) -> str:
    from transformers import TrainingArguments

    if name in {f.name for f in dataclasses.fields(TrainingArguments)}:
        return (f"{name}: a transformers TrainingArguments field the TRL door does not know (it maps TRL 1.16's "
                "GRPOConfig on transformers 4.56 to 5.x); drop it, or set the spec key it stands for in "
                "GRPOTrainer(overrides=...)")
    return f"{name}: not a field of TRL's GRPOConfig{did_you_mean(name, BY_NAME)}"


class GRPOConfig:
    """TRL's ``GRPOConfig`` (1.16) for grpo-core: ``from grpo_core.trl import GRPOConfig``.

    Takes TRL's fields by keyword (``output_dir`` also first by position) with TRL's
    defaults, and reads like TRL's (``args.learning_rate``). Where each field lands in the
    spec, and which are refused or ignored and why: ``docs/coming-from-trl.md``.

    Raises:
        TRLConfigError: every misspelt field (with a did-you-mean) and every value
            grpo-core cannot honour, naming what to use instead.
    """

    def __init__(self, output_dir: str | None = None, **fields: Any):
        if output_dir is not None:
            fields = {"output_dir": output_dir, **fields}
        problems = [_unknown(name) for name in fields if name not in BY_NAME]
        if problems:
            raise TRLConfigError(problems)
        object.__setattr__(self, "_values", {k: copy.deepcopy(v) for k, v in fields.items()})
        self.check()

    # ----------------------------------------------------------------- fields
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_values":
            raise AttributeError(name)
        if name in BY_NAME:
            return self._values.get(name, DEFAULTS[name])
        raise AttributeError(_unknown(name))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in BY_NAME:
            raise TRLConfigError([_unknown(name)])
        self._values[name] = value

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"GRPOConfig({inner})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GRPOConfig) and self.to_dict() == other.to_dict()

    def to_dict(self) -> dict[str, Any]:
        """Every field with its value (TRL's default where not set)."""
        return {**DEFAULTS, **self._values}

    @property
    def set_fields(self) -> dict[str, Any]:
        """The fields given a value (their names as TRL spells them)."""
        return dict(self._values)

    # ----------------------------------------------------------------- the spec
    def context(self, *, rows: int | None = None, rewards: int | None = None,
                model_object: bool = False) -> Context:
        values = {**self.to_dict(), "_model_object": model_object}
        return Context(values, world_size=world_size(), rows=rows, rewards=rewards)

    def spec_data(self, *, rows: int | None = None, rewards: int | None = None,
                  model_object: bool = False) -> dict[str, Any]:
        """The spec data this config stands for (no ``model`` or ``rewards``: the trainer's
        arguments give them). ``rows``: the training rows, for epoch counts; ``rewards``: the
        number of reward functions. Raises :class:`TRLConfigError` listing every refusal."""
        ctx = self.context(rows=rows, rewards=rewards, model_object=model_object)
        flat = convert(FIELDS, ctx)
        if ctx.problems:
            raise TRLConfigError(p.text() for p in ctx.problems)
        return nest(flat)

    def check(self) -> None:
        """Refuse now what no dataset or trainer argument can make right."""
        self.spec_data()


__all__ = ["BY_NAME", "DEFAULTS", "FIELDS", "GRPOConfig", "Refusal", "TRLConfigError", "world_size"]
