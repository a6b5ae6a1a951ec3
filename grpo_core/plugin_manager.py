"""Loading plugins: the built-ins, installed entry points (group ``grpo``) and local files.

All three sources register on one :class:`pluggy.PluginManager` and fill one
:class:`~grpo_core.registry.Registry`; the built-ins take no shortcut.

Environment switches for installed (external) plugins:

- ``GRPO_LOAD_PLUGINS``: comma-separated entry-point or distribution names to load;
  unset loads all of them, empty loads none (what the test suite does).
- ``GRPO_DISABLED_PLUGINS``: comma-separated names never to load.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import pluggy

from grpo_core import hookspecs
from grpo_core.commands import COMMANDS_HOOK, Command, CommandRegistrar, collect_commands
from grpo_core.errors import PluginError, did_you_mean, fault_text
from grpo_core.kinds import KINDS
from grpo_core.registry import Registrar, Registry
from grpo_core.version import __version__

ENTRY_POINT_GROUP = "grpo"

#: Built-in plugin modules, registered like any other plugin.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "grpo_plugins.advantages.grpo",
    "grpo_plugins.advantages.process",
    "grpo_plugins.advantages.reinforce",
    "grpo_plugins.advantages.passk",
    "grpo_plugins.advantages.gdpo",
    "grpo_plugins.advantages.distillation",
    "grpo_plugins.kl",
    "grpo_plugins.losses.clip",
    "grpo_plugins.losses.trust_region",
    "grpo_plugins.losses.policy_gradient",
    "grpo_plugins.losses.cov",
    "grpo_plugins.losses.off_policy",
    "grpo_plugins.aggregators",
    "grpo_plugins.rollout.hf",
    "grpo_plugins.vllm.colocated",
    "grpo_plugins.vllm.server",
    "grpo_plugins.vllm.serve",
    "grpo_plugins.tinker",
    "grpo_plugins.rewards.answers",
    "grpo_plugins.rewards.format",
    "grpo_plugins.rewards.length",
    "grpo_plugins.rewards.model",
    "grpo_plugins.rewards.remote",
    "grpo_plugins.rewards.code",
    "grpo_plugins.rewards.judge",
    "grpo_plugins.rewards.process",
    "grpo_plugins.rewards.trainable",
    "grpo_plugins.datasets",
    "grpo_plugins.shapes",
    "grpo_plugins.samplers",
    "grpo_plugins.step_splitters",
    "grpo_plugins.launchers.local",
    "grpo_plugins.launchers.ray",
    "grpo_plugins.launchers.slurm",
    "grpo_plugins.trackers.mlflow",
    "grpo_plugins.trackers.console",
    "grpo_plugins.trackers.wandb",
    "grpo_plugins.trackers.tensorboard",
    "grpo_plugins.environments.tools",
    "grpo_plugins.agents.verifiers",
    "grpo_plugins.drivers",
)


@dataclass
class PluginInfo:
    """Where a registered plugin came from."""

    name: str
    source: str  # "builtin", "entry point" or "file"
    distribution: str | None = None
    version: str | None = None
    location: str | None = None
    components: dict[str, list[str]] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)


@dataclass
class Plugins:
    """A loaded plugin manager, what each plugin is, the registry they filled and the
    ``grpo-run`` subcommands they added (by name)."""

    manager: pluggy.PluginManager
    info: dict[str, PluginInfo]
    registry: Registry
    commands: dict[str, Command] = field(default_factory=dict)


def _env_names(var: str) -> set[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _register(pm: pluggy.PluginManager, module: ModuleType, name: str, what: str) -> None:
    try:
        pm.register(module, name=name)
    except ValueError as exc:  # pluggy: name already registered
        raise PluginError(f"{what}: a plugin named '{name}' is already loaded ({exc})") from exc
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{what}: invalid hook implementation: {exc}") from exc


def _load_builtins(pm: pluggy.PluginManager, info: dict[str, PluginInfo], version: str) -> None:
    for modname in DEFAULT_PLUGINS:
        try:
            module = importlib.import_module(modname)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # plugin code is user code: sys.exit() at import is its fault
            raise PluginError(
                f'Error importing plugin "{modname}" (distribution grpo-core): {fault_text(exc)}'
            ) from exc
        _register(pm, module, modname, f'built-in plugin "{modname}"')
        info[modname] = PluginInfo(modname, "builtin", "grpo-core", version)


def _load_entry_points(pm: pluggy.PluginManager, info: dict[str, PluginInfo]) -> None:
    wanted = _env_names("GRPO_LOAD_PLUGINS")
    disabled = _env_names("GRPO_DISABLED_PLUGINS") or set()
    if wanted is not None and not wanted:
        return
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else None
        names = {ep.name} | ({dist} if dist else set())
        if names & disabled or (wanted is not None and not names & wanted):
            continue
        where = f'plugin "{ep.name}" (distribution {dist or "unknown"})'
        try:
            module = ep.load()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # plugin code is user code: sys.exit() at import is its fault
            raise PluginError(f"Error importing {where}: {fault_text(exc)}") from exc
        _register(pm, module, ep.name, where)
        version = ep.dist.version if ep.dist is not None else None
        info[ep.name] = PluginInfo(ep.name, "entry point", dist, version, ep.value)


def _resolve_file(path: Path) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, ValueError) as exc:  # e.g. a NUL byte in the name
        raise PluginError(f"plugin file {str(path)!r} is not a valid path: {exc}") from None


def load_plugin_file(path: Path) -> ModuleType:
    """Import a local plugin file under a module name that depends only on its resolved
    path (``grpo_local_plugins.<stem>_<8 hex digits of its SHA-256>``), the same in
    every process."""
    path = _resolve_file(path)
    if not path.is_file():
        raise PluginError(f"plugin file {path} does not exist")
    modname = f"grpo_local_plugins.{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(modname, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin file {path} cannot be imported (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        sys.modules.pop(modname, None)
        raise
    except BaseException as exc:  # plugin code is user code: sys.exit() at import is its fault
        sys.modules.pop(modname, None)
        raise PluginError(f'Error importing plugin file "{path}": {fault_text(exc)}') from exc
    return module


def _load_files(pm: pluggy.PluginManager, info: dict[str, PluginInfo], files: Iterable[Path]) -> None:
    for path in files:
        path = _resolve_file(path)
        name = str(path)
        if name in info:
            continue
        module = load_plugin_file(path)
        _register(pm, module, name, f'plugin file "{path}"')
        info[name] = PluginInfo(path.name, "file", None, None, name)


def _check_pending(pm: pluggy.PluginManager) -> None:
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        known = [entry.hook for entry in KINDS.values()] + [COMMANDS_HOOK]
        plugin = pm.get_name(exc.plugin) or repr(exc.plugin)
        match = re.search(r"unknown hook '([^']+)'", str(exc))
        hook = match.group(1) if match else "?"
        raise PluginError(
            f"plugin '{plugin}' implements an unknown hook '{hook}'"
            f"{did_you_mean(hook, known)}; known hooks: {', '.join(known)}"
        ) from exc


class _Running:
    """Which plugin's implementation of one hook is running, read off the call stack.

    The hook is called once for all plugins (so pluggy's ``tryfirst``/``trylast`` order
    and ``wrapper`` implementations take effect) with one registrar; each ``add`` is
    credited to the innermost frame that runs one of the hook's implementations.
    """

    def __init__(self, impls: list[pluggy.HookImpl]):
        self._by_code: dict[int, list[pluggy.HookImpl]] = {}  # by id: equal code may come from two files
        for impl in impls:
            function = inspect.unwrap(getattr(impl.function, "__func__", impl.function))
            self._by_code.setdefault(id(getattr(function, "__code__", None)), []).append(impl)

    def plugin_of(self, frames: Iterable[FrameType]) -> str | None:
        """The plugin of the first frame in ``frames`` that runs an implementation."""
        for frame in frames:
            impls = self._by_code.get(id(frame.f_code))
            if impls:  # one function shared by several plugins: its instance or module tells
                owner = frame.f_locals.get("self")
                mine = [i for i in impls if i.plugin is owner or getattr(i.plugin, "__dict__", None) is frame.f_globals]
                return (mine or impls)[0].plugin_name
        return None

    def now(self) -> str:
        """The plugin whose implementation called the registrar."""
        frames = []
        frame = inspect.currentframe()
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        return self.plugin_of(frames) or "?"

    def failed(self, exc: BaseException) -> str:
        """The plugin whose implementation raised ``exc`` (innermost first)."""
        frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
        return self.plugin_of(reversed(frames)) or "?"


def _call_hook(pm: pluggy.PluginManager, hook: str, make_registrar: Callable[[Callable[[], str]], Any]) -> list:
    """Call ``hook`` once for all plugins with one registrar; what they added, in plugin load
    order (built-ins, entry points, files, objects), whatever order pluggy called the
    implementations in: listings and duplicate-name errors do not depend on ``tryfirst``."""
    caller = getattr(pm.hook, hook)
    running = _Running(caller.get_hookimpls())
    registrar = make_registrar(running.now)
    try:
        caller(register=registrar)
    except (PluginError, KeyboardInterrupt):
        raise
    except BaseException as exc:
        raise PluginError(f"plugin '{running.failed(exc)}' failed in {hook}: {fault_text(exc)}") from exc
    load_order = {name: index for index, (name, _) in enumerate(pm.list_name_plugin())}
    return sorted(registrar.added, key=lambda added: load_order.get(added.plugin, len(load_order)))


def _fill_registry(pm: pluggy.PluginManager, info: dict[str, PluginInfo]) -> Registry:
    """Call every ``register_<kind>s`` hook once and add what was registered to one registry."""
    registry = Registry()
    for kind, entry in KINDS.items():
        for component in _call_hook(pm, entry.hook, lambda now, kind=kind: Registrar(kind, now)):
            registry.add(component)
            if component.plugin in info:
                info[component.plugin].components.setdefault(kind, []).append(component.name)
    return registry


def _fill_commands(pm: pluggy.PluginManager, info: dict[str, PluginInfo]) -> dict[str, Command]:
    """Call ``register_commands`` once; the commands by name (a name taken twice, or one of
    grpo-run's own, is a :class:`PluginError` naming both)."""
    found = collect_commands(_call_hook(pm, COMMANDS_HOOK, CommandRegistrar))
    for command in found.values():
        if command.plugin in info:
            info[command.plugin].commands.append(command.name)
    return found


def load_plugins(
    files: Iterable[Path] = (), *, external: bool = True, objects: Iterable[object] = ()
) -> Plugins:
    """A fresh plugin manager with the built-ins, the installed plugins (unless
    ``external`` is False or the environment says otherwise), the given files, and
    plugin ``objects`` (modules or class instances, as tests register inline)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    info: dict[str, PluginInfo] = {}
    _load_builtins(pm, info, __version__)
    if external:
        _load_entry_points(pm, info)
    _load_files(pm, info, files)
    for obj in objects:
        name = getattr(obj, "__name__", None) or type(obj).__name__
        _register(pm, obj, name, f'plugin "{name}"')
        info[name] = PluginInfo(name, "object")
    _check_pending(pm)
    return Plugins(pm, info, _fill_registry(pm, info), _fill_commands(pm, info))
