"""Signals during a run: SIGINT/SIGTERM become a flag the loop checks at safe points, and a
second one stops at once (:class:`Interrupted`, exit ``128 + N``). And the threads a run stops
waiting for (an asynchronous actor in the middle of a batch when a run fails or is
interrupted twice): a process that still holds one leaves without interpreter finalization
(:func:`grpo_core.cli.exit_process`), since a thread inside torch while Python finalizes aborts
the process (``terminate called without an active exception``, exit 134)."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

_LEFT_RUNNING: list[threading.Thread] = []


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
    """The threads recorded by :func:`leave_running` that are still alive."""
    return [t for t in _LEFT_RUNNING if t.is_alive()]


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
        print(f"\ngrpo-run: {signal.Signals(signum).name} received; stopping after this step", file=sys.stderr)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)
