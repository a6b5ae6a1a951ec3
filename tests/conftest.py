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
import os
import tempfile
from pathlib import Path

import pytest

os.environ["GRPO_LOAD_PLUGINS"] = ""
os.environ.pop("GRPO_DISABLED_PLUGINS", None)

#: Held exclusively while pip installs or uninstalls a plugin into this interpreter
#: (test_example_plugin.py), shared while a test loads every installed plugin. One path
#: for every pytest process on the machine: xdist workers and concurrent sessions alike.
SITE_LOCK = Path(tempfile.gettempdir()) / "grpo-core-tests-site-packages.lock"


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
