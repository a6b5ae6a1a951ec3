"""The registry: which plugin provides which component, by kind and name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from grpo_core.errors import PluginError, did_you_mean
from grpo_core.hookspecs import KIND_LABELS, KINDS

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclass(frozen=True)
class Component:
    """One registered component.

    Attributes:
        kind: one of :data:`grpo_core.hookspecs.KINDS`.
        name: what a spec selects it by.
        impl: the component itself, or its factory when ``options`` is set.
        options: the pydantic model that validates the slot's keys, or None.
        plugin: name of the plugin that registered it.
        description: one line, from ``description=`` or the impl's docstring.
    """

    kind: str
    name: str
    impl: Any
    options: type[BaseModel] | None
    plugin: str
    description: str

    def build(self, options: BaseModel | None = None) -> Any:
        """The ready component: ``impl`` itself, or ``impl(options)`` for a factory."""
        if self.options is None:
            return self.impl
        if options is None:
            options = self.options()
        return self.impl(options)


class Registrar:
    """Handed to every ``register_<kind>s`` hook; records what one plugin registers."""

    def __init__(self, registry: Registry, kind: str, plugin: str):
        self._registry = registry
        self.kind = kind
        self.plugin = plugin

    def add(
        self,
        name: str,
        impl: Any,
        *,
        options: type[BaseModel] | None = None,
        description: str | None = None,
    ) -> None:
        """Register ``impl`` under ``name``.

        Args:
            name: the name a spec selects it by (letters, digits, ``_ . + -``).
            impl: the component, or a factory ``impl(options)`` when ``options`` is set.
            options: a pydantic model with ``extra="forbid"`` validating the slot's keys.
            description: one line for ``grpo-run plugins``; defaults to the first line of
                the impl's docstring.
        """
        label = KIND_LABELS[self.kind]
        if not isinstance(name, str) or not _NAME.match(name):
            raise PluginError(
                f"plugin '{self.plugin}' registered a {label} with an invalid name {name!r}: "
                "names use letters, digits and _ . + - and start with a letter or digit"
            )
        if options is not None:
            if not (isinstance(options, type) and issubclass(options, BaseModel)):
                raise PluginError(
                    f"plugin '{self.plugin}' registered {label} '{name}' with options={options!r}: "
                    "options must be a pydantic BaseModel subclass (or None)"
                )
            if options.model_config.get("extra") != "forbid":
                raise PluginError(
                    f"plugin '{self.plugin}' registered {label} '{name}' with options model "
                    f"{options.__name__} that accepts unknown keys: set "
                    "model_config = ConfigDict(extra='forbid') (or subclass grpo_core.options.Options)"
                )
        if description is None:
            doc = (getattr(impl, "__doc__", None) or "").strip()
            description = doc.splitlines()[0] if doc else ""
        self._registry._add(
            Component(self.kind, name, impl, options, self.plugin, description)
        )


class Registry:
    """Components of every kind, keyed by name."""

    def __init__(self) -> None:
        self._components: dict[str, dict[str, Component]] = {kind: {} for kind in KINDS}

    def _add(self, component: Component) -> None:
        table = self._components[component.kind]
        existing = table.get(component.name)
        if existing is not None:
            label = KIND_LABELS[component.kind]
            raise PluginError(
                f"{label} '{component.name}' is registered twice: by plugin "
                f"'{existing.plugin}' and by plugin '{component.plugin}'; "
                f"disable one of them (GRPO_DISABLED_PLUGINS) or rename the component"
            )
        table[component.name] = component

    def names(self, kind: str) -> list[str]:
        """Registered names of ``kind``, in registration order."""
        return list(self._components[kind])

    def components(self, kind: str) -> list[Component]:
        return list(self._components[kind].values())

    def find(self, kind: str, name: str) -> Component | None:
        return self._components[kind].get(name)

    def get(self, kind: str, name: str) -> Component:
        """The component, or a :class:`PluginError` listing the available names."""
        found = self.find(kind, name)
        if found is None:
            raise PluginError(self.unknown_message(kind, name))
        return found

    def unknown_message(self, kind: str, name: object) -> str:
        names = self.names(kind)
        available = ", ".join(names) if names else "(none registered)"
        hint = did_you_mean(name, names) if isinstance(name, str) else ""
        return f"unknown {KIND_LABELS[kind]} {name!r}{hint}; available: {available}"
