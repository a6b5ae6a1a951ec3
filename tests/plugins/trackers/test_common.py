"""What the optional trackers share: completion tables as markdown, and a lean core (a spec that
selects one without its package fails validation naming the install; loading the plugins imports
neither package)."""

from __future__ import annotations

import sys

import pytest
from grpo_plugins.trackers.common import markdown_table

from grpo_core.errors import SpecError
from grpo_core.spec import load_spec


def test_markdown_table_escapes_cells_and_cuts_long_ones():
    table = markdown_table([{"a": "x|y\nz", "b": "w" * 20}], limit=5)
    assert table.splitlines() == ["| a | b |", "|---|---|", "| x\\|y<br>z | wwwww |"]
    assert markdown_table([]) == ""


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_a_tracker_without_its_package_fails_validation_naming_the_install(package, monkeypatch, tmp_path):
    # sys.modules[name] = None is Python's own way of making a package absent.
    monkeypatch.setitem(sys.modules, package, None)
    spec = {"model": {"path": "m"}, "rewards": [{"name": "accuracy"}], "tracking": [{"name": package}]}
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    assert f"spec.tracking.0: tracker '{package}' needs the {package} package" in str(err.value)
    assert f"pip install 'grpo-core[{package}]'" in str(err.value)


def test_importing_the_plugins_imports_neither_package():
    import subprocess

    code = ("import sys; from grpo_core.plugin_manager import load_plugins; load_plugins(); "
            "print(sorted(m for m in ('wandb', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
