"""The machinery of the TRL door's field table: what one entry is, the context its converter
reads, and how the table turns a set of TRL values into spec data.

An entry (:class:`TRLField`) names one TRL field, its TRL 1.16 default, the spec keys it
lands on and how (text for the docs), and a converter ``to(value, ctx) -> {spec key: value}``
that raises :class:`Refusal` for a value grpo-core cannot honour. Entries are of three kinds:
``mapped`` (it sets spec keys), ``refused`` (only its TRL default, or a value with the same
effect, is accepted) and ``ignored`` (accepted whatever its value: it changes nothing the
run computes, and the entry says why). The entries themselves are in
:mod:`grpo_core.trl.grpo_fields` and :mod:`grpo_core.trl.training_fields`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

MAPPED, REFUSED, IGNORED = "mapped", "refused", "ignored"


class Refusal(Exception):
    """A TRL value grpo-core cannot honour: ``why``, and ``instead`` (the spec key, the
    ``GRPOTrainer`` argument or the TRL value to use)."""

    def __init__(self, field: str, value: Any, why: str, instead: str):
        self.field, self.value, self.why, self.instead = field, value, why, instead
        super().__init__(self.text())

    def text(self) -> str:
        return f"{self.field}={self.value!r}: {self.why}; instead: {self.instead}"


Converter = Callable[[Any, "Context"], dict[str, Any]]


@dataclass(frozen=True)
class TRLField:
    """One TRL field and where it lands.

    Attributes:
        name: the field of TRL's ``GRPOConfig`` (its own, or inherited from
            ``transformers.TrainingArguments``).
        default: its TRL 1.16 default.
        keys: the spec keys it sets (``a.b.c``; ``tracking[0].every`` is an entry of a list);
            empty for refused and ignored fields.
        how: how the value converts, for the docs.
        kind: ``mapped``, ``refused`` or ``ignored``.
        to: the converter; None for ignored fields.
        note: more for the docs (a difference, a decision where TRL is silent).
        examples: ``(TRL value, {spec key: expected value})`` the tests check, on TRL's defaults
            and an 8-row training set, with a third item ``{other field: value}`` when the
            example needs other fields set too.
        refusals: ``(TRL value, text the error names)``, likewise, for values refused.
    """

    name: str
    default: Any
    keys: tuple[str, ...] = ()
    how: str = ""
    kind: str = MAPPED
    to: Converter | None = None
    note: str = ""
    examples: tuple[tuple[Any, dict[str, Any]], ...] = ()
    refusals: tuple[tuple[Any, str], ...] = ()


def mapped(name: str, default: Any, keys: str | tuple[str, ...], how: str, to: Converter, *, note: str = "",
           examples: tuple = (), refusals: tuple = ()) -> TRLField:
    keys = (keys,) if isinstance(keys, str) else keys
    return TRLField(name, default, keys, how, MAPPED, to, note, examples, refusals)


def same(key: str, convert: Callable[[Any], Any] = lambda v: v) -> Converter:
    """A converter that puts the (converted) value on ``key``."""
    return lambda value, ctx: {key: convert(value)}


def refused(name: str, default: Any, why: str, instead: str, *, accepts: Callable[[Any], bool] | None = None,
            bad: Any = None, note: str = "") -> TRLField:
    """A field grpo-core has no equivalent for: its default (or a value ``accepts`` calls
    equivalent to it) passes, anything else is refused with ``why`` and ``instead``. ``bad``:
    a value the tests expect to be refused."""
    ok = accepts or (lambda v: v == default)

    def to(value: Any, ctx: Context) -> dict[str, Any]:
        if not ok(value):
            raise Refusal(name, value, why, instead)
        return {}

    example = ((bad, instead),) if bad is not None else ()
    return TRLField(name, default, (), f"refused unless {default!r}" if accepts is None else "refused (see note)",
                    REFUSED, to, note or f"{why}; instead: {instead}.", (), example)


def ignored(name: str, default: Any, why: str) -> TRLField:
    """A field accepted whatever its value: it changes nothing the run computes (``why``)."""
    return TRLField(name, default, (), "accepted and ignored", IGNORED, None, why)


# --------------------------------------------------------------------------- context
def _int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise Refusal(name, value, f"must be an integer >= {minimum}", f"an integer >= {minimum}")
    return value


@dataclass(frozen=True)
class Layout:
    """How TRL's batch settings become grpo-core's rollout steps.

    ``prompts`` (P) prompts of ``group`` (G) completions each are generated at once; each
    is trained for ``mini_batches`` optimizer steps per pass and ``mu`` passes, so a rollout
    step makes ``per_step = mu * mini_batches`` optimizer steps (TRL's ``global_step`` counts
    optimizer steps)."""

    group: int
    prompts: int
    mini_batches: int
    micro_batch: int
    accumulation: int
    mu: int

    @property
    def per_step(self) -> int:
        return self.mu * self.mini_batches


@dataclass
class Context:
    """What a converter reads: every field's value (TRL's default where not set), the
    process count (``WORLD_SIZE``), and, once a ``GRPOTrainer`` is built, the training rows
    and reward functions. ``None`` for what is not known yet: checks that need it wait."""

    values: Mapping[str, Any]
    world_size: int = 1
    rows: int | None = None
    rewards: int | None = None
    problems: list[Refusal] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    @cached_property
    def layout(self) -> Layout:
        """TRL's batch arithmetic (``GRPOConfig.__post_init__``), refused where grpo-core's
        rollout step cannot follow it."""
        v, world = self.values, self.world_size
        group = _int("num_generations", v["num_generations"], 2)
        per_device = _int("per_device_train_batch_size", v["per_device_train_batch_size"])
        accumulation = _int("gradient_accumulation_steps", v["gradient_accumulation_steps"])
        mu = _int("num_iterations", v["num_iterations"])
        gen_batch, steps_per_gen = v["generation_batch_size"], v["steps_per_generation"]
        if gen_batch is not None and steps_per_gen is not None:
            raise Refusal("generation_batch_size", gen_batch, "TRL refuses generation_batch_size and "
                          "steps_per_generation together", "set one of them")
        if gen_batch is None:
            steps_per_gen = accumulation if steps_per_gen is None else _int("steps_per_generation", steps_per_gen)
            gen_batch = per_device * world * steps_per_gen
        else:
            gen_batch = _int("generation_batch_size", gen_batch)
            if gen_batch % (per_device * world):
                raise Refusal("generation_batch_size", gen_batch, f"TRL needs a multiple of the global batch "
                              f"per_device_train_batch_size x processes = {per_device * world}", "a multiple of it")
            steps_per_gen = gen_batch // (per_device * world)
        if gen_batch % group:
            raise Refusal("generation_batch_size", gen_batch, f"the generation batch ({gen_batch} completions: "
                          "per_device_train_batch_size x processes x steps_per_generation) must hold whole "
                          f"groups of num_generations={group}", "a multiple of num_generations (TRL refuses it too)")
        if steps_per_gen < accumulation or steps_per_gen % accumulation:
            raise Refusal("steps_per_generation", steps_per_gen, f"an optimizer step of TRL accumulates "
                          f"gradient_accumulation_steps={accumulation} micro-batches; with steps_per_generation="
                          f"{steps_per_gen} it would straddle generation batches, each normalized on its own, and "
                          "a grpo-core rollout step is one generation batch trained in whole optimizer steps",
                          "a multiple of gradient_accumulation_steps (TRL's default equals it), or "
                          "train.prompts_per_step / train.mini_batches in overrides")
        prompts, mini_batches = gen_batch // group, steps_per_gen // accumulation
        if prompts % mini_batches:
            raise Refusal("steps_per_generation", steps_per_gen, f"grpo-core trains a generation batch of {prompts} "
                          f"prompts in {mini_batches} optimizer steps of whole groups, so the steps must divide the "
                          "prompts", "a generation batch whose prompts the optimizer steps divide")
        if prompts % world:
            raise Refusal("per_device_train_batch_size", per_device, f"{prompts} prompts per generation batch cannot "
                          f"be shared by {world} processes in whole groups", "a generation batch of a multiple of "
                          "num_generations x processes completions")
        return Layout(group, prompts, mini_batches, per_device, accumulation, mu)

    def optimizer_steps_to_rollout_steps(self, name: str, value: Any, total: int | None = None) -> int:
        """A count of TRL optimizer steps (``eval_steps``, ``save_steps``...; a float below 1
        is a fraction of ``total``) as rollout steps, rounded up."""
        if isinstance(value, float) and 0 < value < 1:
            if total is None:
                total = self.total_optimizer_steps()
            if total is None:
                return 1
            value = math.ceil(total * value)
        if not isinstance(value, int | float) or value < 1:
            raise Refusal(name, value, "must be a positive number of steps", "a positive integer")
        return max(1, math.ceil(value / self.layout.per_step))

    def rollout_steps(self) -> int | None:
        """``train.steps``: TRL's ``max_steps`` (or its epochs over the rows) in rollout steps;
        None while the rows are not known."""
        per_step, max_steps = self.layout.per_step, self.values["max_steps"]
        if isinstance(max_steps, int) and max_steps > 0:
            if max_steps % per_step:
                raise Refusal("max_steps", max_steps, f"TRL counts optimizer steps, and each generation batch "
                              f"makes {per_step} of them (num_iterations x steps_per_generation / "
                              "gradient_accumulation_steps); grpo-core trains whole generation batches",
                              f"a multiple of {per_step}")
            return max_steps // per_step
        if self.rows is None:
            return None
        epochs = self.values["num_train_epochs"]
        per_epoch = self.rows // self.layout.prompts  # TRL's sampler drops an incomplete last batch
        if per_epoch == 0:
            raise Refusal("num_train_epochs", epochs, f"the training set has {self.rows} rows, fewer than the "
                          f"{self.layout.prompts} prompts of one generation batch", "more rows, or max_steps")
        steps = math.ceil(epochs * per_epoch * per_step) / per_step
        if steps != int(steps) or steps < 1:
            raise Refusal("num_train_epochs", epochs, f"{epochs} epochs of {per_epoch} generation batches is not a "
                          "whole number of generation batches", "max_steps, or whole epochs")
        return int(steps)

    def total_optimizer_steps(self) -> int | None:
        steps = self.rollout_steps()
        return None if steps is None else steps * self.layout.per_step


# --------------------------------------------------------------------------- building
def convert(fields: list[TRLField], ctx: Context) -> dict[str, Any]:
    """The spec keys of every entry for ``ctx``'s values; each key set by one entry only.
    Refusals are collected in ``ctx.problems`` (all of them, not only the first)."""
    out: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for entry in fields:
        if entry.to is None:
            continue
        try:
            keys = entry.to(ctx.values[entry.name], ctx)
        except Refusal as refusal:
            if all(p.text() != refusal.text() for p in ctx.problems):
                ctx.problems.append(refusal)
            continue
        for key, value in keys.items():
            if key in owner:
                raise AssertionError(f"spec key {key} set by both {owner[key]} and {entry.name}")
            owner[key] = entry.name
            out[key] = value
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` as ``{"a": {"b": 1}}``; a key holding a list is set whole."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def read(data: Any, key: str) -> Any:
    """The value at ``key`` (``a.b``, ``tracking[0].every``) of nested spec data."""
    node = data
    for part in key.split("."):
        name, _, index = part.partition("[")
        node = node[name] if name else node
        if index:
            node = node[int(index.rstrip("]"))]
    return node
