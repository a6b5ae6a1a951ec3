"""Reading a spec: safe YAML, ``--set`` overrides, plugin files, and validation that
reports every problem at once with its YAML path and line."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grpo_core.errors import GrpoError, SpecError, did_you_mean
from grpo_core.plugin_manager import Plugins, load_plugins
from grpo_core.spec.metrics import best_metric_problems
from grpo_core.spec.models import Spec
from grpo_core.spec.resolved import resolved_problems
from grpo_core.spec.slots import field_types, format_path, resolve_slot, resolve_slots, slot_locations


@dataclass
class LoadedSpec:
    """A validated spec with the plugins it was resolved against."""

    spec: Spec
    plugins: Plugins
    path: Path | None
    base_dir: Path
    overrides: tuple[str, ...] = ()
    #: The run's launcher when ``load_spec`` was given one (``grpo-run run --launcher``).
    launcher: Any = None

    @property
    def name(self) -> str:
        return self.spec.run_name or (self.path.stem if self.path else "run")

    def command(self, *extra: str) -> str:
        """The ``grpo-run`` command line that loads this same spec, plus ``extra`` arguments. A
        spec given as a mapping (from Python) has no file: the command names the resolved spec
        its run wrote into the run folder, overrides included."""
        if self.path is None:
            folder = Path(self.spec.train.output_dir or Path("runs") / self.name)
            return shlex.join(["grpo-run", str(folder / "spec.resolved.yaml"), *extra])
        parts = ["grpo-run", str(self.path)]
        for assignment in self.overrides:
            parts += ["--set", assignment]
        return shlex.join([*parts, *extra])


# --------------------------------------------------------------------------- YAML
def _line_map(node: yaml.Node, path: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    out = {} if out is None else out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = path + (key.value,)
            out[child] = key.start_mark.line + 1
            _line_map(value, child, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, value in enumerate(node.value):
            _line_map(value, path + (index,), out)
    return out


#: Bounds on what a spec's YAML may expand to (aliases included): a spec is a few hundred
#: values a few levels deep; these stop alias bombs, alias cycles and deep nesting fast.
MAX_DEPTH = 100
MAX_NODES = 100_000


class _HostileYAML(ValueError):
    """YAML that is well formed but would not be a finite, modest tree of values."""


def _event_depth(text: str) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` from the event stream (PyYAML's composer
    recurses once per level, so it must not see such a document)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise _HostileYAML(
                    f"nested more than {MAX_DEPTH} levels deep (line {event.start_mark.line + 1})"
                )
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_graph(root: yaml.Node) -> None:
    """The composed document with every alias expanded must be a tree of at most
    :data:`MAX_NODES` nodes and :data:`MAX_DEPTH` levels; an alias inside the node it names
    (a cycle) is refused. Iterative, each node visited once."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        key = id(node)
        if leaving:
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            entered.discard(key)
            line = node.start_mark.line + 1
            if size[key] > MAX_NODES:
                raise _HostileYAML(
                    f"its aliases expand to more than {MAX_NODES:,} values (line {line}): an alias bomb?"
                )
            if depth[key] > MAX_DEPTH:
                raise _HostileYAML(f"its aliases nest more than {MAX_DEPTH} levels deep (line {line})")
            continue
        if key in size:
            continue
        entered.add(key)
        stack.append((node, True))
        for kid in _children(node):
            if id(kid) in entered:
                raise _HostileYAML(
                    f"an alias refers to a node that contains it (line {kid.start_mark.line + 1}): "
                    "a cycle, which no spec value can be"
                )
            if id(kid) not in size:
                stack.append((kid, False))


def safe_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """``(data, node)`` from the safe loader, after :func:`_event_depth` and
    :func:`_check_graph`; raises ``yaml.YAMLError`` or :class:`_HostileYAML`."""
    _event_depth(text)
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is None:
        return None, None
    _check_graph(node)
    return yaml.safe_load(text), node


def parse_yaml(text: str, source: str) -> tuple[Any, dict[tuple, int]]:
    """``(data, {path: line})``; YAML is loaded with the safe loader only."""
    try:
        data, node = safe_yaml(text)
    except _HostileYAML as exc:
        raise SpecError([f"refusing this YAML: {exc}"], source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        tag = re.search(r"constructor for the tag '([^']+)'", problem)
        if isinstance(exc, yaml.constructor.ConstructorError) and tag:
            shown = tag.group(1).replace("tag:yaml.org,2002:", "!!")
            raise SpecError(
                [f"YAML tag {shown!r} is not allowed{where}: specs are read with YAML's safe "
                 "loader, which builds only plain data (mappings, lists, strings, numbers, "
                 "booleans, null)"],
                source,
            ) from None
        raise SpecError([f"not valid YAML{where}: {problem}"], source) from None
    return data, (_line_map(node) if node is not None else {})


# --------------------------------------------------------------------------- --set
def _parse_key(key: str) -> tuple:
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ValueError(f"invalid key {key!r}: use dotted names like train.lr or rewards.0.weight")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def apply_override(data: dict, assignment: str) -> tuple:
    """Apply ``path.to.key=value`` (value parsed as YAML) to ``data`` in place.

    Missing sections are created, and index ``len(list)`` appends an item. Returns the
    path that the override set or created, to label its errors ``(--set)``."""
    if "=" not in assignment:
        raise ValueError(f"--set {assignment!r}: expected path.to.key=value")
    key, raw = assignment.split("=", 1)
    path = _parse_key(key.strip())
    try:
        value = safe_yaml(raw)[0] if raw.strip() else ""
    except _HostileYAML as exc:
        raise ValueError(f"--set {key}: refusing the value: {exc}") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(
            f"--set {key}: the value {raw!r} is not valid YAML ({problem}); quote it to pass a string"
        ) from None
    node: Any = data
    created: tuple | None = None  # the outermost section or item this override creates
    for depth, part in enumerate(path[:-1]):
        nxt = path[depth + 1]
        if isinstance(part, int):
            # like the last part, index len(list) appends a new item (rewards.1.name=format)
            if not isinstance(node, list) or part > len(node):
                raise ValueError(f"--set {key}: {format_path(path[:depth])} has no item {part}")
            if part == len(node):
                node.append([] if isinstance(nxt, int) else {})
                created = created or path[: depth + 1]
            node = node[part]
            continue
        if not isinstance(node, dict):
            raise ValueError(f"--set {key}: {format_path(path[:depth])} is not a mapping")
        if node.get(part) is None:
            node[part] = [] if isinstance(nxt, int) else {}
            created = created or path[: depth + 1]
        node = node[part]
    last = path[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last > len(node):
            raise ValueError(f"--set {key}: {format_path(path[:-1])} has no item {last}")
        node[last:last + 1] = [value]
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ValueError(f"--set {key}: {format_path(path[:-1])} is not a mapping")
    return created or path


# --------------------------------------------------------------------------- errors
def _model_at(model: type[BaseModel], loc: Iterable) -> type[BaseModel] | None:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        models = [t for t in field_types(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
        current = models[0] if models else None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _pydantic_problems(exc: ValidationError) -> list[tuple[tuple, str]]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            parent = _model_at(Spec, loc[:-1])
            valid = list(parent.model_fields) if parent else []
            key = str(loc[-1])
            msg = f"unknown key '{key}'{did_you_mean(key, valid)}; valid keys: {', '.join(valid)}"
        elif err["type"] == "missing":
            msg = "required but missing"
        elif err["type"] == "value_error":
            msg = str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
        else:
            msg = f"{err['msg']} (got {_short(err.get('input'))})"
        problems.append((loc, msg))
    return problems


def _raw_slot_problems(data: dict, plugins: Plugins, context: dict) -> list[tuple[tuple, str]]:
    """Phase two on the raw data, used when phase one failed, so that a wrong plugin
    name is reported together with every other problem."""
    problems: list[tuple[tuple, str]] = []
    for path, cls, is_list in slot_locations(Spec):
        for at, node in _raw_nodes(data, path):
            problems.extend(_raw_problems_at(at, node, cls, is_list, plugins, context))
    return problems


def _raw_nodes(data: dict, path: tuple) -> list[tuple[tuple, Any]]:
    """The raw values at ``path`` (``"*"``: every key of a mapping), each with its own path;
    a missing value is None."""
    nodes: list[tuple[tuple, Any]] = [((), data)]
    for part in path:
        nodes = [
            (where + (key,), value)
            for where, node in nodes
            for key, value in ((node.items() if isinstance(node, dict) else []) if part == "*"
                               else [(part, node.get(part) if isinstance(node, dict) else None)])
        ]
    return nodes


def _raw_problems_at(path: tuple, node: Any, cls: type, is_list: bool, plugins: Plugins,
                     context: dict) -> list[tuple[tuple, str]]:
    """Phase two for the raw slot (or list of slots) ``node`` found at ``path``."""
    problems: list[tuple[tuple, str]] = []
    items = list(enumerate(node)) if is_list and isinstance(node, list) else [(None, node)]
    for index, raw in items:
        where = path if index is None else path + (index,)
        if raw is None and index is None:
            raw = {}
        if not isinstance(raw, dict):
            continue
        try:
            slot = cls.model_validate(raw, context=context)
        except ValidationError:  # phase one reported the engine's fields: check the plugin's options still
            slot = _slot_without_engine_fields(cls, raw, context)
            if slot is None:
                continue
        problems.extend(resolve_slot(slot, where, plugins.registry, context))
    return problems


def _slot_without_engine_fields(cls: type, raw: dict, context: dict) -> Any:
    """The slot ``raw`` with its engine fields left at their defaults (one of them is invalid,
    and phase one reported it), so that its plugin's options are validated too: a bad
    ``group_size`` does not hide a bad option of the rollout backend. None when the name
    itself is unusable (phase one reported that)."""
    name = raw.get("name", cls.model_fields["name"].default)
    if not isinstance(name, str):
        return None
    extra = {k: v for k, v in raw.items() if k not in cls.model_fields}
    try:
        return cls.model_validate({"name": name, **extra}, context=context)
    except ValidationError:
        return None


def _format(problems: list[tuple[tuple, str]], lines: dict[tuple, int], overridden: set[tuple]) -> list[str]:
    out, seen = [], set()
    for loc, msg in problems:
        if (loc, msg) in seen:
            continue
        seen.add((loc, msg))
        where = ""
        if any(loc[: len(o)] == o for o in overridden):
            where = " (--set)"
        else:
            for depth in range(len(loc), 0, -1):
                if loc[:depth] in lines:
                    where = f" (line {lines[loc[:depth]]})"
                    break
        out.append(f"spec.{format_path(loc)}{where}: {msg}" if loc else f"spec{where}: {msg}")
    return out


# --------------------------------------------------------------------------- entry point
def load_spec(
    source: str | Path | dict,
    overrides: Iterable[str] = (),
    *,
    plugins: Plugins | None = None,
    external_plugins: bool = True,
    base_dir: Path | None = None,
    launcher: Callable[[Any], Any] | None = None,
) -> LoadedSpec:
    """Read, override, resolve and validate a spec; raise :class:`SpecError` listing every
    problem. ``source`` is a path to a YAML file or an already-parsed mapping, whose relative
    paths resolve from ``base_dir`` (default: the current folder). ``launcher(registry)``,
    when given, builds the run's launcher once the plugins are loaded, before validation:
    the rollout servers it places (its ``rollout_servers``) are in the validation context
    (``rollout_servers``), and it is returned as :attr:`LoadedSpec.launcher`."""
    overrides = tuple(overrides)
    lines: dict[tuple, int] = {}
    if isinstance(source, dict):
        path, data, label = None, source, "(mapping)"
        base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
    else:
        path = Path(source)
        label = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SpecError([f"spec file {path} does not exist"], label) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError([f"cannot read spec file {path}: {exc}"], label) from None
        data, lines = parse_yaml(text, label)
        base_dir = path.resolve().parent
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"spec: the top level must be a mapping of sections, got {type(data).__name__}"], label)

    overridden: set[tuple] = set()
    problems: list[tuple[tuple, str]] = []
    for assignment in overrides:
        try:
            overridden.add(apply_override(data, assignment))
        except ValueError as exc:
            problems.append(((), str(exc)))
    if problems:
        raise SpecError(_format(problems, lines, overridden), label)

    context = {"base_dir": base_dir}
    if plugins is None:
        files = data.get("plugins") or []
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise SpecError(_format([(("plugins",), "must be a list of .py file paths")], lines, overridden), label)
        try:
            plugins = load_plugins([base_dir / f for f in files], external=external_plugins)
        except GrpoError as exc:
            raise SpecError(_format([(("plugins",), str(exc))], lines, overridden), label) from None
    built = launcher(plugins.registry) if launcher is not None else None
    context["rollout_servers"] = built.rollout_servers if built is not None else 0

    try:
        spec = Spec.model_validate(data, context=context)
    except ValidationError as exc:
        problems = _pydantic_problems(exc) + _raw_slot_problems(data, plugins, context)
        raise SpecError(_format(problems, lines, overridden), label) from None
    problems = resolve_slots(spec, plugins.registry, context)
    if not problems:  # these read the resolved components
        problems = resolved_problems(spec)
    problems += best_metric_problems(spec)
    if problems:
        raise SpecError(_format(problems, lines, overridden) + _python_objects_hint(base_dir, problems), label)
    return LoadedSpec(spec, plugins, path, base_dir, tuple(overrides), built)


#: What a run started from Python records of its in-memory components, beside its resolved spec.
PYTHON_OBJECTS = "python_objects.json"


def _python_objects_hint(base_dir: Path, problems: list[tuple[tuple, str]]) -> list[str]:
    """When the spec sits in the folder of a run started from Python (``grpo_core.Trainer``)
    and names a component that was an in-memory object there, say which and how to resume."""
    import json

    try:
        record = json.loads((base_dir / PYTHON_OBJECTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    unknown = " ".join(message for _, message in problems if message.startswith("unknown "))
    needed = []
    for kind, entries in record.items():
        for name, where in entries.items():
            if f"unknown {kind} {name!r}" in unknown:
                origin = where.get("object") or f"{where.get('rows')} rows in memory"
                needed.append(f"{kind} '{name}' ({origin}{', ' + where['file'] if where.get('file') else ''})")
    if not needed:
        return []
    return [f"this run was started from Python with in-memory objects it needs again: {'; '.join(needed)}. "
            "Resume it from Python (grpo_core.Trainer(..., the same objects).train(resume='latest')), or "
            "register them in a plugin file and list it under plugins:"]


class _SpecDumper(yaml.SafeDumper):
    """PyYAML with ``allow_unicode`` writes NEL (U+0085) raw inside single quotes, where
    its reader folds it into a space: strings holding one are double-quoted (escaped)."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = '"' if "\x85" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_SpecDumper.add_representer(str, _represent_str)


def dump_spec(spec: Spec) -> str:
    """The resolved spec, every default filled in, as YAML that loads back unchanged."""
    return yaml.dump(
        spec.model_dump(mode="json"), Dumper=_SpecDumper, sort_keys=False, allow_unicode=True
    )
