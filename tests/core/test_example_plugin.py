"""The example third-party plugin (``examples/grpo-example-plugin``), installed for real.

A session fixture pip-installs a copy of the folder into the running interpreter
(``--no-deps --no-build-isolation``) and uninstalls it at the end. The tests then show
that ``grpo-run plugins`` lists it, that a spec selects its components by name with
their options validated by its models, and that ``GRPO_LOAD_PLUGINS=""`` and
``GRPO_DISABLED_PLUGINS`` keep it out.

Parallel runs: the module is one xdist group (``-n 2 --dist loadgroup`` runs it in one
worker). Without ``loadgroup`` it is still safe: pip runs only under the machine-wide
site lock of ``tests/conftest.py`` (which tests that load every installed plugin hold
shared), and the plugin stays installed while any live pytest process still uses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from grpo_core.checkpoint import pid_alive
from grpo_core.cli import main
from grpo_core.contracts import AdvantageInputs
from grpo_core.errors import SpecError
from grpo_core.plugin_manager import load_plugins
from grpo_core.spec import load_spec

pytestmark = pytest.mark.xdist_group(name="site-packages")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-example-plugin"
DIST = "grpo-example-plugin"
# Per interpreter environment: a session in another virtualenv installs into its own site-packages.
USERS = Path(tempfile.gettempdir()) / (
    f"grpo-core-tests-example-plugin-{hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]}.users"
)


def _pip(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
        capture_output=True, text=True, timeout=300,
    )
    if result.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")


def _users() -> set[int]:
    """pytest processes that use the installed plugin now (dead ones dropped)."""
    if not USERS.exists():
        return set()
    return {int(p) for p in USERS.read_text().split() if p.isdigit() and pid_alive(int(p))}


@pytest.fixture(scope="session")
def example_plugin(tmp_path_factory, site_lock):
    """The example plugin installed into this interpreter for the session."""
    # Install from a copy: building writes build/ and *.egg-info next to the sources.
    source = tmp_path_factory.mktemp("example-plugin") / DIST
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    with site_lock(exclusive=True):
        users = _users()
        if not users:  # no live session has it installed: (re)install it from the repo
            if importlib.util.find_spec("setuptools") is None:  # --no-build-isolation needs it
                _pip("install", "setuptools>=68")
            _pip("install", "--no-deps", "--no-build-isolation", "--quiet", str(source))
        USERS.write_text(" ".join(str(p) for p in users | {os.getpid()}))
    importlib.invalidate_caches()
    yield importlib.metadata.distribution(DIST)
    with site_lock(exclusive=True):
        users = _users() - {os.getpid()}
        if not users:
            _pip("uninstall", "--yes", DIST)
        USERS.write_text(" ".join(str(p) for p in users))
    importlib.invalidate_caches()
    sys.modules.pop("grpo_example_plugin", None)


def grpo_run(*args: str, **env: str | None) -> subprocess.CompletedProcess:
    """The installed ``grpo-run`` script; ``env`` values of None unset the variable."""
    full = {k: v for k, v in os.environ.items() if k not in ("GRPO_LOAD_PLUGINS", "GRPO_DISABLED_PLUGINS")}
    full.update({k: v for k, v in env.items() if v is not None})
    script = shutil.which("grpo-run") or str(Path(sys.executable).parent / "grpo-run")
    return subprocess.run([script, *args], capture_output=True, text=True, env=full, timeout=120)


LISTING = (
    "example  (entry point: grpo-example-plugin 0.1.0)\n"
    "  advantage estimator: sign\n"
    "  reward function: length_penalty\n"
)


# --------------------------------------------------------------------------- packaging
def test_packaging_is_three_lines_of_toml(example_plugin):
    pyproject = (EXAMPLE / "pyproject.toml").read_text(encoding="utf-8")
    assert '[project.entry-points.grpo]\nexample = "grpo_example_plugin"\n' in pyproject
    (entry_point,) = [ep for ep in example_plugin.entry_points if ep.group == "grpo"]
    assert (entry_point.name, entry_point.value) == ("example", "grpo_example_plugin")
    assert example_plugin.version == "0.1.0"
    assert (EXAMPLE / "README.md").read_text(encoding="utf-8").startswith("# grpo-example-plugin")


# --------------------------------------------------------------------------- listed
def test_grpo_run_plugins_lists_it_when_load_plugins_is_unset(example_plugin):
    result = grpo_run("plugins")
    assert result.returncode == 0, result.stderr
    assert LISTING in result.stdout
    assert "grpo_plugins.rewards.answers  (builtin: grpo-core" in result.stdout


def test_grpo_run_plugins_json_lists_it_by_distribution_name(example_plugin):
    result = grpo_run("plugins", "--json", GRPO_LOAD_PLUGINS="other, grpo-example-plugin")
    assert result.returncode == 0, result.stderr
    (entry,) = [p for p in json.loads(result.stdout) if p["name"] == "example"]
    assert entry == {
        "name": "example", "source": "entry point", "distribution": DIST, "version": "0.1.0",
        "location": "grpo_example_plugin",
        "components": {"advantage_estimator": ["sign"], "reward_function": ["length_penalty"]}, "commands": [],
    }


@pytest.mark.parametrize(
    ("env", "listed"),
    [
        ({"GRPO_LOAD_PLUGINS": "example"}, True),
        ({"GRPO_LOAD_PLUGINS": "grpo-example-plugin"}, True),
        ({"GRPO_LOAD_PLUGINS": ""}, False),
        ({"GRPO_LOAD_PLUGINS": "something-else"}, False),
        ({"GRPO_DISABLED_PLUGINS": "example"}, False),
        ({"GRPO_DISABLED_PLUGINS": "grpo-example-plugin"}, False),
        ({"GRPO_LOAD_PLUGINS": "example", "GRPO_DISABLED_PLUGINS": "example"}, False),
    ],
)
def test_environment_switches_in_process(example_plugin, monkeypatch, env, listed):
    monkeypatch.delenv("GRPO_LOAD_PLUGINS", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    plugins = load_plugins()
    assert ("example" in plugins.info) is listed
    assert (plugins.registry.find("reward_function", "length_penalty") is not None) is listed


@pytest.mark.parametrize("env", [{"GRPO_LOAD_PLUGINS": ""}, {"GRPO_DISABLED_PLUGINS": "example"}])
def test_grpo_run_plugins_keeps_it_out(example_plugin, env):
    result = grpo_run("plugins", **env)
    assert result.returncode == 0, result.stderr
    assert "grpo_plugins.rewards" in result.stdout
    assert "example" not in result.stdout and "length_penalty" not in result.stdout


# --------------------------------------------------------------------------- selectable
SPEC = """\
model: {path: m}
rewards:
  - name: accuracy
  - name: length_penalty
    target_chars: 50
    weight: 0.1
algorithm:
  advantage: {name: sign, dead_zone: 0.25}
"""


def test_spec_selects_its_components_with_validated_options(example_plugin, tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_LOAD_PLUGINS", "example")
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC, encoding="utf-8")
    spec = load_spec(path).spec
    reward, advantage = spec.rewards[1], spec.algorithm.advantage
    assert reward.component.plugin == "example" and reward.weight == 0.1
    assert type(reward.options).__name__ == "LengthPenaltyOptions"
    assert reward.options.model_dump() == {"target_chars": 50, "scale": 1.0, "only_longer": False}
    assert type(advantage.options).__name__ == "SignOptions" and advantage.options.dead_zone == 0.25
    assert reward.build()(["p"], ["x" * 75]) == [-0.5]


def test_grpo_run_validate_prints_its_option_defaults(example_plugin, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC, encoding="utf-8")
    result = grpo_run("validate", str(path), "--set", "rewards.1.scale=2")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["rewards"][1] == {
        "name": "length_penalty", "weight": 0.1, "concurrency": 1, "sources": None, "call_timeout": None,
        "target_chars": 50, "scale": 2.0, "only_longer": False,
    }
    assert resolved["algorithm"]["advantage"] == {"name": "sign", "dead_zone": 0.25}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("    target_chars: 0", "spec.rewards.1.target_chars (line 5): Input should be greater than or equal to 1"),
        ("    target_char: 50", "spec.rewards.1.target_char (line 5): unknown key 'target_char' for reward "
                                "function 'length_penalty'; did you mean 'target_chars'?; valid keys: name, "
                                "weight, concurrency, sources, call_timeout, target_chars, scale, only_longer"),
        ("    scale: .inf", "spec.rewards.1.scale (line 5): Input should be a finite number"),
    ],
)
def test_its_options_models_reject_bad_options(example_plugin, tmp_path, monkeypatch, line, problem):
    monkeypatch.setenv("GRPO_LOAD_PLUGINS", "example")
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.replace("    target_chars: 50", line), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.problems == [problem]


def test_disabled_it_is_an_unknown_name(example_plugin, tmp_path, monkeypatch):
    monkeypatch.delenv("GRPO_LOAD_PLUGINS", raising=False)
    monkeypatch.setenv("GRPO_DISABLED_PLUGINS", "example")
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    problems = info.value.problems
    assert any(p.startswith("spec.rewards.1.name (line 4): unknown reward function 'length_penalty'; available: ")
               for p in problems)
    assert any("unknown advantage estimator 'sign'" in p for p in problems)


def test_schema_includes_its_options(example_plugin, monkeypatch):
    monkeypatch.setenv("GRPO_LOAD_PLUGINS", "example")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["schema"]) == 0
    schema = json.loads(out.getvalue())
    (variant,) = [v for v in schema["$defs"]["RewardSlot"]["anyOf"] if v["title"] == "length_penalty (example)"]
    assert set(variant["properties"]) == {
        "name", "weight", "concurrency", "sources", "call_timeout", "target_chars", "scale", "only_longer",
    }
    assert all(p.get("description") for p in variant["properties"].values())
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(schema)
    assert list(validator.iter_errors(yaml.safe_load(SPEC))) == []
    bad = yaml.safe_load(SPEC.replace("target_chars: 50", "target_chars: fifty"))
    assert list(validator.iter_errors(bad)) != []


# --------------------------------------------------------------------------- behaviour
def test_length_penalty_scores_strings_and_conversations(example_plugin):
    from grpo_example_plugin import LengthPenalty, LengthPenaltyOptions

    reward = LengthPenalty(LengthPenaltyOptions(target_chars=10, scale=2.0))
    completions = [
        "x" * 10,
        "x" * 15,
        "x" * 5,
        [{"role": "assistant", "content": "x" * 20}],
        {"role": "assistant", "content": ""},
    ]
    assert reward(["p"] * 5, completions, answer=["1"] * 5, completion_ids=[[1]] * 5) == [0.0, -1.0, -1.0, -2.0, -2.0]
    only_longer = LengthPenalty(LengthPenaltyOptions(target_chars=10, only_longer=True))
    assert only_longer(["p", "p"], ["x" * 5, "x" * 12]) == [0.0, -0.2]
    with pytest.raises(TypeError, match="length_penalty: a completion must be a string or a list of chat messages"):
        reward(["p"], [42])


def test_sign_advantage_shape_padding_and_unscorable_rows(example_plugin):
    from grpo_example_plugin import SignAdvantage, SignOptions

    scores = torch.tensor([1.0, 0.0, 0.5, float("nan"), 3.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    adv = SignAdvantage(SignOptions())(AdvantageInputs(scores, groups, mask))
    assert adv.shape == mask.shape and adv.dtype == torch.float32
    expected_rows = [1.0, -1.0, 0.0, 0.0, 0.0, 0.0]  # group 0 mean 0.5; group 1 all equal; NaN -> 0
    assert torch.equal(adv, torch.tensor(expected_rows)[:, None] * mask)
    assert not torch.isnan(adv).any()
    dead = SignAdvantage(SignOptions(dead_zone=0.6))(AdvantageInputs(scores, groups, mask))
    assert torch.equal(dead, torch.zeros_like(dead))
    assert math.isclose(float(adv[mask].abs().sum()), 3.0)
