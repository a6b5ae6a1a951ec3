"""``grpo-run init [--task math|tools|custom] [SPEC]``: a commented starter spec that
validates as written, plus the small files it names (a data file, a reward plugin).

The starters are files shipped with the package (``starters/``): ``<task>.yaml`` (the spec,
with ``$spec``, ``$data`` and ``$plugin`` standing for the names of the files written),
``<task>_data.jsonl`` and ``<task>_reward.py`` where the task has them. A test validates and
dry-runs each one as ``init`` writes it.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from string import Template

from grpo_core.errors import UsageError

TASKS = ("math", "tools", "custom")
#: What each task writes beside its spec, by the suffix of the written file's name.
_EXTRAS = {"tools": {"data": "_requests.jsonl", "plugin": "_reward.py"},
           "custom": {"data": "_prompts.jsonl", "plugin": "_reward.py"}}


def _starter(name: str) -> str:
    return (files("grpo_core.cli") / "starters" / name).read_text(encoding="utf-8")


def starter_files(task: str, spec: Path) -> dict[Path, str]:
    """The files ``init`` writes for ``task``: the spec and what it names, by path."""
    if task not in TASKS:
        raise UsageError(f"--task: unknown task {task!r}; choose one of {', '.join(TASKS)}")
    names = {key: f"{spec.stem}{suffix}" for key, suffix in _EXTRAS.get(task, {}).items()}
    out = {spec: Template(_starter(f"{task}.yaml")).substitute(spec=spec.name, **names)}
    if "data" in names:
        out[spec.parent / names["data"]] = _starter(f"{task}_data.jsonl")
    if "plugin" in names:
        out[spec.parent / names["plugin"]] = _starter(f"{task}_reward.py")
    return out


def write_starter(task: str, spec: Path, force: bool = False) -> list[Path]:
    """Write the starter files; refuse (UsageError) to overwrite any unless ``force``."""
    files = starter_files(task, spec)
    existing = [p for p in files if p.exists()]
    if existing and not force:
        raise UsageError(f"init: {', '.join(map(str, existing))} already exist(s); pass --force to overwrite")
    spec.parent.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    return list(files)
