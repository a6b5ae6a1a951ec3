"""``grpo-run``: SPEC (train), validate, plugins, schema; exit codes 0 success, 2 invalid
spec or usage, 1 runtime failure; no traceback for a user error.

Most tests call ``grpo_core.cli.main`` in process; a few run the installed ``grpo-run``
console script for real. Training itself is replaced by a stub module: these tests pin
what the CLI does around it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from grpo_core.cli import main
from grpo_core.errors import RunError
from grpo_core.kinds import KINDS
from grpo_core.plugin_manager import DEFAULT_PLUGINS, load_plugins
from grpo_core.spec import Spec, dump_spec, load_spec
from grpo_core.spec.slots import iter_slots, slot_locations

MINIMAL = "model: {path: some/model}\nrewards: [{name: accuracy}]\n"


@pytest.fixture
def spec_file(tmp_path):
    """``spec_file(text)``: ``text`` written to ``tmp_path/spec.yaml``."""

    def write(text: str = MINIMAL, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write


def cli(*argv: str) -> tuple[int, str, str]:
    """``main(argv)`` in process: ``(exit code, stdout, stderr)``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def stub_train(monkeypatch):
    """Replace ``grpo_core.train.loop.run`` with a stub whose ``train`` records its calls and
    does what ``behaviour`` says (return a code, or raise)."""
    calls: list[tuple] = []
    behaviour: dict = {"result": 0}

    def train(loaded, resume=None):
        calls.append((loaded, resume))
        if "raise" in behaviour:
            raise behaviour["raise"]
        return behaviour["result"]

    monkeypatch.setitem(sys.modules, "grpo_core.train.loop.run", types.SimpleNamespace(train=train))
    return types.SimpleNamespace(calls=calls, behaviour=behaviour)


# --------------------------------------------------------------------------- validate
def test_validate_prints_the_resolved_spec_with_every_default(spec_file):
    path = spec_file()
    code, out, err = cli("validate", path)
    assert (code, err) == (0, "")
    assert out == dump_spec(load_spec(path).spec)
    resolved = yaml.safe_load(out)
    # every section and every field of it
    assert list(resolved) == list(Spec.model_fields)
    for name, field in Spec.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields") and isinstance(resolved[name], dict):
            assert list(resolved[name])[: len(sub.model_fields)] == list(sub.model_fields), name
    # every slot: the engine's fields plus every option of the chosen plugin, defaults filled
    registry = load_plugins(external=False).registry
    for where, slot in iter_slots(load_spec(path).spec):
        node = resolved
        for part in where:
            node = node[part]
        options = registry.get(slot.kind, node["name"]).options
        expected = list(type(slot).model_fields) + (list(options.model_fields) if options else [])
        assert list(node) == expected, where
        if options:
            defaults = options().model_dump(mode="json")
            assert {k: node[k] for k in defaults} == defaults, where


def test_validate_applies_set_overrides(spec_file):
    code, out, err = cli(
        "validate", spec_file(), "--set", "train.lr=3e-5", "--set", "rewards.0.weight=2", "--set", "model.lora.r=4"
    )
    assert (code, err) == (0, "")
    resolved = yaml.safe_load(out)
    assert resolved["train"]["lr"] == 3e-5
    assert resolved["rewards"][0]["weight"] == 2.0
    assert resolved["model"]["lora"] == {"r": 4, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}


def test_validate_invalid_spec_exits_2_listing_every_problem(spec_file):
    path = spec_file("model: {path: m}\nrewards: [{name: acuracy}]\ntrain: {stepz: 3}\n")
    code, out, err = cli("validate", path)
    assert code == 2 and out == ""
    assert err.startswith(f"grpo-run: error: invalid spec {path} (2 problems):\n")
    assert "  spec.train.stepz (line 3): unknown key 'stepz'; did you mean 'steps'?" in err
    assert "  spec.rewards.0.name (line 2): unknown reward function 'acuracy'; did you mean 'accuracy'?" in err
    assert "Traceback" not in err


def test_validate_bad_set_exits_2(spec_file):
    code, out, err = cli("validate", spec_file(), "--set", "train.lr")
    assert (code, out) == (2, "")
    assert "--set 'train.lr': expected path.to.key=value" in err


def test_validate_missing_file_exits_2(tmp_path):
    code, out, err = cli("validate", tmp_path / "nope.yaml")
    assert (code, out) == (2, "")
    assert f"spec file {tmp_path / 'nope.yaml'} does not exist" in err


# --------------------------------------------------------------------------- run
def test_spec_alone_means_run_and_trains_the_validated_spec(spec_file, stub_train):
    path = spec_file()
    code, out, err = cli(path, "--set", "train.steps=7")
    assert code == 0, err
    ((loaded, resume),) = stub_train.calls
    assert loaded.path == path and loaded.spec.train.steps == 7 and resume is None
    assert loaded.spec.rewards[0].component.name == "accuracy"  # resolved before training


@pytest.mark.parametrize(("args", "resume"), [(["--resume"], "latest"), (["--resume", "ckpt/step-3"], "ckpt/step-3")])
def test_run_resume(spec_file, stub_train, args, resume):
    assert cli("run", spec_file(), *args)[0] == 0
    assert stub_train.calls[0][1] == resume


def test_run_returns_the_exit_code_of_training(spec_file, stub_train):
    stub_train.behaviour["result"] = 130
    assert cli(spec_file())[0] == 130


def test_invalid_spec_never_reaches_training(spec_file, stub_train):
    code, out, err = cli(spec_file("model: {path: m}\nrewards: [{name: nope}]\n"))
    assert code == 2 and "unknown reward function 'nope'" in err
    assert stub_train.calls == []


def test_runtime_failure_exits_1_with_its_message(spec_file, stub_train):
    stub_train.behaviour["raise"] = RunError("reward function 'accuracy' raised ValueError: bad")
    code, out, err = cli(spec_file())
    assert code == 1
    assert err == "grpo-run: error: reward function 'accuracy' raised ValueError: bad\n"


def test_unexpected_exception_exits_1_in_one_line_unless_debugging(spec_file, stub_train, monkeypatch):
    stub_train.behaviour["raise"] = ZeroDivisionError("division by zero")
    monkeypatch.delenv("GRPO_DEBUG", raising=False)
    code, out, err = cli(spec_file())
    assert code == 1
    assert err == "grpo-run: error: ZeroDivisionError: division by zero\n(set GRPO_DEBUG=1 to see the traceback)\n"
    monkeypatch.setenv("GRPO_DEBUG", "1")
    code, out, err = cli(spec_file())
    assert code == 1 and "Traceback" in err and "ZeroDivisionError" in err


def test_keyboard_interrupt_exits_130(spec_file, stub_train):
    stub_train.behaviour["raise"] = KeyboardInterrupt()
    code, out, err = cli(spec_file())
    assert (code, err) == (130, "grpo-run: interrupted\n")


# --------------------------------------------------------------------------- usage
def test_no_command_prints_help_and_exits_2():
    code, out, err = cli()
    assert code == 2
    assert "usage: grpo-run" in out and "Exit codes: 0 ok, 1 runtime failure, 2 invalid spec or usage" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["validate"], "the following arguments are required: spec"),
        (["plugins", "--bogus"], "unrecognized arguments: --bogus"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["run"], "the following arguments are required: spec"),
        (["validate", "s.yaml", "--set"], "argument --set: expected one argument"),
    ],
)
def test_usage_errors_exit_2_with_argparse_message(argv, message):
    code, out, err = cli(*argv)
    assert code == 2 and message in err and "usage: grpo-run" in err


def test_help_exits_0():
    code, out, _ = cli("--help")
    assert code == 0 and "{run,eval,validate,init,runs,plugins,schema,serve,tinker-serve}" in out


# --------------------------------------------------------------------------- plugins
def test_plugins_lists_every_plugin_with_version_distribution_and_components():
    import grpo_core

    plugins = load_plugins(external=False)
    code, out, err = cli("plugins")
    assert (code, err) == (0, "")
    blocks: dict[str, list[str]] = {}
    current = ""
    for line in out.splitlines():
        if line.startswith("  "):
            blocks[current].append(line.strip())
        else:
            current = line.split("  ", 1)[0]
            assert line == f"{current}  (builtin: grpo-core {grpo_core.__version__})"
            blocks[current] = []
    assert list(blocks) == list(DEFAULT_PLUGINS)
    for name, info in plugins.info.items():
        expected = [f"{KINDS[kind].label}: {', '.join(names)}" for kind, names in info.components.items()]
        expected += [f"commands: grpo-run {', grpo-run '.join(info.commands)}"] if info.commands else []
        assert [line for line in blocks[name] if not line.startswith("hooks:")] == expected
    listed = {n for lines in blocks.values() for line in lines for n in line.split(": ", 1)[1].split(", ")}
    for kind in KINDS:
        assert set(plugins.registry.names(kind)) <= listed


def test_plugins_json():
    import grpo_core

    plugins = load_plugins(external=False)
    code, out, err = cli("plugins", "--json")
    assert (code, err) == (0, "")
    payload = json.loads(out)
    assert [p["name"] for p in payload] == list(DEFAULT_PLUGINS)
    for entry in payload:
        assert set(entry) == {"name", "source", "distribution", "version", "location", "components", "commands"}
        expected = ("builtin", "grpo-core", grpo_core.__version__)
        assert (entry["source"], entry["distribution"], entry["version"]) == expected
        assert entry["components"] == plugins.info[entry["name"]].components
        assert entry["commands"] == plugins.info[entry["name"]].commands
    by_kind = {}
    for entry in payload:
        for kind, names in entry["components"].items():
            by_kind.setdefault(kind, []).extend(names)
    assert by_kind == {k: plugins.registry.names(k) for k in KINDS if plugins.registry.names(k)}


# --------------------------------------------------------------------------- schema
@pytest.fixture(scope="module")
def schema() -> dict:
    code, out, err = cli("schema")
    assert (code, err) == (0, "")
    return json.loads(out)


@pytest.fixture(scope="module")
def validator(schema):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema)  # a valid JSON Schema
    return jsonschema.Draft202012Validator(schema)


def test_schema_is_valid_json_schema_with_every_plugins_options(schema, validator):
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    registry = load_plugins(external=False).registry
    for _, slot_cls, _ in slot_locations(Spec):
        if not registry.names(slot_cls.kind):
            # a kind no built-in registers (agent): its own fields, and no name is valid; an empty
            # anyOf would not be a valid JSON Schema (the CI failure this guards against)
            entry = schema["$defs"][slot_cls.__name__]
            assert "anyOf" not in entry and set(entry["properties"]) == set(slot_cls.model_fields)
            assert list(validator.iter_errors({"name": "anything"}, entry)) != []
            continue
        variants = schema["$defs"][slot_cls.__name__]["anyOf"]
        assert [v["properties"]["name"]["const"] for v in variants] == registry.names(slot_cls.kind)
        for variant in variants:
            component = registry.get(slot_cls.kind, variant["properties"]["name"]["const"])
            options = list(component.options.model_fields) if component.options else []
            assert set(variant["properties"]) == set(slot_cls.model_fields) | set(options)
            assert variant["additionalProperties"] is False
            for key, prop in variant["properties"].items():
                assert prop.get("description"), (component.name, key)


def test_schema_accepts_valid_specs(spec_file, validator):
    path = spec_file(
        "model: {path: m}\nrewards: [{name: accuracy, answer_column: gold}, {name: format, pattern: x}]\n"
        "algorithm: {kl: {name: k3, beta: 0.1, log_ratio_clamp: 5}, advantage: {name: rloo}}\n"
    )
    assert list(validator.iter_errors(yaml.safe_load(path.read_text()))) == []
    # the resolved spec too, every default filled in
    assert list(validator.iter_errors(yaml.safe_load(cli("validate", path)[1]))) == []


@pytest.mark.parametrize(
    "change",
    [
        {"algorithm": {"kl": {"name": "low_var_kl", "log_ratio_clamp": "abc"}}},  # option of the wrong type
        {"algorithm": {"kl": {"name": "low_var_kl", "log_ratio_clam": 5}}},  # unknown option
        {"algorithm": {"kl": {"name": "kl", "beta": -1}}},  # engine field out of range
        {"algorithm": {"advantage": {"name": "grpp"}}},  # unknown plugin
        {"algorithm": {"advantage": {"name": "rloo", "scale_by_std": False}}},  # rloo takes no options
        {"rewards": [{"name": "accuracy", "timeout": -1}]},
        {"rewards": []},
        {"trian": {}},  # unknown section
        {"train": {"steps": "many"}},
        {"model": None},
        {"rollout": {"agent": {"name": "my_agent"}}},  # a kind nothing built in registers
    ],
)
def test_schema_rejects_invalid_specs(validator, change):
    spec = {"model": {"path": "m"}, "rewards": [{"name": "accuracy"}], **change}
    assert list(validator.iter_errors(spec)) != []


# --------------------------------------------------------------------------- the real script
def _script() -> str:
    found = shutil.which("grpo-run") or str(Path(sys.executable).parent / "grpo-run")
    assert Path(found).exists(), "grpo-run is not installed (pip install -e .)"
    return found


def test_console_script_exit_codes_and_no_traceback(spec_file):
    env = {**os.environ, "GRPO_LOAD_PLUGINS": ""}
    bad = spec_file("model: !!python/object/apply:os.system ['echo pwned']\nrewards: []\n", name="bad.yaml")
    result = subprocess.run([_script(), "validate", str(bad)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert "YAML tag '!!python/object/apply:os.system' is not allowed" in result.stderr
    assert "Traceback" not in result.stderr and "pwned" not in result.stdout
    good = spec_file()
    result = subprocess.run([_script(), "validate", str(good)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and yaml.safe_load(result.stdout)["model"]["path"] == "some/model"
