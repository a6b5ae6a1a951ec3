"""``grpo-run`` subcommands that plugins add, through the ``register_commands`` hook.

The CLI (:mod:`grpo_core.cli`) defines the commands of :data:`BUILTIN_COMMANDS` itself; every
other subcommand comes from a plugin, built-in or installed, exactly as a component does: the
plugin's ``register_commands(register)`` implementation calls :meth:`CommandRegistrar.add`,
the plugin manager collects the commands of every plugin (:attr:`grpo_core.plugin_manager.Plugins.commands`),
and the CLI adds one argparse subparser per command. ``grpo-run --help``, ``grpo-run plugins``
and the reference pages list them. A spec's local plugin files are loaded with the spec, after
the command line is parsed: they cannot add commands.

A plugin command::

    import argparse

    from grpo_core import hookimpl


    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("name", help="who to greet")


    def run(args: argparse.Namespace) -> int:
        print(f"hello, {args.name}")
        return 0


    @hookimpl
    def register_commands(register):
        register.add("hello", help="print a greeting", configure=configure, run=run)
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from grpo_core.errors import PluginError

__all__ = ["BUILTIN_COMMANDS", "Command", "CommandRegistrar", "collect_commands", "command_parser", "split_passthrough"]

#: The commands ``grpo-run`` defines itself; a plugin command may not take one of these names.
BUILTIN_COMMANDS: tuple[str, ...] = ("run", "eval", "validate", "init", "runs", "plugins", "schema")

#: The hook a plugin implements to add commands.
COMMANDS_HOOK = "register_commands"

_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


@dataclass(frozen=True)
class Command:
    """One ``grpo-run`` subcommand that a plugin registered.

    Attributes:
        name: ``grpo-run NAME``.
        help: one line, for ``grpo-run --help`` and ``grpo-run plugins``.
        description: the text above the arguments in ``grpo-run NAME --help``.
        configure: called with the command's ``argparse.ArgumentParser`` to add its arguments.
        run: called with the parsed ``argparse.Namespace``; returns the exit code.
        passthrough: whether the arguments after the first ``--`` are left unparsed and
            handed over in ``args.passthrough`` (a list of strings, empty without ``--``).
        plugin: the plugin that registered it.
    """

    name: str
    help: str
    description: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    passthrough: bool
    plugin: str


class CommandRegistrar:
    """Handed to every ``register_commands`` hook; records what each plugin registers.

    Args:
        plugin: called at each ``add``, it names the plugin whose hook implementation is
            running (the plugin manager finds it on the call stack).
    """

    def __init__(self, plugin: Callable[[], str]):
        self._plugin = plugin
        self.added: list[Command] = []

    def add(
        self,
        name: str,
        *,
        help: str,
        configure: Callable[[argparse.ArgumentParser], None],
        run: Callable[[argparse.Namespace], int],
        description: str | None = None,
        passthrough: bool = False,
    ) -> None:
        """Register the subcommand ``grpo-run NAME``.

        Args:
            name: lowercase letters, digits and ``-``, starting with a letter; not one of
                :data:`BUILTIN_COMMANDS`.
            help: one line for ``grpo-run --help`` and ``grpo-run plugins``.
            configure: ``configure(parser)`` adds the command's arguments to its
                ``argparse.ArgumentParser``.
            run: ``run(args) -> int``: does the work and returns the exit code. A
                :class:`grpo_core.errors.GrpoError` it raises is shown as ``grpo-run: error: ...``
                with its exit code (``UsageError``: 2).
            description: the text of ``grpo-run NAME --help``; defaults to ``help``.
            passthrough: leave everything after the first ``--`` unparsed and hand it to
                ``run`` as ``args.passthrough`` (for a command that starts another program).
        """
        plugin = self._plugin()
        if not isinstance(name, str) or not _NAME.match(name):
            raise PluginError(
                f"plugin '{plugin}' registered a command with an invalid name {name!r}: command names use "
                "lowercase letters, digits and -, and start with a letter"
            )
        if name in BUILTIN_COMMANDS:
            raise PluginError(
                f"command '{name}' is registered by plugin '{plugin}' but is one of grpo-run's own commands "
                f"({', '.join(BUILTIN_COMMANDS)}); rename the plugin's command"
            )
        for what, value in (("configure", configure), ("run", run)):
            if not callable(value):
                raise PluginError(f"plugin '{plugin}' registered command '{name}' with {what}={value!r}, "
                                  "which is not callable")
        self.added.append(Command(name, help, description or help, configure, run, bool(passthrough), plugin))


def collect_commands(commands: Iterable[Command]) -> dict[str, Command]:
    """``commands`` by name; a name registered twice is a :class:`PluginError` naming both plugins."""
    found: dict[str, Command] = {}
    for command in commands:
        existing = found.get(command.name)
        if existing is not None:
            raise PluginError(
                f"command '{command.name}' is registered twice: by plugin '{existing.plugin}' and by plugin "
                f"'{command.plugin}'; disable one of them (GRPO_DISABLED_PLUGINS) or rename the command"
            )
        found[command.name] = command
    return found


def command_parser(command: Command, prog: str = "grpo-run", width: int | None = None) -> argparse.ArgumentParser:
    """A standalone parser of ``command`` (``prog NAME``), as ``grpo-run NAME --help`` shows
    it; ``width``: the help text's width (None: the terminal's)."""

    def formatter(prog: str) -> argparse.HelpFormatter:
        return argparse.HelpFormatter(prog) if width is None else argparse.HelpFormatter(prog, width=width)

    parser = argparse.ArgumentParser(prog=f"{prog} {command.name}", description=command.description,
                                     formatter_class=formatter)
    command.configure(parser)
    return parser


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` up to the first ``--``, and what follows it (empty without ``--``)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]
