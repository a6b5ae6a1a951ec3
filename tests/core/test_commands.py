"""``grpo-run`` subcommands from plugins (the ``register_commands`` hook, :mod:`grpo_core.commands`):
an inline plugin class registering a command, name clashes, arguments after ``--`` left to the
command, and the CLI with an installed plugin's command (``fake_dist``: tests/core/conftest.py).
The real ``serve`` command's arguments are tested in tests/plugins/vllm/test_serve.py."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from grpo_core import hookimpl
from grpo_core.cli import main
from grpo_core.commands import BUILTIN_COMMANDS, command_parser, split_passthrough
from grpo_core.errors import PluginError
from grpo_core.plugin_manager import DEFAULT_PLUGINS, load_plugins

ROOT = Path(__file__).resolve().parents[2]


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


class Hello:
    """An inline plugin adding ``grpo-run hello NAME [--loud]``."""

    runs: list = []

    @hookimpl
    def register_commands(self, register):
        def configure(parser):
            parser.add_argument("name", help="who to greet")
            parser.add_argument("--loud", action="store_true", help="shout it")

        def run(args):
            Hello.runs.append(args)
            return 3

        register.add("hello", help="print a greeting", configure=configure, run=run)


def test_an_inline_plugin_registers_a_command():
    plugins = load_plugins(external=False, objects=[Hello()])
    command = plugins.commands["hello"]
    assert (command.name, command.help, command.description, command.plugin, command.passthrough) == (
        "hello", "print a greeting", "print a greeting", "Hello", False)
    assert plugins.info["Hello"].commands == ["hello"]
    args = command_parser(command).parse_args(["world", "--loud"])
    assert (args.name, args.loud) == ("world", True)
    assert command.run(args) == 3 and Hello.runs[-1] is args
    assert "usage: grpo-run hello [-h] [--loud] name" in command_parser(command, width=100).format_help()


def test_the_builtin_plugins_add_serve_and_tinker_serve_and_nothing_else():
    plugins = load_plugins(external=False)
    assert list(plugins.commands) == ["serve", "tinker-serve"]
    serve = plugins.commands["serve"]
    assert serve.plugin in DEFAULT_PLUGINS and serve.passthrough
    assert plugins.info[serve.plugin].commands == ["serve"]
    tinker = plugins.commands["tinker-serve"]
    assert tinker.plugin in DEFAULT_PLUGINS and not tinker.passthrough
    assert plugins.info[tinker.plugin].commands == ["tinker-serve"]


@pytest.mark.parametrize("name", BUILTIN_COMMANDS)
def test_a_command_named_like_one_of_grpo_runs_own_names_both(name):
    class Clash:
        @hookimpl
        def register_commands(self, register):
            register.add(name, help="h", configure=lambda parser: None, run=lambda args: 0)

    with pytest.raises(PluginError) as info:
        load_plugins(external=False, objects=[Clash()])
    assert str(info.value) == (
        f"command '{name}' is registered by plugin 'Clash' but is one of grpo-run's own commands "
        f"({', '.join(BUILTIN_COMMANDS)}); rename the plugin's command")


def test_a_command_registered_by_two_plugins_names_both_in_load_order():
    class Serve:
        @hookimpl(tryfirst=True)  # called first, still named second: listings follow load order
        def register_commands(self, register):
            register.add("serve", help="h", configure=lambda parser: None, run=lambda args: 0)

    with pytest.raises(PluginError) as info:
        load_plugins(external=False, objects=[Serve()])
    serve_plugin = next(p for p in DEFAULT_PLUGINS if p.endswith("serve"))
    assert str(info.value) == (
        f"command 'serve' is registered twice: by plugin '{serve_plugin}' and by plugin 'Serve'; "
        "disable one of them (GRPO_DISABLED_PLUGINS) or rename the command")


@pytest.mark.parametrize(("name", "configure", "run", "message"), [
    ("Hello", None, None, "registered a command with an invalid name 'Hello': command names use lowercase"),
    ("-x", None, None, "registered a command with an invalid name '-x'"),
    ("my.yaml", None, None, "registered a command with an invalid name 'my.yaml'"),
    ("ok", "not callable", None, "registered command 'ok' with configure='not callable', which is not callable"),
    ("ok", None, 42, "registered command 'ok' with run=42, which is not callable"),
])
def test_a_bad_command_is_refused_naming_the_plugin(name, configure, run, message):
    class Bad:
        @hookimpl
        def register_commands(self, register):
            register.add(name, help="h", configure=configure or (lambda parser: None), run=run or (lambda args: 0))

    with pytest.raises(PluginError, match=re.escape(f"plugin 'Bad' {message}")):
        load_plugins(external=False, objects=[Bad()])


def test_a_failing_registration_names_the_plugin_and_the_hook():
    class Broken:
        @hookimpl
        def register_commands(self, register):
            raise RuntimeError("no commands today")

    with pytest.raises(PluginError, match="plugin 'Broken' failed in register_commands: RuntimeError: no commands"):
        load_plugins(external=False, objects=[Broken()])


def test_passthrough_is_what_follows_the_first_double_dash():
    assert split_passthrough(["serve", "m", "--", "--a", "--", "b"]) == (["serve", "m"], ["--a", "--", "b"])
    assert split_passthrough(["serve", "m"]) == (["serve", "m"], [])


# --------------------------------------------------------------------------- through grpo-run
ECHO = '''
import json

from grpo_core import hookimpl
from grpo_core.errors import UsageError


def configure(parser):
    parser.add_argument("word", help="the word to echo")
    parser.add_argument("--times", type=int, default=1, help="how many times")


def run(args):
    if args.word == "bad":
        raise UsageError("echo: 'bad' is not a word to echo")
    print(json.dumps({"words": [args.word] * args.times, "passthrough": args.passthrough}))
    return 0


@hookimpl
def register_commands(register):
    register.add("echo", help="print a word, and the arguments after --", configure=configure, run=run,
                 description="Print WORD; the arguments after -- are printed as they are.", passthrough=True)
'''


def test_an_installed_plugins_command_runs_from_grpo_run(fake_dist, all_installed_plugins):
    fake_dist("fake-echo", "echo-plugin", ECHO)
    code, out, err = cli("echo", "hi", "--times", "2", "--", "--times", "9", "x")
    assert (code, err) == (0, "")
    assert json.loads(out) == {"words": ["hi", "hi"], "passthrough": ["--times", "9", "x"]}
    code, out, _ = cli("echo", "hi")
    assert (code, json.loads(out)["passthrough"]) == (0, [])
    code, _, err = cli("echo", "bad")
    assert (code, err) == (2, "grpo-run: error: echo: 'bad' is not a word to echo\n")
    code, _, err = cli("echo")
    assert code == 2 and "usage: grpo-run echo" in err and "the following arguments are required: word" in err


def test_grpo_run_help_and_plugins_list_plugin_commands(fake_dist, all_installed_plugins):
    fake_dist("fake-echo", "echo-plugin", ECHO)
    code, out, _ = cli("--help")
    assert code == 0
    assert "{run,eval,validate,init,runs,plugins,schema,serve,tinker-serve,echo}" in out
    assert re.search(r"^    echo +print a word, and the arguments after --$", out, re.M)
    assert "Commands of plugins: grpo-run serve (" in out and "grpo-run echo (echo-plugin)." in out
    code, out, _ = cli("echo", "--help")
    assert code == 0 and "Print WORD; the arguments after -- are printed as they are." in out
    code, out, _ = cli("plugins")
    assert code == 0 and "echo-plugin  (entry point: fake-echo 1.2.3)\n  commands: grpo-run echo\n" in out
    code, out, _ = cli("plugins", "--json")
    assert code == 0 and {p["name"]: p["commands"] for p in json.loads(out)}["echo-plugin"] == ["echo"]


def test_a_plugin_command_shadowing_a_builtin_stops_grpo_run_naming_both(fake_dist, all_installed_plugins):
    fake_dist("fake-clash", "clash-plugin", ECHO.replace('register.add("echo"', 'register.add("validate"'))
    code, _, err = cli("--help")
    assert code == 2
    assert err.startswith("grpo-run: error: command 'validate' is registered by plugin 'clash-plugin' but is one "
                          "of grpo-run's own commands")


def test_a_spec_is_still_the_default_command(tmp_path, fake_dist, all_installed_plugins):
    """A first word that is neither grpo-run's command nor a plugin's is a spec to train on."""
    fake_dist("fake-echo", "echo-plugin", ECHO)
    code, _, err = cli(str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err and "invalid choice" not in err


def test_the_engine_names_no_builtin_plugin_but_to_register_it():
    """DESIGN: the engine imports no built-in plugin by name except to register it (a command
    comes through ``register_commands``, never an import in the CLI)."""
    from grpo_core import plugin_manager

    registration = {f'"{name}",' for name in DEFAULT_PLUGINS}
    for path in sorted((ROOT / "grpo_core").rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "grpo_plugins" in line:
                assert path == Path(plugin_manager.__file__) and line.strip() in registration, (path, number, line)
