"""Suite-wide setup: installed (third-party) plugins are kept out of every test.

``GRPO_LOAD_PLUGINS=""`` makes ``grpo_core.plugin_manager.load_plugins`` load no entry point, so
the suite sees the built-ins plus what a test registers itself, whatever happens to be
installed in the interpreter (the example plugin, while ``tests/core/test_example_plugin.py``
has it installed, included). It is set at import, before any test module or fixture runs,
and is inherited by the ``grpo-run`` subprocesses that tests start. A test that needs
another value sets it with ``monkeypatch`` (or ``env=`` for a subprocess), or uses the
``all_installed_plugins`` fixture.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

# Hypothesis' per-example deadline (200 ms) is a timing assertion: on a loaded 2-core CI machine
# a tensor example can take longer, which says nothing about the property under test.
settings.register_profile("grpo", deadline=None)
settings.load_profile("grpo")

os.environ["GRPO_LOAD_PLUGINS"] = ""
os.environ.pop("GRPO_DISABLED_PLUGINS", None)

#: Held exclusively while pip installs or uninstalls a plugin into this interpreter
#: (test_example_plugin.py), shared while a test loads every installed plugin. One path
#: per interpreter environment (``sys.prefix``) for every pytest process on the machine:
#: xdist workers and concurrent sessions of one environment alike; sessions of another
#: virtualenv install into their own site-packages and do not share it.
SITE_LOCK = Path(tempfile.gettempdir()) / (
    f"grpo-core-tests-site-packages-{hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]}.lock"
)


@contextlib.contextmanager
def _site_lock(exclusive: bool):
    with open(SITE_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def site_lock():
    """``with site_lock(exclusive=...)``: see :data:`SITE_LOCK`."""
    return _site_lock


@pytest.fixture
def all_installed_plugins(monkeypatch, site_lock):
    """Unset ``GRPO_LOAD_PLUGINS`` (every installed plugin loads) for this test, holding
    the shared site lock so that no plugin is half installed meanwhile."""
    monkeypatch.delenv("GRPO_LOAD_PLUGINS", raising=False)
    with site_lock(exclusive=False):
        yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: intra-op threads only add synchronisation (30 ms per matmul on a loaded
    2-core machine instead of 10 us). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``;
    the thread count is restored after the module."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _foreign_root_handlers() -> list:
    """The root logger's handlers that are not pytest's own (capture, live logging)."""
    import logging

    return [h for h in logging.getLogger().handlers if not type(h).__module__.startswith("_pytest")]


@pytest.fixture(autouse=True)
def _process_state_kept():
    """Libraries that tests drive in-process change the worker for the tests after them: the
    tinker-cookbook recipes replace the root logger's handlers with a ``StreamHandler`` bound to
    the ``sys.stderr`` of that moment and a ``FileHandler`` (``ml_log.configure_logging_module``),
    and a verifiers environment installs its own SIGINT and SIGTERM handlers. A later test's
    warning then goes through another test's handler (CI once printed "--- Logging error ---" and
    a traceback into a run that had none), and a later test's SIGINT runs another library's
    teardown. Each test gets the root logger's handlers and level, and the SIGINT and SIGTERM
    handlers, as they were before it; what a test left is removed and named in a warning, so that
    the source of a leak shows in the summary instead of in an unrelated test."""
    import logging
    import signal
    import warnings

    root = logging.getLogger()
    handlers, level = _foreign_root_handlers(), root.level
    signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    left = [h for h in _foreign_root_handlers() if h not in handlers]
    for handler in left:
        root.removeHandler(handler)
        with contextlib.suppress(Exception):
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)
    changed = [sig for sig, before in signals.items() if before is not None and signal.getsignal(sig) is not before]
    for sig in changed:
        signal.signal(sig, signals[sig])
    if left or changed:
        what = [f"root logging handler {type(h).__module__}.{type(h).__name__}" for h in left] + [
            f"{sig.name} handler" for sig in changed]
        warnings.warn(f"the test left {', '.join(what)}; restored", stacklevel=1)
