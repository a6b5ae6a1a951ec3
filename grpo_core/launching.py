"""Launching the processes of one run: the public pieces a launcher is made of.

A launcher (the ``launcher`` plugin kind, :class:`~grpo_core.contracts.Launcher`) is chosen with
``grpo-run run SPEC --launcher NAME`` (``local``, the built-in, when ``--nproc N`` asks for more
than one process). It gets the run as :class:`~grpo_core.contracts.RunArguments` (the command
line of one process of the run, and the environment of each rank) and starts those processes
wherever it places them: on this host (``local``), on a Ray cluster (``ray``), through SLURM
(``slurm``), or wherever a plugin's launcher does. Everything a launcher needs is public here:
:func:`supervise` (stop the others when one fails, with the exit code of the first failure),
:func:`forwarding_signals` (SIGINT and SIGTERM passed on once), :func:`free_port`, and
:func:`die_with_launcher`, which each process of a run calls when it starts.

What the built-in supervision guarantees:

- SIGINT and SIGTERM are passed on once to every process (each runs in its own session, so
  a terminal's Ctrl-C does not reach it twice): all stop at the same step, the main one
  checkpoints, and the launcher exits 130 or 143.
- A process that fails (an error, or killed: SIGKILL, the kernel's out-of-memory killer)
  stops the others: they get :data:`GRACE_S` seconds to fail on their own, then SIGTERM,
  then SIGKILL after :data:`KILL_AFTER_S` more (one waiting in a collective on the dead
  process may never see the signal). The launcher's exit code is that of the process that
  failed first (``128 + signal`` for one killed by a signal), so it is never 0.
- No process outlives the launcher: on Linux each asks the kernel for SIGTERM when the
  launcher dies (``prctl(PR_SET_PDEATHSIG)``), even by SIGKILL; elsewhere a thread in each
  process watches the launcher's pid. On that SIGTERM they checkpoint and stop together.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_core.contracts import Launcher, RunArguments
    from grpo_core.registry import Registry
    from grpo_core.spec.models import Spec

#: Seconds the other processes get to stop on their own after one failed.
GRACE_S = 5.0
#: Seconds between SIGTERM and SIGKILL for a process that does not stop.
KILL_AFTER_S = 30.0
#: Set in each process's environment: the launcher's pid.
PARENT_ENV = "GRPO_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """In a process started by :func:`launch`: be sent SIGTERM when the launcher dies."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if not parent:
        return
    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)
    if not armed:
        threading.Thread(target=_watch, args=(parent,), daemon=True, name="grpo-launcher-watch").start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(rank: int, code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        cause = " (out of memory, or killed by hand)" if -code == signal.SIGKILL else ""
        return f"process {rank} was killed by {name}{cause}"
    return f"process {rank} exited with code {code}"


def supervise(procs: list[subprocess.Popen], poll_s: float = 0.1) -> int:
    """Wait for every process; when one fails, stop the others (see the module docstring).
    Returns the exit code of the root failure (a process killed by a signal this launcher
    did not send, whose peers then fail on the broken connection; else the first to fail),
    or 0."""
    failures: list[tuple[int, int]] = []  # (rank, code) in the order seen
    ours: set[int] = set()  # ranks this launcher signalled (SIGTERM, then SIGKILL): never the root failure
    failed_at = terminated_at = None
    while True:
        running = [p.poll() is None for p in procs]
        for rank, p in enumerate(procs):
            if p.returncode not in (None, 0) and rank not in {r for r, _ in failures}:
                failures.append((rank, p.returncode))
                failed_at = failed_at or time.monotonic()
                if p.returncode < 0 and rank not in ours:
                    print(f"grpo-run: {_describe(rank, p.returncode)}; stopping the others", file=sys.stderr)
        if not any(running):
            break
        now = time.monotonic()
        if failed_at is not None and terminated_at is None and now - failed_at > GRACE_S:
            terminated_at = now
            ours.update(r for r, alive in enumerate(running) if alive)
            _send(procs, signal.SIGTERM)
        if terminated_at is not None and now - terminated_at > KILL_AFTER_S:
            _send(procs, signal.SIGKILL)
        time.sleep(poll_s)
    killed = [(r, c) for r, c in failures if c < 0 and r not in ours]
    return _exit_code((killed or failures or [(0, 0)])[0][1])


def _send(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def forwarding_signals(procs: list[subprocess.Popen]):
    """For the duration, SIGINT and SIGTERM received by this process are passed on to every
    process of ``procs`` still running (started with ``start_new_session=True``, so that a
    terminal's Ctrl-C reaches each once, through here); the previous handlers after."""

    def forward(signum, frame):
        _send(procs, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def build_launcher(registry: Registry, name: str, options: dict[str, Any]) -> Launcher:
    """The launcher registered as ``name``, built with ``options`` validated by its own model
    (before the spec is: a launcher that places rollout servers changes what the spec must
    name). A launcher unknown, or options it does not take, is a usage error naming what is
    valid."""
    from pydantic import ValidationError

    from grpo_core.errors import UsageError

    if name not in registry.names("launcher"):
        raise UsageError(f"--launcher: unknown launcher {name!r}; available: {', '.join(registry.names('launcher'))}")
    component = registry.get("launcher", name)
    if component.options is None:
        if options:
            raise UsageError(f"--launcher-option: launcher {name!r} takes no options, got {', '.join(options)}")
        return component.build()
    try:
        validated = component.options(**options)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        valid = ", ".join(component.options.model_fields)
        raise UsageError(f"--launcher-option for launcher {name!r}: {problems} (its options: {valid})") from None
    return component.build(validated)


def launch(run: RunArguments, spec: Spec, launcher: Launcher) -> int:
    """Start and supervise the processes of ``run`` with ``launcher`` (from
    :func:`build_launcher`), once the spec is checked to split over ``run.nproc`` processes;
    returns the run's exit code."""
    from grpo_core.train.distributed import check_layout

    check_layout(spec, run.nproc)
    return launcher.launch(run, spec)
