"""One live run per run folder: ``<run folder>/run.lock``, held with ``fcntl.flock`` by the
process that launched the run (the ``--nproc`` launcher, or rank 0 under torchrun).

The lock belongs to the open file, not to the file on disk: the kernel drops it when its
process ends in any way (an exception, SIGTERM, SIGKILL, the out-of-memory killer), so a
dead run never leaves a stale lock. The file stays, except that a launch which created the
folder and wrote nothing in it (one refused early) removes both; a launch that locked a file
unlinked meanwhile takes the lock again on the file now at the path, so two never both hold
it. The file holds the holder's pid, host and start time, for the message a second launch
gets: it exits 2 naming them, before it moves, reads or writes anything in the folder.

``flock`` works between processes of one machine and on most network file systems that
support it (NFSv4 maps it to byte-range locks); where locks are unsupported, the run goes on
with a warning. Not available on Windows: no lock there.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from grpo_core.errors import UsageError

log = logging.getLogger("grpo.runlock")

LOCK_FILE = "run.lock"


def _holder(fd: int) -> str:
    """``pid N on host H (since ...)`` from a lock file's content, or what can be said."""
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["started"])))
        return f"pid {int(info['pid'])} on host {info['host']} (since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


def _lock(path: Path, folder: Path) -> int:
    """An open descriptor of ``path`` holding its flock; a UsageError naming the holder when
    another process has it. A lock taken on a file that was unlinked meanwhile (a run that
    created the folder and found it unused on its way out) is dropped and taken again on
    the file now at ``path``."""
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UsageError(
                f"the run folder {folder} is in use by a live run: {holder}. Wait for it to end (or stop it), "
                "or set train.output_dir to another folder"
            ) from None
        except OSError as exc:  # a file system without locks
            log.warning("cannot lock %s (%s): two runs started in this folder at once would not be stopped",
                        path, exc)
            return fd
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextmanager
def hold_run_folder(folder: Path) -> Iterator[None]:
    """Hold the run folder's lock while the block runs; a UsageError (exit 2) naming the
    live run's pid and host when another process holds it. A folder this call created and
    the block left empty (a launch refused before it wrote anything) is removed."""
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    fd = _lock(path, folder)
    try:
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.pwrite(fd, json.dumps(info).encode() + b"\n", 0)
        yield
    finally:
        try:
            if created and os.listdir(folder) == [LOCK_FILE]:
                path.unlink()  # while still locked: a launch that opened it now retries on a new file
                folder.rmdir()
        except OSError:  # something appeared in the folder meanwhile: leave it
            pass
        os.close(fd)  # releases the lock
