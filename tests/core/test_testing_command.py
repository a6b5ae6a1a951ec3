"""``python -m grpo_core.testing``: a real command line (``--help``, ``--vision``), and a
folder that looks like an option refused rather than created."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_core.testing", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_writes_nothing(tmp_path, flag):
    done = run(tmp_path, flag)
    assert done.returncode == 0, done.stderr
    assert "usage: python -m grpo_core.testing [-h] [--vision] DIR" in done.stdout and "--vision" in done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("args", "message"), [
    (["--", "--help"], "DIR '--help' looks like an option, not a folder (write ./--help for a folder of that name)"),
    (["--", "-v"], "DIR '-v' looks like an option"),
    (["--bogus", "m"], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: DIR"),
])
def test_a_bad_command_line_exits_2_naming_it_and_writes_nothing(tmp_path, args, message):
    done = run(tmp_path, *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_folder_is_written_and_its_path_printed(tmp_path):
    done = run(tmp_path, "./--tiny")  # a folder of that name, said plainly
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("--tiny") and (tmp_path / "--tiny" / "config.json").is_file()
