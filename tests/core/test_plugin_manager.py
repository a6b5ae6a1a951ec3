"""Loading plugins from the three sources into one registry: built-ins, installed
distributions (entry-point group ``grpo``), local ``.py`` files listed in the spec.

Installed distributions are simulated by a ``*.dist-info`` folder on a temporary
``sys.path`` entry (what pip writes), so the entry-point machinery and the
``GRPO_LOAD_PLUGINS`` / ``GRPO_DISABLED_PLUGINS`` switches run for real without touching
the interpreter's site-packages. The real install of the example plugin is in
``test_example_plugin.py``.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import grpo_core
from grpo_core import hookimpl
from grpo_core.cli import main
from grpo_core.commands import COMMANDS_HOOK
from grpo_core.errors import PluginError, SpecError
from grpo_core.kinds import KINDS
from grpo_core.plugin_manager import DEFAULT_PLUGINS, load_plugins
from grpo_core.spec import load_spec

PLUGIN_SOURCE = '''
from pydantic import Field
from grpo_core import hookimpl
from grpo_core.options import Options


class ShoutOptions(Options):
    loud: int = Field(1, ge=0, description="How loud.")


def shout(options):
    def reward(prompts, completions, **kwargs):
        """Rewards exclamation marks."""
        return [float(c.count("!")) * options.loud for c in completions]
    return reward


@hookimpl
def register_reward_functions(register):
    register.add("{name}", shout, options=ShoutOptions)
'''


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- built-ins
def test_builtins_register_like_any_plugin():
    plugins = load_plugins(external=False)
    assert list(plugins.info) == list(DEFAULT_PLUGINS)
    for name in DEFAULT_PLUGINS:
        info = plugins.info[name]
        assert (info.source, info.distribution, info.version) == ("builtin", "grpo-core", grpo_core.__version__)
        assert plugins.manager.get_plugin(name) is sys.modules[name]
    # every required built-in of the design's table, found by kind and name
    required = {
        "advantage_estimator": ["grpo", "process", "dapo-token-scale", "rloo", "reinforce++"],
        "kl_penalty": ["low_var_kl", "kl", "abs", "mse"],
        "policy_loss": ["clip", "gspo"],
        "loss_aggregator": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                            "seq-mean-token-sum-norm", "token-sum"],
        "rollout_backend": ["hf"],
        "tracker": ["mlflow", "console"],
        "episode_driver": ["single-turn", "environment", "agent", "routing"],
    }
    for kind, names in required.items():
        for name in names:
            assert plugins.registry.get(kind, name).plugin.startswith("grpo_plugins.")


def test_each_load_is_a_fresh_manager():
    class Inline:
        @hookimpl
        def register_trackers(self, register):
            register.add("inline-tracker", object())

    first = load_plugins(external=False, objects=[Inline()])
    second = load_plugins(external=False)
    assert first.manager is not second.manager
    assert first.registry.find("tracker", "inline-tracker") is not None
    assert second.registry.find("tracker", "inline-tracker") is None
    assert "Inline" not in second.info


@pytest.mark.parametrize("kind", list(KINDS))
def test_inline_plugin_registers_every_kind(kind):
    hook = KINDS[kind].hook
    component = object()
    Inline = type("Inline", (), {hook: hookimpl(lambda self, register: register.add("mine", component))})
    plugins = load_plugins(external=False, objects=[Inline()])
    found = plugins.registry.get(kind, "mine")
    assert found.impl is component and found.plugin == "Inline"
    assert plugins.info["Inline"].source == "object"
    assert plugins.info["Inline"].components == {kind: ["mine"]}


def test_two_objects_with_one_name_are_refused():
    class Same:
        @hookimpl
        def register_trackers(self, register):
            pass

    with pytest.raises(PluginError, match="a plugin named 'Same' is already loaded"):
        load_plugins(external=False, objects=[Same(), Same()])


# --------------------------------------------------------------------------- hook names
def test_misspelled_hook_fails_loudly_with_the_closest_hook():
    class Typo:
        @hookimpl
        def register_advantage_estimator(self, register):  # no "s"
            register.add("never", object())

    with pytest.raises(PluginError) as info:
        load_plugins(external=False, objects=[Typo()])
    message = str(info.value)
    assert "plugin 'Typo' implements an unknown hook 'register_advantage_estimator'" in message
    assert "did you mean 'register_advantage_estimators'?" in message
    assert "known hooks: " + ", ".join(k.hook for k in KINDS.values()) in message


def test_hook_with_an_argument_the_spec_lacks_is_refused():
    class Extra:
        @hookimpl
        def register_datasets(self, register, config):
            pass

    with pytest.raises(PluginError) as info:
        load_plugins(external=False, objects=[Extra()])
    assert 'plugin "Extra": invalid hook implementation' in str(info.value)
    assert "config" in str(info.value)


def test_hook_may_take_no_argument():
    """pluggy's opt-in arguments: an implementation takes the arguments it needs."""
    calls = []

    class Quiet:
        @hookimpl
        def register_trackers(self):
            calls.append(1)

    load_plugins(external=False, objects=[Quiet()])
    assert calls == [1]


# --------------------------------------------------------------------------- entry points
def _reward_plugin(name: str) -> str:
    return PLUGIN_SOURCE.replace("{name}", name)


def test_installed_entry_point_is_loaded_with_its_distribution(fake_dist, all_installed_plugins):
    module = fake_dist("fake-dist", "fakeep", _reward_plugin("fake-shout"), version="1.2.3")
    plugins = load_plugins()
    info = plugins.info["fakeep"]
    assert (info.source, info.distribution, info.version, info.location) == (
        "entry point", "fake-dist", "1.2.3", module,
    )
    assert info.components == {"reward_function": ["fake-shout"]}
    assert plugins.registry.get("reward_function", "fake-shout").plugin == "fakeep"
    # after the built-ins in every listing
    names = plugins.registry.names("reward_function")
    assert names.index("fake-shout") > names.index("accuracy")


@pytest.mark.parametrize(
    ("load", "disabled", "loaded"),
    [
        (None, None, True),  # unset: every installed plugin
        ("", None, False),  # empty: none
        ("fakeep", None, True),  # by entry-point name
        ("fake-dist", None, True),  # by distribution name
        (" other , fakeep ", None, True),  # a comma list, spaces ignored
        ("other", None, False),
        (None, "fakeep", False),  # blocklist by entry-point name
        (None, "x,fake-dist", False),  # blocklist by distribution name
        ("fakeep", "fakeep", False),  # the blocklist wins
    ],
)
def test_environment_switches(fake_dist, monkeypatch, all_installed_plugins, load, disabled, loaded):
    fake_dist("fake-dist", "fakeep", _reward_plugin("fake-shout"))
    for var, value in (("GRPO_LOAD_PLUGINS", load), ("GRPO_DISABLED_PLUGINS", disabled)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    plugins = load_plugins()
    assert ("fakeep" in plugins.info) is loaded
    assert (plugins.registry.find("reward_function", "fake-shout") is not None) is loaded


def test_external_false_ignores_installed_plugins(fake_dist, all_installed_plugins):
    fake_dist("fake-dist", "fakeep", _reward_plugin("fake-shout"))
    assert "fakeep" not in load_plugins(external=False).info


def test_plugin_that_fails_to_import_names_plugin_and_distribution(fake_dist, all_installed_plugins):
    fake_dist("fake-broken", "broken", "import not_a_real_module_xyz\n")
    with pytest.raises(PluginError) as info:
        load_plugins()
    message = str(info.value)
    assert message.startswith('Error importing plugin "broken" (distribution fake-broken): ')
    assert "ModuleNotFoundError" in message and "not_a_real_module_xyz" in message


def test_broken_plugin_is_exit_2_from_the_cli_and_can_be_disabled(fake_dist, monkeypatch, all_installed_plugins):
    fake_dist("fake-broken", "broken", "raise RuntimeError('boom at import')\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["plugins"]) == 2
    assert 'Error importing plugin "broken" (distribution fake-broken): RuntimeError: boom at import' in err.getvalue()
    assert "Traceback" not in err.getvalue()
    monkeypatch.setenv("GRPO_DISABLED_PLUGINS", "broken")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plugins"]) == 0
    assert "grpo_plugins.rewards" in out.getvalue() and "broken" not in out.getvalue()


def test_installed_plugin_clashing_with_a_builtin_names_both(fake_dist, all_installed_plugins):
    fake_dist("fake-dist", "fakeep", _reward_plugin("accuracy"))
    with pytest.raises(PluginError) as info:
        load_plugins()
    assert "reward function 'accuracy' is registered twice: by plugin 'grpo_plugins.rewards.answers' " \
           "and by plugin 'fakeep'" in str(info.value)


# --------------------------------------------------------------------------- local files
def test_spec_plugin_files_are_relative_to_the_spec(tmp_path, monkeypatch):
    plugin = write(tmp_path / "project" / "local" / "shout.py", _reward_plugin("shout"))
    spec = write(
        tmp_path / "project" / "spec.yaml",
        """\
        model: {path: m}
        rewards:
          - name: shout
            loud: 3
        plugins: [local/shout.py]
        """,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_spec(spec)
    reward = loaded.spec.rewards[0]
    assert reward.options.loud == 3
    assert reward.component.plugin == str(plugin.resolve())
    assert reward.build()(["p", "p"], ["hi!!", "no"]) == [6.0, 0.0]
    assert loaded.spec.plugins == [plugin.resolve()]
    info = loaded.plugins.info[str(plugin.resolve())]
    assert (info.name, info.source, info.components) == ("shout.py", "file", {"reward_function": ["shout"]})


def test_spec_plugin_file_listed_twice_loads_once(tmp_path):
    write(tmp_path / "shout.py", _reward_plugin("shout"))
    spec = write(
        tmp_path / "spec.yaml", "model: {path: m}\nrewards: [{name: shout}]\nplugins: [shout.py, ./shout.py]\n"
    )
    loaded = load_spec(spec)
    assert loaded.plugins.registry.names("reward_function").count("shout") == 1


def test_missing_plugin_file_is_named_with_its_path(tmp_path):
    spec = write(tmp_path / "spec.yaml", "model: {path: m}\nrewards: [{name: accuracy}]\nplugins: [nope.py]\n")
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    assert info.value.problems == [f"spec.plugins (line 3): plugin file {tmp_path / 'nope.py'} does not exist"]


def test_plugin_file_that_fails_to_import_is_named(tmp_path):
    write(tmp_path / "bad.py", "x = 1 / 0\n")
    spec = write(tmp_path / "spec.yaml", "model: {path: m}\nrewards: [{name: accuracy}]\nplugins: [bad.py]\n")
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    (problem,) = info.value.problems
    assert problem.startswith("spec.plugins (line 3): ")
    assert f'Error importing plugin file "{tmp_path / "bad.py"}": ZeroDivisionError: division by zero' in problem


def test_plugin_file_with_a_misspelled_hook_is_named(tmp_path):
    write(
        tmp_path / "typo.py",
        """\
        from grpo_core import hookimpl

        @hookimpl
        def register_reward_function(register):
            pass
        """,
    )
    spec = write(tmp_path / "spec.yaml", "model: {path: m}\nrewards: [{name: accuracy}]\nplugins: [typo.py]\n")
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    (problem,) = info.value.problems
    assert f"plugin '{tmp_path / 'typo.py'}' implements an unknown hook 'register_reward_function'" in problem
    assert "did you mean 'register_reward_functions'?" in problem


def test_two_plugin_files_with_one_name_name_both_files(tmp_path):
    a = write(tmp_path / "a.py", _reward_plugin("shout"))
    b = write(tmp_path / "b.py", _reward_plugin("shout"))
    spec = write(tmp_path / "spec.yaml", "model: {path: m}\nrewards: [{name: shout}]\nplugins: [a.py, b.py]\n")
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    assert f"reward function 'shout' is registered twice: by plugin '{a}' and by plugin '{b}'" in str(info.value)


@pytest.mark.parametrize("value", ["shout.py", "[1, 2]", "{a: b}"])
def test_plugins_must_be_a_list_of_paths(tmp_path, value):
    spec = write(tmp_path / "spec.yaml", f"model: {{path: m}}\nrewards: [{{name: accuracy}}]\nplugins: {value}\n")
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    assert info.value.problems == ["spec.plugins (line 3): must be a list of .py file paths"]


def test_plugin_file_path_with_a_nul_byte_is_a_spec_error(tmp_path):
    spec = write(tmp_path / "spec.yaml", 'model: {path: m}\nrewards: [{name: accuracy}]\nplugins: ["a\\0b.py"]\n')
    with pytest.raises(SpecError, match="is not a valid path: embedded null byte"):
        load_spec(spec)


# --------------------------------------------------------------------------- CONTRIBUTING
CONTRIBUTING = Path(__file__).resolve().parents[2] / "CONTRIBUTING.md"
DESIGN_HOOKS = {
    "register_advantage_estimators", "register_kl_penalties", "register_policy_losses",
    "register_loss_aggregators", "register_rollout_backends", "register_reward_functions",
    "register_datasets", "register_trackers",
}


def test_contributing_has_a_runnable_plugin_per_hook(tmp_path):
    """Each ``### `register_<kind>s(register)``` section's code block is a plugin file
    that registers a component of that kind; every hook of the design is documented."""
    import re

    text = CONTRIBUTING.read_text(encoding="utf-8")
    sections = re.findall(r"^### `(register_\w+)\(register\)`\n(.*?)(?=^##)", text, re.S | re.M)
    hooks = [hook for hook, _ in sections]
    every_hook = {k.hook for k in KINDS.values()} | {COMMANDS_HOOK}
    assert set(hooks) >= DESIGN_HOOKS and set(hooks) == every_hook  # every hook, none invented
    files = []
    for hook, body in sections:
        (code,) = re.findall(r"```python\n(.*?)```", body, re.S)
        files.append(write(tmp_path / f"{hook}.py", code))
    plugins = load_plugins(files, external=False)
    kind_of = {entry.hook: kind for kind, entry in KINDS.items()}
    for (hook, _), path in zip(sections, files):
        info = plugins.info[str(path.resolve())]
        if hook == COMMANDS_HOOK:
            assert info.commands and not info.components, hook
        else:
            assert list(info.components) == [kind_of[hook]] and not info.commands, hook
    for script in re.findall(r"python (bench/\S+\.py)", text):
        assert (CONTRIBUTING.parent / script).is_file(), script


@pytest.mark.parametrize(("doc", "heading"), [("README.md", "## A plugin in ten lines"),
                                              ("CONTRIBUTING.md", "## Your first plugin: a reward function")])
def test_the_first_plugin_of_the_docs_runs(tmp_path, doc, heading):
    import re

    text = (CONTRIBUTING.parent / doc).read_text(encoding="utf-8")
    section = text[text.index(heading):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    lines = [line for line in code.splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) <= 10 or doc != "README.md", lines  # the README promises ten lines
    path = write(tmp_path / "my_rewards.py", code)
    reward = load_plugins([path], external=False).registry.get("reward_function", "short_answer").build()
    assert reward(["p", "p"], ["42", "x" * 30]) == [1.0, 0.0]
    assert reward.required_columns == ()  # the contract's default, filled at build


# --------------------------------------------------------------------------- pluggy semantics
def test_hooks_are_called_through_pluggy_so_tryfirst_and_wrappers_take_effect():
    calls: list[str] = []

    class Early:  # loaded first, but pluggy calls tryfirst implementations first
        @hookimpl(tryfirst=True)
        def register_trackers(self, register):
            calls.append("early")
            register.add("early", object())

    class Late:
        @hookimpl
        def register_trackers(self, register):
            calls.append("late")
            register.add("late", object())

    class Around:
        @hookimpl(wrapper=True)
        def register_trackers(self, register):
            calls.append("before")
            register.add("around", object())
            result = yield
            calls.append("after")
            return result

    plugins = load_plugins(external=False, objects=[Early(), Late(), Around()])
    assert calls[0] == "before" and calls[-1] == "after"  # the wrapper ran around the others
    assert calls.index("early") < calls.index("late")  # tryfirst honoured (LIFO would put 'late' first)
    registry = plugins.registry
    # the registry lists in plugin load order, whatever order pluggy called them in
    assert registry.names("tracker")[-3:] == ["early", "late", "around"]
    assert [registry.get("tracker", n).plugin for n in ("early", "late", "around")] == ["Early", "Late", "Around"]


def test_a_helper_called_by_a_hook_credits_the_calling_plugin(tmp_path):
    helper = write(tmp_path / "helper.py", "def add_all(register, names):\n"
                   "    for name in names:\n        register.add(name, lambda p, c, **k: [0.0] * len(c))\n")
    sys.path.insert(0, str(tmp_path))
    try:
        one = write(tmp_path / "one.py", "from grpo_core import hookimpl\nimport helper\n"
                    "@hookimpl\ndef register_reward_functions(register):\n    helper.add_all(register, ['r1'])\n")
        two = write(tmp_path / "two.py", "from grpo_core import hookimpl\nimport helper\n"
                    "@hookimpl\ndef register_reward_functions(register):\n    helper.add_all(register, ['r2'])\n")
        registry = load_plugins([one, two], external=False).registry
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("helper", None)
    assert helper.exists()
    assert registry.get("reward_function", "r1").plugin == str(one.resolve())
    assert registry.get("reward_function", "r2").plugin == str(two.resolve())


def test_local_plugin_module_names_are_the_same_in_every_process(tmp_path):
    plugin = write(tmp_path / "mine.py", "X = 1\n")
    code = (
        "import sys; from grpo_core.plugin_manager import load_plugin_file; "
        "print(load_plugin_file(sys.argv[1]).__name__)"
    )
    names = {
        subprocess.run([sys.executable, "-c", code, str(plugin)], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2", "3")
    }
    assert len(names) == 1, names
    (name,) = names
    assert name.startswith("grpo_local_plugins.mine_") and len(name.rsplit("_", 1)[1]) == 8
