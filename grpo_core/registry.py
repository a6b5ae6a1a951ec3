"""The registry: which plugin provides which component, by kind and name, and the check
of every built component against its kind's contract (:func:`conform`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from grpo_core.errors import PluginError, did_you_mean
from grpo_core.kinds import KINDS

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclass(frozen=True)
class Component:
    """One registered component.

    Attributes:
        kind: one of :data:`grpo_core.kinds.KINDS`.
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
        """The ready component: ``impl`` itself, or ``impl(options)`` for a factory,
        checked against its kind's contract by :func:`conform`."""
        if self.options is None:
            built = self.impl
        else:
            built = self.impl(options if options is not None else self.options())
        return conform(self.kind, built, f"{KINDS[self.kind].label} '{self.name}' (plugin '{self.plugin}')")


def contract_members(protocol: type) -> tuple[list[str], dict[str, Any]]:
    """The methods a component of ``protocol`` must have (``__call__`` for a callable
    contract), and the optional flags it declares, with their defaults."""
    namespace = vars(protocol)
    methods = [
        name for name, value in namespace.items()
        if callable(value) and (name == "__call__" or not name.startswith("_"))
    ]
    flags = {name: namespace[name] for name in namespace.get("__annotations__", {}) if name in namespace}
    return methods, flags


def _check_flag(where: str, flag: str, value: Any, default: Any) -> None:
    if dataclasses.is_dataclass(default) and not isinstance(value, type(default)):
        raise PluginError(f"{where}: {flag} must be a {type(default).__name__} (grpo_core.contracts), got {value!r}")
    if isinstance(default, bool) and not isinstance(value, bool):
        raise PluginError(f"{where}: {flag} must be True or False, got {value!r}")
    if type(default) is int and (type(value) is not int or value < 0):
        raise PluginError(f"{where}: {flag} must be a whole number, 0 or more, got {value!r}")
    if isinstance(default, tuple) and (
        isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value)
    ):
        raise PluginError(f"{where}: {flag} must be a list of column names, got {value!r}")


class _WithFlags:
    """A component that takes no attributes (a bound method, a builtin), seen through a
    proxy that carries its contract's default flags; everything else is the component's."""

    def __init__(self, component: Any, flags: dict[str, Any]):
        self.__wrapped__ = component  # inspect.signature() follows it
        self.__dict__.update(flags)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)


def conform(kind: str, component: Any, where: str) -> Any:
    """``component`` checked against the contract of ``kind``, with every optional flag
    the contract declares present: the component's own value, else the default.

    The engine can therefore read a flag as a plain attribute of any built component
    (``estimator.needs_step_scores``). A component missing a required method, or with
    a flag of the wrong type, is a :class:`PluginError` (exit 2) naming ``where``
    (the component and its plugin) and the missing member.
    """
    entry = KINDS[kind]
    methods, flags = contract_members(entry.protocol)
    missing = [m for m in methods if not callable(component if m == "__call__" else getattr(component, m, None))]
    if missing:
        needs = "to be callable" if methods == ["__call__"] else ", ".join(methods)
        article = "an" if entry.label[0] in "aeiou" else "a"
        raise PluginError(
            f"{where} does not follow the {entry.contract} contract: missing {', '.join(missing)}; "
            f"{article} {entry.label} needs {needs} (see grpo_core.contracts.{entry.contract})"
        )
    _check_stateful(component, where)
    absent = {flag: default for flag, default in flags.items() if not hasattr(component, flag)}
    for flag, default in flags.items():
        if flag not in absent:
            _check_flag(where, flag, getattr(component, flag), default)
    try:
        for flag, default in absent.items():
            setattr(component, flag, default)
    except (AttributeError, TypeError):
        return _WithFlags(component, absent)
    return component


def _check_stateful(component: Any, where: str) -> None:
    """A component with one of the :class:`~grpo_core.contracts.Stateful` methods has both:
    state saved without a way back (or loaded from nowhere) is lost on resume."""
    has = [m for m in ("state_dict", "load_state_dict") if callable(getattr(component, m, None))]
    if len(has) == 1:
        other = "load_state_dict" if has == ["state_dict"] else "state_dict"
        raise PluginError(
            f"{where} has {has[0]} but no {other}: a component with state across steps needs both "
            "(see grpo_core.contracts.Stateful)"
        )


class Registrar:
    """Handed to every ``register_<kind>s`` hook; records what each plugin registers.

    Args:
        kind: the kind this hook registers.
        plugin: called at each ``add``, it names the plugin whose hook implementation is
            running (the plugin manager finds it on the call stack).
    """

    def __init__(self, kind: str, plugin: Callable[[], str]):
        self.kind = kind
        self._plugin = plugin
        self.added: list[Component] = []

    @property
    def plugin(self) -> str:
        """The plugin registering now."""
        return self._plugin()

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
        plugin = self.plugin
        label = KINDS[self.kind].label
        if not isinstance(name, str) or not _NAME.match(name):
            raise PluginError(
                f"plugin '{plugin}' registered a {label} with an invalid name {name!r}: "
                "names use letters, digits and _ . + - and start with a letter or digit"
            )
        if options is not None:
            if not (isinstance(options, type) and issubclass(options, BaseModel)):
                raise PluginError(
                    f"plugin '{plugin}' registered {label} '{name}' with options={options!r}: "
                    "options must be a pydantic BaseModel subclass (or None)"
                )
            if options.model_config.get("extra") != "forbid":
                raise PluginError(
                    f"plugin '{plugin}' registered {label} '{name}' with options model "
                    f"{options.__name__} that accepts unknown keys: set "
                    "model_config = ConfigDict(extra='forbid') (or subclass grpo_core.options.Options)"
                )
        if description is None:
            doc = (getattr(impl, "__doc__", None) or "").strip()
            description = doc.splitlines()[0] if doc else ""
        self.added.append(Component(self.kind, name, impl, options, plugin, description))


class Registry:
    """Components of every kind, keyed by name."""

    def __init__(self) -> None:
        self._components: dict[str, dict[str, Component]] = {kind: {} for kind in KINDS}

    def add(self, component: Component) -> None:
        """Add ``component``; a name taken in its kind is a :class:`PluginError` naming both plugins."""
        table = self._components[component.kind]
        existing = table.get(component.name)
        if existing is not None:
            label = KINDS[component.kind].label
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
        return f"unknown {KINDS[kind].label} {name!r}{hint}; available: {available}"
