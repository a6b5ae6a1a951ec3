"""Training from Python: :class:`Trainer`, a thin object over the spec the CLI validates and
the loop the CLI runs.

A notebook builds it from a spec (a YAML path, a mapping, or a validated
:class:`~grpo_core.spec.Spec`) plus overrides, and hands it what lives in memory: reward
callables (TRL's signature, sync or ``async``), datasets (``datasets.Dataset``, a list of
dicts, a pandas DataFrame), an environment, trackers, a loaded model and tokenizer, and
callbacks. Each object is registered under a name in the same registry as the plugins, so the
spec names it, validation checks it (an object that breaks its contract is refused by name) and the
run folder records it (``python_objects.json``, beside the resolved spec), so that
``grpo-run --resume`` can say what a run started here needs.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core.errors import PluginError, UsageError, fault_text, plugin_origin
from grpo_core.hookspecs import hookimpl
from grpo_core.spec.loader import PYTHON_OBJECTS

#: The registered name of the in-memory training dataset; eval sets are ``python.<set>``.
DATASET = "python"
#: The registered name of the in-memory SFT demonstrations (``sft_dataset``).
SFT_DATASET = "python.sft"


@dataclass
class TrainResult:
    """What :meth:`Trainer.train` returns.

    ``metrics``: the last step's metrics with the last evaluation's; ``history``: one dict per
    step (its ``step`` included); ``evaluations``: each held-out evaluation, with its ``step``;
    ``status``: ``finished``, ``stopped`` (a callback asked), or ``interrupted`` (Ctrl-C or
    SIGTERM: the last completed step is checkpointed, ``train(resume="latest")`` continues);
    ``final_model``: the saved model folder (None unless finished or stopped); ``checkpoints``:
    the run's checkpoint folders, oldest first; ``run_dir``: the run folder."""

    status: str
    step: int
    metrics: dict[str, float]
    history: list[dict[str, float]]
    evaluations: list[dict[str, float]]
    final_model: Path | None
    checkpoints: list[Path]
    run_dir: Path


class Callback:
    """A base for callbacks: override any of the three. ``on_step`` and ``on_eval`` may return
    True to stop training after this step (the run then finishes: final evaluation,
    checkpoint and model, as at its last step). A plain function passed as a callback is its
    ``on_step``."""

    def on_step(self, step: int, metrics: dict[str, float]) -> bool | None:
        """After step ``step`` (counted from 1) with its logged metrics."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> bool | None:
        """After a held-out evaluation at step ``step`` (0: before training)."""

    def on_save(self, step: int, folder: Path) -> None:
        """After the checkpoint of step ``step`` was written to ``folder``."""


# --------------------------------------------------------------------------- in-memory objects
class MemoryDataset:
    """Rows held in memory: ``train`` rows, and ``eval`` rows (empty when none were given)."""

    def __init__(self, train: list[dict] | Any, eval_rows: list[dict] | None = None):
        self.train, self.eval = train, eval_rows or []  # train: rows, or a RowStream

    def load(self, split: str) -> list[dict[str, Any]] | Any:
        if split == "train" and not isinstance(self.train, list):
            return self.train
        return list(self.train if split == "train" else self.eval)


def as_rows(data: Any, what: str) -> list[dict[str, Any]]:
    """``data`` (a ``datasets.Dataset``, a pandas DataFrame, or an iterable of dicts) as a list
    of row dicts; a clear error naming ``what`` for anything else."""
    if data is None:
        return []
    if type(data).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise UsageError(f"{what}: got a {type(data).__name__} with splits {list(data)}; pass one split, "
                         f"e.g. {what}=ds['train']")
    if type(data).__name__ == "IterableDataset":
        raise UsageError(f"{what}: an IterableDataset streams rows, and only train_dataset may stream (held-out "
                         "rows and demonstrations are held in memory); materialize it first, e.g. "
                         "datasets.Dataset.from_list(list(ds.take(N)))")
    if hasattr(data, "to_list"):  # datasets.Dataset
        rows = data.to_list()
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas.DataFrame
        rows = data.to_dict("records")
    elif isinstance(data, Iterable) and not isinstance(data, (str, bytes, Mapping)):
        rows = list(data)
    else:
        raise UsageError(f"{what}: expected a datasets.Dataset, a pandas DataFrame or a list of dicts, "
                         f"got {type(data).__name__}")
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, Mapping)), None)
    if bad is not None:
        raise UsageError(f"{what}: row {bad} is a {type(rows[bad]).__name__}, not a dict of columns")
    return [dict(row) for row in rows]


def _train_rows(data: Any) -> list[dict[str, Any]] | Any:
    """The training rows, or a :class:`~grpo_core.contracts.RowStream` for data that streams (a
    ``datasets.IterableDataset``, a function returning an iterator of rows, a generator)."""
    from grpo_core.contracts import RowStream

    stream = RowStream.of(data, "train_dataset")
    return stream if stream is not None else as_rows(data, "train_dataset")


def _name_of(obj: Any, what: str) -> str:
    name = getattr(obj, "__name__", None) or type(obj).__name__
    if name == "<lambda>" or not name.replace("_", "a").replace("-", "a").replace(".", "a").isalnum():
        raise UsageError(f"{what}: {obj!r} has no usable name; pass it as (name, object) or {{name: object}}")
    return name


def _named(items: Any, what: str) -> list[tuple[str, Any]]:
    """``items`` (an object, a list of objects or (name, object) pairs, or a name -> object
    mapping) as ``(name, object)`` pairs."""
    if items is None:
        return []
    if isinstance(items, Mapping):
        return [(str(k), v) for k, v in items.items()]
    if not isinstance(items, (list, tuple)) or (isinstance(items, tuple) and len(items) == 2
                                                and isinstance(items[0], str) and not isinstance(items[1], str)):
        items = [items]
    out = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append(item)
        else:
            out.append((item if isinstance(item, str) else _name_of(item, what), item))
    return out


def _where(obj: Any) -> dict[str, Any]:
    """How a run folder records an in-memory object: its qualified name and source file."""
    target = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    try:
        source = inspect.getsourcefile(target)
    except TypeError:
        source = None
    return {"object": f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(obj).__name__)}",
            "file": source}


@dataclass
class _Objects:
    """The in-memory components of one trainer, as a plugin registering them by name."""

    __name__ = "grpo_core.Trainer"
    rewards: list[tuple[str, Callable]] = field(default_factory=list)
    datasets: dict[str, MemoryDataset] = field(default_factory=dict)
    environments: list[tuple[str, Any]] = field(default_factory=list)
    agents: list[tuple[str, Any]] = field(default_factory=list)
    trackers: list[tuple[str, Any]] = field(default_factory=list)

    @hookimpl
    def register_reward_functions(self, register) -> None:
        for name, fn in self.rewards:
            register.add(name, fn, description="a Python callable passed to grpo_core.Trainer")

    @hookimpl
    def register_datasets(self, register) -> None:
        for name, dataset in self.datasets.items():
            register.add(name, dataset, description="rows passed to grpo_core.Trainer")

    @hookimpl
    def register_environments(self, register) -> None:
        for name, env in self.environments:
            register.add(name, env, description="an environment passed to grpo_core.Trainer")

    @hookimpl
    def register_agents(self, register) -> None:
        for name, agent in self.agents:
            register.add(name, agent, description="an agent passed to grpo_core.Trainer")

    @hookimpl
    def register_trackers(self, register) -> None:
        for name, tracker in self.trackers:
            register.add(name, tracker, description="a tracker passed to grpo_core.Trainer")

    def record(self) -> dict[str, Any]:
        """What ``python_objects.json`` says: each in-memory component by kind and name."""
        out: dict[str, Any] = {}
        if self.rewards:
            out["reward function"] = {n: _where(fn) for n, fn in self.rewards}
        if self.datasets:
            out["dataset"] = {n: {"rows": len(d.train) if isinstance(d.train, list) else "stream",
                                  "eval_rows": len(d.eval)} for n, d in self.datasets.items()}
        if self.environments:
            out["environment"] = {n: _where(e) for n, e in self.environments}
        if self.agents:
            out["agent"] = {n: _where(a) for n, a in self.agents}
        if self.trackers:
            out["tracker"] = {n: _where(t) for n, t in self.trackers}
        return out


def _own_fields(section: Any, model: str) -> dict[str, Any]:
    """The keys of a slot's data that belong to the slot itself (``prompt_column``...), not to
    the plugin it names: what stays when an in-memory object replaces that plugin."""
    from grpo_core.spec import episodes, models

    if not isinstance(section, Mapping):
        return {}
    fields = getattr(models if hasattr(models, model) else episodes, model).model_fields
    return {k: v for k, v in section.items() if k in fields and k != "name"}


def _hooks(callbacks: Any):
    from grpo_core.train.loop.state import Hooks

    items = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    for cb in items:
        if not (callable(cb) or any(hasattr(cb, m) for m in ("on_step", "on_eval", "on_save"))):
            raise UsageError(f"callbacks: {cb!r} has none of on_step, on_eval, on_save and is not callable")

    def each(method: str, *args) -> bool:
        stop = False
        for cb in items:
            fn = getattr(cb, method, None) or (cb if method == "on_step" and callable(cb) else None)
            if fn is not None:
                stop = bool(fn(*args)) or stop
        return stop

    return Hooks(on_step=lambda s, m: each("on_step", s, m), on_eval=lambda s, m: each("on_eval", s, m),
                 on_save=lambda s, f: each("on_save", s, f))


# --------------------------------------------------------------------------- the trainer
class Trainer:
    """Train a causal LM with GRPO from Python; see the module doc and ``docs/python-api.md``.

    Args:
        spec: a YAML path, a mapping, a validated :class:`~grpo_core.spec.Spec`, or None (all
            defaults; then give ``model``).
        overrides: ``{"train.lr": 1e-5}`` or ``["train.lr=1e-5"]``, as ``--set`` on the CLI.
        model: a transformers causal LM to train (in place) instead of loading ``model.path``;
            its ``name_or_path`` is recorded as ``model.path``.
        tokenizer: its tokenizer (required with ``model`` unless ``model.path`` loads one).
        reward_funcs: callables with TRL's signature ``f(prompts, completions, **columns)``
            (sync or ``async``), names of registered reward functions, ``(name, callable)``
            pairs or a ``{name: callable}`` mapping. Without a ``rewards`` key in the spec they
            are its rewards; with one, any the spec does not name are added to it.
        reward_weights: one weight per entry of ``reward_funcs`` (default 1.0 each).
        train_dataset: the training rows (``datasets.Dataset``, DataFrame, list of dicts), or rows
            that stream (a ``datasets.IterableDataset``, a function of no arguments returning an
            iterator of rows, a generator: read once, so one epoch); replaces the spec's dataset,
            keeping its ``data`` options (prompt column, ...).
        eval_dataset: the held-out rows, or ``{name: rows}`` for named sets (``eval.sets``).
        environment: a multi-turn environment object (``rollout.environment``; with
            ``rollout.routing``, registered under its class name for a route to name).
        agent: an agent (a function or coroutine function of a
            :class:`~grpo_core.contracts.AgentEpisode`) that runs each episode against the
            OpenAI-compatible endpoint the run serves (``rollout.agent``; with ``rollout.routing``,
            registered under its name for a route to name).
        sft_dataset: demonstrations for the SFT stage before GRPO (``sft``; rows as train_dataset's,
            with a prompt and a completion column, or a messages column); replaces the dataset of
            ``sft.data``, keeping its options; adds an ``sft`` section with its defaults when the
            spec has none.
        sft_eval_dataset: held-out demonstrations (the SFT stage's held-out loss).
        trackers: tracker objects, added to the spec's ``tracking``.
        callbacks: :class:`Callback` objects or functions (``on_step``).
        plugins: further plugin objects or modules (classes with ``@hookimpl`` methods).
    """

    def __init__(self, spec: Any = None, overrides: Mapping[str, Any] | Iterable[str] | None = None, *,
                 model: Any = None, tokenizer: Any = None, reward_funcs: Any = None,
                 reward_weights: list[float] | None = None, train_dataset: Any = None, eval_dataset: Any = None,
                 environment: Any = None, agent: Any = None, trackers: Any = None, callbacks: Any = None,
                 plugins: Iterable = (), sft_dataset: Any = None, sft_eval_dataset: Any = None):
        self.model, self.tokenizer = model, tokenizer
        self.hooks = _hooks(callbacks)
        self._objects = _Objects()
        self._extra_plugins = list(plugins)
        self._run = None
        data, self._path, base_dir = _source(spec)
        self._patch(data, reward_funcs, reward_weights, train_dataset, eval_dataset, environment, trackers)
        if sft_dataset is not None:
            self._objects.datasets[SFT_DATASET] = MemoryDataset(as_rows(sft_dataset, "sft_dataset"),
                                                               as_rows(sft_eval_dataset, "sft_eval_dataset"))
            sft = data.get("sft") if isinstance(data.get("sft"), Mapping) else {}
            data["sft"] = {**sft, "data": {**_own_fields(sft.get("data"), "DataSlot"), "name": SFT_DATASET}}
        elif sft_eval_dataset is not None:
            raise UsageError("sft_eval_dataset without sft_dataset: pass both")
        if agent is not None:  # under rollout.routing, registered for the routes to name
            name = _name_of(agent, "agent")
            self._objects.agents.append((name, agent))
            rollout = data.setdefault("rollout", {})
            if rollout.get("routing") is None:
                rollout["agent"] = {**_own_fields(rollout.get("agent"), "AgentSlot"), "name": name}
        self.loaded = _load(data, _override_list(overrides), [self._objects, *self._extra_plugins], self._path,
                            base_dir)

    # ----------------------------------------------------------------- the spec
    @property
    def spec(self):
        """The validated spec this trainer runs."""
        return self.loaded.spec

    @property
    def run_dir(self) -> Path:
        from grpo_core.checkpoint import run_folder

        return run_folder(self.loaded)

    def _patch(self, data: dict, reward_funcs, reward_weights, train_dataset, eval_dataset, environment,
               trackers) -> None:
        """Register the in-memory objects and name them in the spec data."""
        if self.model is not None:
            model = data.setdefault("model", {})
            if not model.get("path") and not model.get("package"):
                model["path"] = str(getattr(self.model, "name_or_path", "") or "python-model")
        rewards = _named(reward_funcs, "reward_funcs")
        if reward_weights is not None and len(reward_weights) != len(rewards):
            raise UsageError(f"reward_weights has {len(reward_weights)} entries for {len(rewards)} reward_funcs")
        if rewards:
            listed = data.get("rewards")
            entries = list(listed) if isinstance(listed, list) else []
            named = {e.get("name") if isinstance(e, Mapping) else e for e in entries}
            for i, (name, fn) in enumerate(rewards):
                if not isinstance(fn, str):
                    self._objects.rewards.append((name, fn))
                if name not in named or listed is None:
                    entries.append({"name": name, "weight": reward_weights[i] if reward_weights else 1.0})
            data["rewards"] = entries
        eval_sets = eval_dataset if isinstance(eval_dataset, Mapping) else None
        if train_dataset is not None:
            default_eval = None if eval_sets is not None else eval_dataset
            self._objects.datasets[DATASET] = MemoryDataset(_train_rows(train_dataset),
                                                           as_rows(default_eval, "eval_dataset"))
            data["data"] = {**_own_fields(data.get("data"), "DataSlot"), "name": DATASET}
        elif eval_dataset is not None and eval_sets is None:
            raise UsageError("eval_dataset without train_dataset: pass both, or name the eval rows as a set "
                             "(eval_dataset={'name': rows}) beside the spec's dataset")
        for set_name, rows in (eval_sets or {}).items():
            registered = f"{DATASET}.{set_name}"
            self._objects.datasets[registered] = MemoryDataset(as_rows(rows, f"eval_dataset['{set_name}']"))
            prompt_column = data.get("data", {}).get("prompt_column", "prompt")
            data.setdefault("eval", {}).setdefault("sets", {})[set_name] = {
                "data": {"name": registered, "prompt_column": prompt_column}, "split": "train"}
        routed = isinstance(data.get("rollout"), Mapping) and data["rollout"].get("routing") is not None
        if environment is not None:  # under rollout.routing, registered for the routes to name
            name = _name_of(environment, "environment")
            self._objects.environments.append((name, environment))
            if not routed:
                rollout = data.setdefault("rollout", {})
                rollout["environment"] = {**_own_fields(rollout.get("environment"), "EnvironmentSlot"), "name": name}
        for name, tracker in _named(trackers, "trackers"):
            self._objects.trackers.append((name, tracker))
            data["tracking"] = [*(data.get("tracking") or []), {"name": name}] if "tracking" in data else [
                {"name": name}]

    # ----------------------------------------------------------------- running
    def _build(self):
        from grpo_core.train.loop.assemble import build_run

        return build_run(self.loaded, model=self.model, tokenizer=self.tokenizer)

    def train(self, resume: str | None = None, *, overwrite: bool = False) -> TrainResult:
        """Train as the spec says. ``resume``: ``"latest"`` or a checkpoint folder, to continue
        a run of this folder; ``overwrite``: start afresh in a folder that holds another run
        (its files are moved aside). Raises the errors the CLI prints (a
        :class:`~grpo_core.errors.GrpoError` with the same message); never exits the process."""
        from grpo_core.checkpoint import claim_run_folder, list_checkpoints
        from grpo_core.runlock import hold_run_folder
        from grpo_core.train.loop.run import run_loop

        history: list[dict[str, float]] = []
        evaluations: list[dict[str, float]] = []
        user = self.hooks

        def on_step(step, metrics):
            history.append({"step": step, **metrics})
            return user.on_step(step, metrics)

        def on_eval(step, metrics):
            evaluations.append({"step": step, **metrics})
            return user.on_eval(step, metrics)

        from grpo_core.train.loop.state import Hooks

        hooks = Hooks(on_step=on_step, on_eval=on_eval, on_save=user.on_save)
        folder = self.run_dir
        main_process = os.environ.get("RANK", "0") in ("", "0")
        with hold_run_folder(folder) if main_process else contextlib.nullcontext():
            if resume is None:
                claim_run_folder(folder, overwrite, move=main_process)
            with _plugin_exits():
                self._run = run = self._build()
                if main_process:
                    self._write_record(folder)
                outcome = run_loop(run, self.loaded, resume, hooks, checkpoint_on_interrupt=True)
        status = {None: "finished", "callback": "stopped"}.get(outcome.stopped_by, "interrupted")
        final = folder / "final"
        last = {**(history[-1] if history else {}), **run.last_eval}
        last.pop("step", None)
        return TrainResult(status, run.step, last, history, evaluations,
                           final if status != "interrupted" and final.is_dir() else None,
                           list_checkpoints(folder / "checkpoints"), folder)

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics of the current policy (the trained one after :meth:`train`, else
        the spec's model), as the run logs them (``eval/...``)."""
        from grpo_core.train.loop.run import evaluate_run

        with _plugin_exits():
            if self._run is None:
                self._run = self._build()
            return evaluate_run(self._run)

    def save(self, folder: str | Path | None = None) -> Path:
        """Save the current policy and tokenizer (a LoRA adapter under LoRA) to ``folder``
        (default ``<run folder>/final``); return it."""
        if self._run is None:
            raise UsageError("nothing to save yet: call train() (or evaluate()) first")
        return self._run.save_model(Path(folder) if folder is not None else self.run_dir / "final")

    def _write_record(self, folder: Path) -> None:
        record = self._objects.record()
        path = folder / PYTHON_OBJECTS
        if record:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        elif path.exists():
            path.unlink()


@contextlib.contextmanager
def _plugin_exits():
    """``sys.exit()`` in plugin code becomes the error the CLI prints, naming where it was
    called, instead of ending the notebook's process."""
    try:
        yield
    except SystemExit as exc:
        raise PluginError(f"{fault_text(exc)} in plugin code{plugin_origin(exc)}") from exc


# --------------------------------------------------------------------------- the spec's source
def _source(spec: Any) -> tuple[dict, Path | None, Path]:
    """The spec data (a fresh mapping to patch), its file, and the folder paths resolve from."""
    from grpo_core.spec import LoadedSpec, Spec
    from grpo_core.spec.loader import parse_yaml

    if spec is None:
        return {}, None, Path.cwd()
    if isinstance(spec, LoadedSpec):
        return spec.spec.model_dump(mode="json"), spec.path, spec.base_dir
    if isinstance(spec, Spec):
        return spec.model_dump(mode="json"), None, Path.cwd()
    if isinstance(spec, Mapping):
        return json.loads(json.dumps(dict(spec))), None, Path.cwd()
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            from grpo_core.errors import SpecError

            raise SpecError([f"spec file {path} cannot be read: {exc}"], str(path)) from None
        data, _ = parse_yaml(text, str(path))
        return (data or {}), path, path.resolve().parent
    raise UsageError(f"spec: expected a YAML path, a mapping or a Spec, got {type(spec).__name__}")


def _override_list(overrides: Mapping[str, Any] | Iterable[str] | None) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    if isinstance(overrides, str):
        return [overrides]
    return list(overrides)


def _load(data: dict, overrides: list[str], objects: list, path: Path | None, base_dir: Path):
    """Validate ``data`` against the built-ins, the entry points, the spec's plugin files and
    the trainer's objects; ``path`` is kept for the resume command."""
    from grpo_core.errors import GrpoError, SpecError
    from grpo_core.plugin_manager import load_plugins
    from grpo_core.spec import load_spec

    files = data.get("plugins") or []
    label = str(path) if path is not None else "(mapping)"
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise SpecError(["spec.plugins: must be a list of .py file paths"], label)
    try:
        plugins = load_plugins([base_dir / f for f in files], objects=objects)
    except GrpoError as exc:
        raise SpecError([f"spec.plugins: {exc}"], label) from None
    loaded = load_spec(data, overrides, plugins=plugins, base_dir=base_dir)
    loaded.path = path
    return loaded


__all__ = ["Callback", "MemoryDataset", "TrainResult", "Trainer", "as_rows"]
