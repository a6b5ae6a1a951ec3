"""Every spec key a message names is a key the spec accepts, spelled as a user writes it.

A refusal that says "drop ``rollout.options.dtype``" sends the user to a key that
``grpo-run validate`` then rejects as unknown: the advice fails a second time. This module
reads every string literal and f-string of the engine (``grpo_core/``) and the built-in
plugins (``plugins/``) outside docstrings (error and warning messages, field descriptions,
the TRL door's tables of spec keys), picks out each spec path in it (``section.key``,
``section.sub.key``, ``rewards[].weight``, starting with a top-level section of the spec) and
checks the path against the spec's models: the pydantic sections, and under a slot the slot's
own fields plus the options models of the components registered for its kind (only those
defined in the message's own module, when that module defines any: the hf backend's message
is checked against the hf backend's options).
"""

from __future__ import annotations

import ast
import inspect
import re
import typing
from functools import lru_cache
from pathlib import Path

import pytest
from pydantic import BaseModel

from grpo_core.plugin_manager import load_plugins
from grpo_core.spec.models import Spec
from grpo_core.spec.slots import Slot, field_types

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("grpo_core", "plugins")


def _models(annotation) -> list[type[BaseModel]]:
    return [t for t in field_types(annotation) if isinstance(t, type) and issubclass(t, BaseModel)]


#: The spec's top-level keys that hold sections or slots: only they can start a path.
SECTIONS = sorted(name for name, field in Spec.model_fields.items()
                  if _models(typing.get_args(field.annotation)[1] if typing.get_origin(field.annotation) is dict
                             else field.annotation))

_PART = r"(?:[A-Za-z_]\w*\*?|\*|<[\w ]+>)(?:\[\w*\])?"
_SECTION = "|".join(SECTIONS)
KEY = re.compile(rf"(?<![\w.\-/\x00\\])(?:{_SECTION})(?:\[\w*\])?(?:\.{_PART})+")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
            out.add(id(body[0].value))
    return out


def _texts(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, text)`` of every string literal outside docstrings; an f-string's text has
    NUL where a value is interpolated, so no path is read across one."""
    skip = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = []
            for value in node.values:
                if isinstance(value, ast.Constant):
                    parts.append(str(value.value))
                else:
                    parts.append("\x00")
                    skip.update(id(n) for n in ast.walk(value))  # format specs are no text of their own
                skip.add(id(value))
            out.append((node.lineno, "".join(parts)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            out.append((node.lineno, node.value))
    return out


def named_keys() -> dict[str, list[tuple[Path, int]]]:
    """Every spec path named in the sources, with where it is named."""
    found: dict[str, list[tuple[Path, int]]] = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            for line, text in _texts(ast.parse(path.read_text(), str(path))):
                for match in KEY.finditer(text):
                    found.setdefault(match.group(0), []).append((path, line))
    return found


@lru_cache(maxsize=1)
def _registry():
    return load_plugins(external=False).registry


def _defined_in(obj, path: Path) -> bool:
    try:
        return Path(inspect.getsourcefile(obj)).resolve() == path.resolve()
    except TypeError:
        return False


def _fields(model: type[BaseModel], where: Path | None) -> dict[str, typing.Any]:
    """The keys a user may write under ``model``: a section's fields, or a slot's fields and
    its plugins' options (the plugins defined in ``where`` when there are any)."""
    fields = {name: field.annotation for name, field in model.model_fields.items()}
    if isinstance(model, type) and issubclass(model, Slot):
        components = [c for c in _registry().components(model.kind) if c.options is not None]
        local = [c for c in components if where is not None and (_defined_in(c.options, where)
                                                                 or _defined_in(c.impl, where))]
        for component in local or components:
            for name, field in component.options.model_fields.items():
                fields.setdefault(name, field.annotation)
    return fields


def key_problem(key: str, where: Path | None = None) -> str | None:
    """Why ``key`` is not a path of the spec, or None when it is."""
    parts = [re.sub(r"\[\w*\]$", "", part) for part in key.split(".")]
    models: list[type[BaseModel]] = [Spec]
    index = 0
    while index < len(parts):
        part, here = parts[index], ".".join(parts[:index])
        if not models:
            return f"{here} holds no keys"
        fields: dict[str, typing.Any] = {}
        for model in models:
            fields.update(_fields(model, where))
        if part.endswith("*"):  # rollout.*, train.adam_*: some key there
            stem = part[:-1]
            return None if any(name.startswith(stem) for name in fields) else f"no key of {here} starts with {stem!r}"
        if part not in fields:
            return f"{here} has no key {part!r} (it has: {', '.join(sorted(fields))})"
        annotation = fields[part]
        if typing.get_origin(annotation) is dict:  # eval.sets.<name>.data: the next part is a name
            index += 1
            annotation = typing.get_args(annotation)[1]
        models = _models(annotation)
        index += 1
    return None


def test_the_scan_finds_the_paths_messages_name():
    keys = named_keys()
    assert {"train.mixed_precision", "model.lora", "rollout.max_staleness", "algorithm.kl.beta"} <= set(keys)
    assert "data.source_column" in keys and "eval.sets" in keys
    # a path is read up to an interpolation, never across one: f"rollout.{given[0]}" names no key
    assert not any(key == "rollout" or key.endswith(".") for key in keys)


@pytest.mark.parametrize(("key", "valid"), [
    ("rollout.dtype", True),             # the hf backend's option, as a user writes it
    ("rollout.options.dtype", False),    # the Python attribute, not a spec key
    ("rollout.push_every", True),        # vllm-server's option
    ("rollout.options.push_every", False),
    ("rollout.agent.max_calls", True),   # a slot inside a slot
    ("eval.sets.<name>.data", True),     # a mapping's entry
    ("rewards[].call_timeout", True),
    ("rewards[0].weight", True),
    ("train.adam_*", True),
    ("train.adam_beta", False),
    ("model.lora.r", True),
    ("model.lora.rank", False),
    ("model.path.name", False),          # a path holds no keys
])
def test_key_problem_tells_spec_keys_from_others(key, valid):
    assert (key_problem(key) is None) is valid, key_problem(key)


def test_a_plugins_message_is_checked_against_its_own_options():
    hf = ROOT / "plugins" / "rollout" / "hf.py"
    assert key_problem("rollout.dtype", hf) is None
    assert key_problem("rollout.push_every", hf) is not None  # vllm-server's option, not hf's


def test_every_key_a_message_names_is_a_spec_key():
    wrong = []
    for key, places in sorted(named_keys().items()):
        for path, line in places:
            problem = key_problem(key, path)
            if problem is not None:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {key!r}: {problem}")
    assert not wrong, "messages name keys the spec does not accept:\n" + "\n".join(wrong)


def test_no_message_names_a_slots_options_attribute():
    """``slot.options.dtype`` is where Python code reads a plugin's option; a user writes the
    key in the slot itself (``rollout.dtype``), so no message says ``options.<key>``."""
    attribute = re.compile(r"(?<![\w.])options\.[A-Za-z_]\w*")
    found = [f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}"
             for top in SOURCES for path in sorted((ROOT / top).rglob("*.py"))
             for line, text in _texts(ast.parse(path.read_text(), str(path)))
             for match in attribute.finditer(text)]
    assert not found, "messages name a slot's options attribute instead of its key:\n" + "\n".join(found)
