"""``.inf`` and ``.nan`` are refused in every duration option, at validation, naming the key
(issue 26, item 7): an infinite timeout passed ``gt=0`` and then failed every call with
``OverflowError``. The rule holds for every number of the spec and of every plugin's options
(``.nan`` was already refused where a bound such as ``gt=0`` applies: NaN compares false)."""

from __future__ import annotations

import pytest

from grpo_core.cli import main

REMOTE = "rewards=[{name: remote, url: 'http://127.0.0.1:1/', %s: %s}]"


@pytest.mark.parametrize("value", [".inf", ".Inf"])
@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("rollout.environment={name: tools, tool_timeout: %s}", "spec.rollout.environment.tool_timeout"),
        (REMOTE % ("timeout", "%s"), "spec.rewards.0.timeout"),
        (REMOTE % ("backoff_max", "%s"), "spec.rewards.0.backoff_max"),
        ("rewards=[{name: accuracy, call_timeout: %s}]", "spec.rewards.0.call_timeout"),
        ("checkpoint.every_minutes=%s", "spec.checkpoint.every_minutes"),
        ("train.lr=%s", "spec.train.lr"),
    ],
    ids=["tool_timeout", "remote-timeout", "remote-backoff_max", "call_timeout", "every_minutes", "lr"],
)
def test_a_non_finite_number_is_an_invalid_spec_naming_the_key(tmp_path, write_spec, capsys, override, path, value):
    spec = write_spec(tmp_path)
    assert main(["validate", str(spec), "--set", override % value]) == 2
    err = capsys.readouterr().err
    assert "invalid spec" in err and path in err and "Traceback" not in err
    line = next(line for line in err.splitlines() if path in line)
    assert "Input should be a finite number" in line, line
