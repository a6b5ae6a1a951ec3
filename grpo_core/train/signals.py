"""Signals during a run: SIGINT/SIGTERM become a flag the loop checks at safe points, and a
second one stops at once (:class:`Interrupted`, exit ``128 + N``). And the threads a run stops
waiting for (an asynchronous actor in the middle of a batch when a run fails or is
interrupted twice): a process that still holds one leaves without interpreter finalization
(:func:`grpo_core.cli.exit_process`), since a thread inside torch while Python finalizes aborts
the process (``terminate called without an active exception``, exit 134).

In ``grpo-run``'s own process (:func:`end_process_on_signal`), once a stop signal has been
taken, the process is leaving because of it: a further SIGINT/SIGTERM after the loop let go of
the signals (the run's clean-up, the exit handlers, the interpreter's shutdown) ends it at once
with ``128 + N`` (:func:`_leave_now`), and the process leaves without interpreter finalization
(a signal during it would kill the process by its default action, -N to a parent, with no
message)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

_LEFT_RUNNING: list[threading.Thread] = []
_ENDS_PROCESS = False  # set by grpo-run's entry point: the process ends with the run
_RECEIVED: list[int] = []  # the stop signals taken in this process


class Interrupted(KeyboardInterrupt):
    """A second SIGINT or SIGTERM: the run stops at once; ``exit_code`` is ``128 + N``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def leave_running(thread: threading.Thread) -> None:
    """Record ``thread``, which the run stops waiting for (it ends on its own after its
    current work): the process must not finalize while it runs."""
    _LEFT_RUNNING.append(thread)


def threads_left_running() -> list[threading.Thread]:
    """The threads recorded by :func:`leave_running` that are still alive. Judged by
    :func:`threading.enumerate`, not ``Thread.is_alive``: a ``join`` interrupted by a signal
    handler's exception marks the thread stopped though it still runs (python/cpython#90882)."""
    alive = set(threading.enumerate())
    return [t for t in _LEFT_RUNNING if t in alive]


def end_process_on_signal() -> None:
    """Called by ``grpo-run``'s entry point, whose process ends with its run (not by a
    notebook's :class:`~grpo_core.Trainer`): after a stop signal, the loop hands further ones
    to :func:`_leave_now` rather than restoring the previous handlers."""
    global _ENDS_PROCESS
    _ENDS_PROCESS = True


def stop_signal_received() -> int | None:
    """The first SIGINT/SIGTERM a run of this process took, if any."""
    return _RECEIVED[0] if _RECEIVED else None


def _leave_now(signum, frame) -> None:
    """A signal after the run stopped because of an earlier one, in ``grpo-run``'s process:
    end it at once with ``128 + N``. What the run keeps is written by then (the checkpoint of
    the stop is complete, or its temporary folder is ignored on resume; metrics are appended
    line by line); what is cut short is the clean-up (the trackers' closing, exit handlers),
    as a second Ctrl-C asks."""
    print("grpo-run: interrupted", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(128 + signum)


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag the loop checks at safe points; a second one raises
    :class:`Interrupted`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: stop now
            raise Interrupted(signum)
        self.signum = signum
        _RECEIVED.append(signum)
        print(f"\ngrpo-run: {signal.Signals(signum).name} received; stopping after this step", file=sys.stderr)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            # grpo-run leaving because of a signal: another one ends it at once, to the last
            # instruction, instead of reaching the default handlers (a KeyboardInterrupt out
            # of the exit handlers, or death by the signal while the interpreter shuts down)
            leaving = self.signum is not None and _ENDS_PROCESS
            signal.signal(sig, _leave_now if leaving else handler)

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)
