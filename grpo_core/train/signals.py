"""Signals during a run: SIGINT/SIGTERM become a flag the loop checks at safe points."""

from __future__ import annotations

import signal
import sys
from typing import Any


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag the loop checks at safe points."""

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
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\ngrpo-run: {signal.Signals(signum).name} received; stopping after this step", file=sys.stderr)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)
