"""Suite-wide setup: installed (third-party) plugins are kept out of every test.

``GRPO_LOAD_PLUGINS=""`` makes ``grpo_core.plugins.load_plugins`` load no entry point, so
the suite sees the built-ins plus what a test registers itself, whatever happens to be
installed in the interpreter (the example plugin, while ``tests/core/test_example_plugin.py``
has it installed, included). It is set at import, before any test module or fixture runs,
and is inherited by the ``grpo-run`` subprocesses that tests start. Tests that need other
values set them with ``monkeypatch.setenv`` (or an explicit ``env=`` for a subprocess).
"""

from __future__ import annotations

import os

os.environ["GRPO_LOAD_PLUGINS"] = ""
os.environ.pop("GRPO_DISABLED_PLUGINS", None)
