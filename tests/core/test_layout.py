"""The engine's layout rules, read off the source: the actor and the learner meet only in
the value that crosses between them, both feeds offer the loop the same methods, and the
engine reaches the built-in plugins only by registering them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from grpo_core.train.feed import Feed, SyncFeed
from grpo_core.train.pipeline import Pipeline

ENGINE = Path(__file__).resolve().parents[2] / "grpo_core"

#: The actor's side of the seam (what collects experience, in the caller's thread or its own)
#: and the learner's (what turns experience into optimizer steps).
ACTOR_SIDE = {"actor", "rollout", "scoring", "episodes", "baseline", "pipeline", "feed"}
LEARNER_SIDE = {"learner", "update", "kl", "teacher", "correction", "optim", "lean_adamw", "parallel", "sharding",
                "logprobs"}


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (lazy imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def train_modules(names: set[str]) -> set[str]:
    return {n.split(".")[2] for n in names if n.startswith("grpo_core.train.") and len(n.split(".")) > 2}


@pytest.mark.parametrize(("side", "other"), [(ACTOR_SIDE, LEARNER_SIDE), (LEARNER_SIDE, ACTOR_SIDE)])
def test_neither_side_of_the_seam_imports_the_other(side, other):
    crossing = {
        module: sorted(train_modules(imports_of(ENGINE / "train" / f"{module}.py")) & other) for module in side
    }
    assert {m: c for m, c in crossing.items() if c} == {}


def test_the_experience_module_imports_neither_side():
    mine = train_modules(imports_of(ENGINE / "train" / "experience.py"))
    assert not mine & (ACTOR_SIDE | LEARNER_SIDE)


def test_both_feeds_offer_the_loop_the_same_methods():
    wanted = {name for name, _ in inspect.getmembers(Feed, inspect.isfunction) if not name.startswith("_")}
    assert wanted == {"start", "take", "publish", "at_rest", "stop", "close"}
    for feed in (SyncFeed, Pipeline):
        for name in wanted:
            ours, theirs = inspect.signature(getattr(feed, name)), inspect.signature(getattr(Feed, name))
            assert list(ours.parameters) == list(theirs.parameters), (feed.__name__, name)


def test_no_engine_module_imports_a_built_in_plugin():
    """The engine names the built-ins only to register them (``DEFAULT_PLUGINS``, strings)."""
    offenders = {
        str(path.relative_to(ENGINE)): sorted(n for n in imports_of(path) if n.split(".")[0] == "grpo_plugins")
        for path in ENGINE.rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_every_package_is_listed_for_the_wheel():
    """pyproject.toml lists the packages a wheel holds: every folder with an ``__init__.py``
    under grpo_core/ and plugins/ (installed as grpo_plugins), and nothing else. An editable
    install finds an unlisted sub-package anyway; a wheel would ship without it."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    root = ENGINE.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("grpo_core", "grpo_core"), ("plugins", "grpo_plugins")):
        for init in (root / top).rglob("__init__.py"):
            parts = init.parent.relative_to(root / top).parts
            found.add(".".join((name, *parts)))
    assert listed == found
