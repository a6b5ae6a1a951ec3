"""Component slots: the parts of a spec that select a plugin by ``name``.

A slot is validated in two phases. Pydantic validates the engine's own fields of the
slot (``beta`` of the KL slot, ``weight`` of a reward...) and keeps every other key
aside; then :func:`resolve_slots` looks the name up in the registry and validates those
other keys with that plugin's options model. Both phases report every problem with its
path, and the validated options stay attached to the slot all the way into the loop.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_serializer,
)

from grpo_core.errors import did_you_mean
from grpo_core.kinds import KINDS
from grpo_core.registry import Component, Registry


def _resolve_path(value: Path, info: ValidationInfo) -> Path:
    base = (info.context or {}).get("base_dir")
    try:
        value = Path(value).expanduser()
    except RuntimeError as exc:  # "~name" of an unknown user: a spec error, not a crash
        raise ValueError(f"cannot expand '~' in path {str(value)!r}: {exc}") from None
    if not value.is_absolute() and base is not None:
        value = Path(base) / value
    return value


#: A filesystem path in a spec: relative paths resolve against the spec file's folder.
#: Plugin options models use it for their path fields too.
SpecPath = Annotated[Path, AfterValidator(_resolve_path)]


class Section(BaseModel):
    """A part of the spec the engine owns: unknown keys are errors, and so are ``.inf`` and
    ``.nan`` in any number (a duration of ``.inf`` would pass ``gt=0`` and then fail every call)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Slot(BaseModel):
    """A component chosen by ``name``; keys other than the engine's fields are the
    plugin's options."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    kind: ClassVar[str]

    name: str = Field(description="Name of the registered component to use.")

    _component: Component | None = PrivateAttr(default=None)
    _options: BaseModel | None = PrivateAttr(default=None)

    @property
    def component(self) -> Component:
        if self._component is None:
            raise RuntimeError(f"slot {self.name!r} has not been resolved against a registry")
        return self._component

    @property
    def options(self) -> BaseModel | None:
        """The plugin's validated options (None for a component without options)."""
        return self._options

    def build(self) -> Any:
        """The ready component, built from the validated options."""
        return self.component.build(self._options)

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        data = handler(self)
        if self._options is not None:
            data.update(self._options.model_dump(mode="json"))
        return data


def iter_slots(model: BaseModel, path: tuple = ()) -> Iterator[tuple[tuple, Slot]]:
    """Every slot in ``model``, depth first, with its path."""
    for field_name in type(model).model_fields:
        value = getattr(model, field_name)
        if isinstance(value, list):
            items = enumerate(value)
        else:
            items = value.items() if isinstance(value, dict) else [(None, value)]
        for index, item in items:
            where = path + ((field_name,) if index is None else (field_name, index))
            if isinstance(item, Slot):
                yield where, item
            if isinstance(item, BaseModel):  # a slot may hold slots too (rollout.environment)
                yield from iter_slots(item, where)


def field_types(annotation: Any) -> list[Any]:
    """The concrete types inside Optional / Union / list / Annotated."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return field_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, tuple):
        out = []
        for arg in typing.get_args(annotation):
            out.extend(field_types(arg))
        return out
    return [annotation]


def slot_locations(model: type[BaseModel], prefix: tuple = ()) -> list[tuple[tuple, type[Slot], bool]]:
    """Static ``(path, slot class, is_list)`` of every slot field in the spec model; a
    ``"*"`` in a path stands for every key of a mapping (``eval.sets.*.data``)."""
    found = []
    for name, field in model.model_fields.items():
        origin = typing.get_origin(field.annotation)
        is_list = origin is list
        here = prefix + ((name, "*") if origin is dict else (name,))
        annotation = typing.get_args(field.annotation)[1] if origin is dict else field.annotation
        for t in field_types(annotation):
            if isinstance(t, type) and issubclass(t, Slot):
                found.append((here, t, is_list))
                if not is_list:  # a slot may hold slots too (rollout.environment)
                    found.extend(slot_locations(t, here))
            elif isinstance(t, type) and issubclass(t, BaseModel):
                found.extend(slot_locations(t, here))
    return found


def format_path(path: tuple) -> str:
    return ".".join(str(p) for p in path) if path else "(top level)"


def _option_problems(
    exc: ValidationError, path: tuple, slot: Slot, options_model: type[BaseModel]
) -> list[tuple[tuple, str]]:
    engine_keys = [k for k in type(slot).model_fields]
    valid = engine_keys + [k for k in options_model.model_fields if k not in engine_keys]
    problems = []
    for err in exc.errors(include_url=False):
        loc = path + tuple(err["loc"])
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            key = str(err["loc"][0])
            label = KINDS[slot.kind].label
            message = (
                f"unknown key '{key}' for {label} '{slot.name}'{did_you_mean(key, valid)}; "
                f"valid keys: {', '.join(valid)}"
            )
        elif err["type"] == "value_error" and "ctx" in err:  # a validator's own message, without pydantic's prefix
            message = str(err["ctx"]["error"])
        else:
            message = err["msg"]
        problems.append((loc, message))
    return problems


def resolve_slot(
    slot: Slot, path: tuple, registry: Registry, context: dict[str, Any]
) -> list[tuple[tuple, str]]:
    """Phase two for one slot: find its component and validate its options."""
    component = registry.find(slot.kind, slot.name)
    if component is None:
        return [(path + ("name",), registry.unknown_message(slot.kind, slot.name))]
    extra = dict(slot.model_extra or {})
    label = KINDS[slot.kind].label
    if component.options is None:
        if extra:
            keys = ", ".join(sorted(extra))
            valid = ", ".join(type(slot).model_fields)
            return [(path, f"{label} '{slot.name}' takes no options; unknown key(s): {keys}; valid keys: {valid}")]
        slot._component = component
        return []
    clash = sorted(set(component.options.model_fields) & set(type(slot).model_fields))
    if clash:
        return [(path, f"{label} '{slot.name}' (plugin '{component.plugin}') declares option(s) "
                       f"{', '.join(clash)} that the engine reserves in this slot; rename them in the plugin")]
    try:
        options = component.options.model_validate(extra, context=context)
    except ValidationError as exc:
        return _option_problems(exc, path, slot, component.options)
    slot._component = component
    slot._options = options
    # The options now live in ``slot.options``; keep the raw keys out of the way.
    for key in extra:
        slot.__pydantic_extra__.pop(key, None)
    return []


def resolve_slots(model: BaseModel, registry: Registry, context: dict[str, Any]) -> list[tuple[tuple, str]]:
    problems: list[tuple[tuple, str]] = []
    for path, slot in iter_slots(model):
        problems.extend(resolve_slot(slot, path, registry, context))
    return problems
