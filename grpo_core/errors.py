"""Errors the user sees. Each carries the exit code the CLI returns for it.

Exit codes: 0 success, 1 runtime failure, 2 invalid spec or usage, 130/143 interrupted.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class GrpoError(Exception):
    """An error with a message meant for the user (no traceback is shown for it)."""

    exit_code = 1


class UsageError(GrpoError):
    exit_code = 2


class PluginError(GrpoError):
    """A plugin failed to import or to register, or two plugins registered one name."""

    exit_code = 2


class SpecError(GrpoError):
    """Every problem found in a spec, each with its path (``model.path: ...``)."""

    exit_code = 2

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        head = f"invalid spec {source}" if source else "invalid spec"
        n = len(self.problems)
        body = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{head} ({n} problem{'s' if n != 1 else ''}):\n{body}")


class RunError(GrpoError):
    """A failure during training that names its culprit (a reward function, a column...)."""

    exit_code = 1


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``word``, or None when none is close."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` when a choice is close to ``word``, else ``""``."""
    match = closest(word, choices)
    return f"; did you mean '{match}'?" if match else ""


def fault_text(exc: BaseException) -> str:
    """``"Type: message"`` of an exception raised by plugin code; a ``SystemExit`` (argparse,
    ``sys.exit`` in a tool, a reward function or at a plugin's import) says so, since its
    message alone is a bare exit code."""
    if isinstance(exc, SystemExit):
        return f"SystemExit (sys.exit({exc.code!r}) was called)"
    return f"{type(exc).__name__}: {exc}"


def plugin_origin(exc: BaseException) -> str:
    """`` (file:line, in function)`` of the innermost frame of ``exc`` outside the engine and
    Python's own library: the plugin code that raised it; empty when there is none."""
    import os
    import sysconfig
    import traceback

    engine = os.path.dirname(os.path.abspath(__file__))
    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
    for frame in reversed(frames):
        name = os.path.abspath(frame.f_code.co_filename)
        in_stdlib = name.startswith(stdlib + os.sep) and "site-packages" not in name
        if not name.startswith(engine + os.sep) and not in_stdlib:
            return f" ({name}:{frame.f_lineno}, in {frame.f_code.co_name})"
    return ""
