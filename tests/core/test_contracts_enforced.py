"""Contracts are enforced when a component is built: a component missing a member of its
kind's contract is refused with exit 2 naming the plugin and the member, and every built
component carries its contract's optional flags (its own value, else the default)."""

from __future__ import annotations

import contextlib
import inspect
import io
import textwrap

import pytest
import torch

from grpo_core import hookimpl
from grpo_core.cli import main
from grpo_core.contracts import AdvantageInputs, RolloutCapabilities
from grpo_core.errors import PluginError
from grpo_core.kinds import KINDS
from grpo_core.plugin_manager import load_plugins
from grpo_core.registry import conform, contract_members


class NoSyncBackend:
    """A rollout backend without sync_weights."""

    def setup(self, run): ...

    def generate(self, prompt_ids, group_size, sampling): ...


class NoLoadDataset:
    """A dataset without load."""

    def rows(self, split): ...


class NoObserveSampler:
    """A prompt sampler that does not hear back the rewards."""

    def start(self, rows, seed): ...

    def draw(self, n): ...

    def state_dict(self): ...

    def load_state_dict(self, state): ...


class NoFinishTracker:
    """A tracker without finish."""

    def start(self, run_name, resume_id=None): ...

    def log_params(self, params): ...

    def log_metrics(self, metrics, step): ...

    def log_artifact(self, path): ...

    def log_table(self, name, rows, step): ...


class NoStepEnvironment:
    """An environment without step."""

    tools: list = []
    stop: tuple = ()

    def reset(self, row): ...


class NoLaunchLauncher:
    """A launcher without launch."""

    def start(self, run, spec): ...


class NoRunDriver:
    def setup(self, run): ...

    def tools_for(self, row): return []


NOT_CALLABLE = object()

#: kind -> (a component missing a member, the member named in the refusal)
BROKEN = {
    "advantage_estimator": (NOT_CALLABLE, "__call__"),
    "kl_penalty": (NOT_CALLABLE, "__call__"),
    "policy_loss": (NOT_CALLABLE, "__call__"),
    "loss_aggregator": (NOT_CALLABLE, "__call__"),
    "rollout_backend": (NoSyncBackend(), "sync_weights"),
    "reward_function": (NOT_CALLABLE, "__call__"),
    "dataset": (NoLoadDataset(), "load"),
    "prompt_sampler": (NoObserveSampler(), "observe"),
    "step_splitter": (NOT_CALLABLE, "__call__"),
    "tracker": (NoFinishTracker(), "finish"),
    "environment": (NoStepEnvironment(), "step"),
    "agent": (NOT_CALLABLE, "__call__"),
    "launcher": (NoLaunchLauncher(), "launch"),
    "episode_driver": (NoRunDriver(), "run"),
}


def inline(name: str, kind: str, component_name: str, component, **options):
    """An inline plugin class ``name`` registering ``component`` as ``component_name``."""
    hook = KINDS[kind].hook

    def register(self, register):
        register.add(component_name, component, **options)

    return type(name, (), {hook: hookimpl(register)})()


def test_every_kind_has_a_broken_example():
    assert set(BROKEN) == set(KINDS)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_component_missing_a_member_of_its_contract_is_refused_at_build(kind):
    component, member = BROKEN[kind]
    plugins = load_plugins(external=False, objects=[inline("Broken", kind, "broken", component)])
    found = plugins.registry.get(kind, "broken")  # registering is fine: factories build later
    with pytest.raises(PluginError) as info:
        found.build()
    message = str(info.value)
    assert info.value.exit_code == 2
    assert f"{KINDS[kind].label} 'broken' (plugin 'Broken')" in message
    assert f"missing {member}" in message and KINDS[kind].contract in message


def test_a_factory_building_a_broken_component_is_refused_too():
    from grpo_core.options import Options

    class Empty(Options):
        pass

    plugins = load_plugins(
        external=False,
        objects=[inline("Fac", "rollout_backend", "nosync", lambda options: NoSyncBackend(), options=Empty)],
    )
    with pytest.raises(PluginError, match=r"rollout backend 'nosync' \(plugin 'Fac'\).*missing sync_weights"):
        plugins.registry.get("rollout_backend", "nosync").build()


def test_the_run_refuses_a_backend_without_sync_weights_with_exit_2(tmp_path, write_spec):
    (tmp_path / "nosync.py").write_text(textwrap.dedent('''\
        from grpo_core import hookimpl

        class NoSync:
            def setup(self, run): ...
            def generate(self, prompt_ids, group_size, sampling): ...

        @hookimpl
        def register_rollout_backends(register):
            register.add("nosync", NoSync())
        '''), encoding="utf-8")
    spec = write_spec(tmp_path, rollout={"name": "nosync"}, plugins=["nosync.py"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(spec)])
    assert code == 2, err.getvalue()
    plugin = str((tmp_path / "nosync.py").resolve())
    assert f"rollout backend 'nosync' (plugin '{plugin}')" in err.getvalue()
    assert "missing sync_weights" in err.getvalue() and "Traceback" not in err.getvalue()
    assert not list((tmp_path / "out").glob("checkpoint*"))  # nothing trained


# --------------------------------------------------------------------------- flags
def test_contracts_declare_the_flags_the_engine_reads_with_defaults():
    flags = {kind: contract_members(entry.protocol)[1] for kind, entry in KINDS.items()}
    assert flags["advantage_estimator"] == {"needs_step_scores": False, "needs_greedy_baseline": False,
                                            "teacher": None}
    assert flags["policy_loss"] == {"zero_advantage_is_zero_loss": False}
    assert flags["reward_function"] == {"required_columns": ()}
    assert flags["launcher"] == {"rollout_servers": 0}
    assert contract_members(KINDS["rollout_backend"].protocol)[0] == ["setup", "generate", "sync_weights"]


def test_built_components_carry_their_flags_as_plain_attributes():
    registry = load_plugins(external=False).registry
    assert registry.get("advantage_estimator", "process").build().needs_step_scores is True
    assert registry.get("advantage_estimator", "grpo").build().needs_step_scores is False
    assert registry.get("advantage_estimator", "rloo").build().needs_step_scores is False  # a plain function
    assert registry.get("advantage_estimator", "rloo").build().needs_greedy_baseline is False
    assert registry.get("advantage_estimator", "remax").build().needs_greedy_baseline is True
    assert registry.get("policy_loss", "clip").build().zero_advantage_is_zero_loss is True
    assert list(registry.get("reward_function", "accuracy").build().required_columns) == ["answer"]
    fmt = registry.get("reward_function", "format")
    assert tuple(fmt.build(fmt.options(pattern="x")).required_columns) == ()


def test_a_component_that_takes_no_attribute_gets_a_transparent_proxy():
    class Scorer:
        def __init__(self):
            self.calls = 0

        def score(self, prompts, completions, **columns):
            self.calls += 1
            return [1.0] * len(completions)

    scorer = Scorer()
    built = conform("reward_function", scorer.score, "reward function 'bound'")  # a bound method
    assert built.required_columns == ()
    assert built(["p"], ["c"]) == [1.0] and scorer.calls == 1
    assert list(inspect.signature(built).parameters) == ["prompts", "completions", "columns"]


def test_a_flag_of_the_wrong_type_is_refused():
    def estimator(inputs: AdvantageInputs):
        return torch.zeros_like(inputs.mask, dtype=torch.float)

    estimator.needs_step_scores = "yes"
    plugins = load_plugins(external=False, objects=[inline("Flaggy", "advantage_estimator", "f", estimator)])
    with pytest.raises(PluginError, match=r"'f' \(plugin 'Flaggy'\): needs_step_scores must be True or False"):
        plugins.registry.get("advantage_estimator", "f").build()


# --------------------------------------------------------------------------- layering
PUBLIC_SURFACE = {"grpo_core", "grpo_core.contracts", "grpo_core.options", "grpo_core.errors",
                  "grpo_core.groups", "grpo_core.spec", "grpo_core.launching",
                  "grpo_core.train.actor.drivers"}  # the built-in episode drivers' classes, by name


def test_plugins_import_only_the_public_engine_surface():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "plugins"
    used: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name == "grpo_core" or name.startswith("grpo_core."):
                    used.setdefault(name, set()).add(path.name)
    assert used, "the walk found no engine import"
    assert set(used) <= PUBLIC_SURFACE, {m: f for m, f in used.items() if m not in PUBLIC_SURFACE}


# --------------------------------------------------------------------------- declared extras
class MinimalTracker(NoFinishTracker):
    def finish(self, status): ...


class MinimalBackend(NoSyncBackend):
    def sync_weights(self, model): ...


def test_the_members_the_engine_reads_of_trackers_and_backends_are_declared_with_defaults():
    """The engine reads a tracker's run_id, tracking_uri and log_model and a backend's
    capabilities: each is in its contract, and a component that does not set one gets the
    contract's default (a backend that declares nothing: no images, no interruption, its own
    copy of the weights, on the CPU)."""
    tracker = conform("tracker", MinimalTracker(), "tracker 'minimal'")
    assert (tracker.run_id, tracker.tracking_uri, tracker.log_model) == (None, None, None)
    backend = conform("rollout_backend", MinimalBackend(), "rollout backend 'minimal'")
    assert backend.capabilities == RolloutCapabilities()
    can = backend.capabilities
    assert (can.generates_with_policy, can.device, can.accepts_images, can.interruptible) == (False, None, False, False)
    _, tracker_flags = contract_members(KINDS["tracker"].protocol)
    _, backend_flags = contract_members(KINDS["rollout_backend"].protocol)
    assert {"run_id", "tracking_uri", "log_model"} <= set(tracker_flags)
    assert backend_flags == {"capabilities": RolloutCapabilities()}  # the one attribute the engine reads


def test_a_backend_declaring_its_capabilities_in_another_shape_is_refused():
    """Capabilities are one record: a dict (or the old loose flags' values) is refused by name."""
    backend = type("Loose", (MinimalBackend,), {"capabilities": {"interruptible": True}})()
    with pytest.raises(PluginError, match=r"rollout backend 'loose' \(plugin 'p'\): capabilities must be a "
                                          r"RolloutCapabilities"):
        conform("rollout_backend", backend, "rollout backend 'loose' (plugin 'p')")
    declared = type("Declared", (MinimalBackend,), {"capabilities": RolloutCapabilities(interruptible=True)})()
    assert conform("rollout_backend", declared, "rollout backend 'declared'").capabilities.interruptible is True


def test_the_engine_probes_no_backend_attribute():
    """Everything the engine reads of a rollout backend goes through its contract: no
    getattr/hasattr on a backend anywhere in the engine (its capabilities are declared)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "grpo_core"
    probe = re.compile(r"(get|has|set)attr\([a-z_.]*backend")
    found = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if probe.search(line)]
    assert found == []


@pytest.mark.parametrize("has", ["state_dict", "load_state_dict"])
def test_a_component_with_only_half_of_stateful_is_refused(has):
    """State saved with no way back (or loaded from nowhere) would be lost on resume."""
    missing = "load_state_dict" if has == "state_dict" else "state_dict"
    component = type("Half", (MinimalTracker,), {has: lambda self, *a: {}})()
    with pytest.raises(PluginError) as info:
        conform("tracker", component, "tracker 'half' (plugin 'p')")
    message = str(info.value)
    assert "tracker 'half' (plugin 'p')" in message and f"has {has} but no {missing}" in message
    whole = type("Whole", (MinimalTracker,), {"state_dict": lambda self: {}, "load_state_dict": lambda self, s: None})
    conform("tracker", whole(), "tracker 'whole'")  # both: accepted
