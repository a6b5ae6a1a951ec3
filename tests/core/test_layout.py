"""The engine's layout rules, read off the source by folder: the actor and the learner never
import each other, the ground beneath them imports neither nor the loop, nothing below the loop
imports it, nothing in the engine imports the command line, the agent server (``endpoint/``)
imports nothing of the engine but its errors, the import graph has no circle, every package's
docstring names its modules, and the engine reaches the built-in plugins only by registering
them."""

from __future__ import annotations

import ast
import inspect
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_core.train.feed import Feed, SyncFeed
from grpo_core.train.pipeline import Pipeline

ENGINE = Path(__file__).resolve().parents[2] / "grpo_core"
PLUGINS = ENGINE.parent / "plugins"


def module_name(path: Path, root: Path = ENGINE, package: str = "grpo_core") -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))


MODULES = {module_name(p): p for p in ENGINE.rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    """The engine modules ``path`` imports, at any depth of the file (lazy imports and
    ``TYPE_CHECKING`` imports included), relative imports resolved; ``from package import
    name`` counts as the module ``package.name`` where that is one, else as ``package``."""
    me = module_name(path)
    here = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
            found.update(subs or [base])
    return {n for n in found if n.split(".")[0] == "grpo_core"}


def role(module: str) -> str:
    """``actor``, ``learner``, ``loop``, ``ground`` (train/'s top), ``cli`` or ``engine``."""
    parts = module.split(".")
    if parts[:2] == ["grpo_core", "cli"]:
        return "cli"
    if parts[:2] != ["grpo_core", "train"] or len(parts) == 2:
        return "engine"
    return parts[2] if parts[2] in ("actor", "learner", "loop") else "ground"


def owner(name: str) -> str:
    """The module an imported name lives in (``grpo_core.train.actor.actor.Actor`` -> its module)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


GRAPH = {m: {owner(n) for n in imports_of(p)} - {m} for m, p in MODULES.items()}

#: For each role, the roles its modules must never import.
FORBIDDEN = {
    "actor": {"learner", "loop", "cli"},
    "learner": {"actor", "loop", "cli"},
    "ground": {"actor", "learner", "loop", "cli"},
    "loop": {"cli"},
    "engine": {"cli"},
}


@pytest.mark.parametrize("side", sorted(FORBIDDEN))
def test_no_module_imports_across_or_above_its_folder(side):
    crossing = {
        module: sorted(d for d in deps if role(d) in FORBIDDEN[side])
        for module, deps in GRAPH.items() if role(module) == side
    }
    assert {m: c for m, c in crossing.items() if c} == {}


def test_the_engine_modules_below_the_loop_except_the_front_never_import_it():
    """Beside train/'s folders, only the doors (the Python trainer, the model export it runs
    and the command line) import the loop."""
    doors = {"grpo_core", "grpo_core.trainer", "grpo_core.docs_gen"}
    reaching = {m for m, deps in GRAPH.items() if role(m) == "engine" and m not in doors
                and any(role(d) == "loop" for d in deps)}
    assert reaching == set()


def test_the_agent_server_imports_nothing_of_training():
    """The OpenAI-compatible server is a package of its own: its modules import one another and
    the engine's errors, nothing else of the engine (no training module, no contract)."""
    server = {m: deps for m, deps in GRAPH.items() if m == "grpo_core.endpoint" or m.startswith("grpo_core.endpoint.")}
    assert set(server) >= {"grpo_core.endpoint.server", "grpo_core.endpoint.streaming",
                           "grpo_core.endpoint.responses_api", "grpo_core.endpoint.toolcalls"}
    allowed = set(server) | {"grpo_core", "grpo_core.errors"}
    assert {m: sorted(deps - allowed) for m, deps in server.items() if deps - allowed} == {}


def test_the_agent_server_runs_with_no_training_module_loaded():
    """Importing the server and serving a request loads no module of ``grpo_core.train`` and no
    torch: it can be tested, and reused, on its own."""
    program = textwrap.dedent("""
        import json, sys, urllib.request
        from types import SimpleNamespace
        from grpo_core.endpoint.server import Endpoint

        def handle(request):
            choice = {"text": "hi", "ids": [1], "logp": [-0.5], "finish": "stop",
                      "message": {"role": "assistant", "content": "hi"}}
            return [choice], 3

        sampling = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0)
        endpoint = Endpoint(handle, lambda key, error: None, sampling, 1_000_000, 4)
        try:
            body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x"}]}).encode()
            request = urllib.request.Request(endpoint.base_url + "/chat/completions", body,
                                             {"Authorization": "Bearer k", "Content-Type": "application/json"})
            answer = json.load(urllib.request.urlopen(request, timeout=30))
        finally:
            endpoint.close()
        assert answer["choices"][0]["message"]["content"] == "hi", answer
        loaded = sorted(m for m in sys.modules if m.startswith("grpo_core.train") or m == "torch")
        print(json.dumps(loaded))
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_import_graph_has_no_circle():
    seen: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for dep in sorted(GRAPH.get(module, ())):
            if seen.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep])
            elif dep not in seen:
                visit(dep, [*path, dep])
        seen[module] = 2

    for module in sorted(GRAPH):
        if module not in seen:
            visit(module, [module])
    assert circles == []


def test_the_rules_see_every_module_of_the_training_engine():
    """Every module under train/ has a role the rules above name (a new folder would be
    checked by nothing)."""
    training = {m for m in MODULES if m == "grpo_core.train" or m.startswith("grpo_core.train.")}
    assert {role(m) for m in training} == {"actor", "learner", "loop", "ground", "engine"}
    assert {m for m in training if role(m) == "engine"} == {"grpo_core.train"}


def _named(doc: str, package: str, name: str) -> bool:
    """Whether ``doc`` names module or sub-package ``name`` of ``package``: as ``name``,
    ``name.py`` or ``name/`` in double backquotes, or as a :mod: reference to it."""
    return bool(re.search(rf"``{name}(\.py|/)?``|:mod:`~?{re.escape(package)}\.{name}`", doc))


PACKAGES = sorted([*ENGINE.rglob("__init__.py"), *PLUGINS.rglob("__init__.py")])


@pytest.mark.parametrize("init", PACKAGES, ids=lambda p: str(p.parent.relative_to(ENGINE.parent)))
def test_every_package_docstring_names_each_of_its_modules(init):
    """A package's ``__init__`` docstring names every module and sub-package it holds; the
    built-in plugins' front (``plugins/__init__.py``, a map of the families) names every
    module under it, at any depth."""
    folder = init.parent
    package = module_name(init) if folder.is_relative_to(ENGINE) else module_name(init, PLUGINS, "grpo_plugins")
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    deep = folder == PLUGINS
    files = folder.rglob("*.py") if deep else folder.glob("*.py")
    held = {p.stem for p in files if p.stem not in ("__init__", "__main__")}
    held |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    missing = sorted(name for name in held if not _named(doc, package, name)
                     and not (deep and any(_named(doc, f"{package}.{sub}", name) for sub in held)))
    assert missing == [], f"{init.relative_to(ENGINE.parent)}: its docstring does not name {missing}"


def raw_imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, as written (absolute imports only)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


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
        str(path.relative_to(ENGINE)): sorted(n for n in raw_imports(path) if n.split(".")[0] == "grpo_plugins")
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
