"""Plugin code is user code (issue 26, item 3): ``SystemExit`` from a reward function, from
another plugin during a step, or from a plugin file at import is that plugin's fault,
reported as such (naming it) with the usual exit code, and the last completed step is
checkpointed; with ``reward_errors: none`` a reward that exits is scored None and counted."""

from __future__ import annotations

import asyncio
import sys

import pytest

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main
from grpo_core.errors import RunError
from grpo_core.train.actor.scoring import RewardFn, score

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def exits_on_bb(prompts, completions, **kwargs):
    if "bb" in completions:
        sys.exit(3)
    return [1.0] * len(completions)


async def async_exits_on_bb(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return exits_on_bb(prompts, completions)


@pytest.mark.parametrize("fn", [exits_on_bb, async_exits_on_bb], ids=["sync", "async"])
@pytest.mark.parametrize("concurrency", [1, 2])
def test_a_reward_calling_sys_exit_is_its_fault(fn, concurrency):
    fns = [RewardFn.of("quitter", 1.0, fn, concurrency=concurrency)]
    with pytest.raises(RunError, match=r"reward function 'quitter' raised SystemExit \(sys.exit\(3\) was called\) "
                       r"on completion 1 \(prompt: 'p1'\)"):
        score(fns, PROMPTS, COMPLETIONS, {}, [[1]] * 3, "raise")
    out = score(fns, PROMPTS, COMPLETIONS, {}, [[1]] * 3, "none")  # scored None and counted, the rest kept
    assert out.failed == 1 and out.total.tolist()[0] == 1.0 and out.total.isnan().tolist() == [False, True, False]


QUITTER = '''
import sys
from grpo_core import hookimpl

calls = {"n": 0}

def quitter(prompts, completions, **kwargs):
    """Exits on step 2 (its 2nd call, and the 8 calls that retry that batch one completion at a
    time), as an argparse-based scorer given bad flags would."""
    calls["n"] += 1
    if 2 <= calls["n"] <= 10:
        sys.exit(2)
    return [1.0] * len(completions)

@hookimpl
def register_reward_functions(register):
    register.add("quitter", quitter)
'''

ESTIMATOR = '''
import sys
from grpo_core import hookimpl
from grpo_plugins.advantages.grpo import GRPOAdvantage, GRPOOptions

class QuittingAdvantage(GRPOAdvantage):
    calls = 0

    def __call__(self, *args, **kwargs):
        type(self).calls += 1
        if type(self).calls == 2:
            sys.exit(0)
        return super().__call__(*args, **kwargs)

@hookimpl
def register_advantage_estimators(register):
    register.add("quitting", QuittingAdvantage, options=GRPOOptions)
'''


def _steps(folder) -> list[int]:
    return [int(f.name[len(ckpt.PREFIX):]) for f in ckpt.list_checkpoints(folder)]


def test_a_run_whose_reward_exits_fails_with_exit_1_naming_it_and_keeps_step_1(tmp_path, write_spec, capsys):
    (tmp_path / "quitter.py").write_text(QUITTER)
    spec = write_spec(tmp_path, plugins=["quitter.py"], rewards=[{"name": "quitter"}])
    assert main([str(spec)]) == 1
    err = capsys.readouterr().err
    assert "grpo-run: error: reward function 'quitter' raised SystemExit (sys.exit(2) was called)" in err
    assert "step 2 failed before its update; checkpoint of step 1" in err
    assert _steps(tmp_path / "out" / "checkpoints") == [1]


def test_with_reward_errors_none_a_reward_that_exits_is_scored_none(tmp_path, write_spec, kit, capsys):
    (tmp_path / "quitter.py").write_text(QUITTER)
    spec = write_spec(tmp_path, plugins=["quitter.py"], rewards=[{"name": "quitter"}],
                      train={"steps": 3, "reward_errors": "none"})
    assert main([str(spec)]) == 0
    failed = [r["reward/failed"] for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl")]
    assert failed == [0, 8, 0]  # step 2's batch: every completion retried alone, each exited


@pytest.mark.skipif(sys.platform == "win32", reason="posix paths in the message")
def test_another_plugin_exiting_mid_run_is_exit_1_naming_its_code_with_the_last_step_kept(
    tmp_path, write_spec, capsys
):
    (tmp_path / "quitting.py").write_text(ESTIMATOR)
    spec = write_spec(tmp_path, plugins=["quitting.py"], algorithm={"advantage": {"name": "quitting"}})
    assert main([str(spec)]) == 1
    err = capsys.readouterr().err
    assert "grpo-run: error: SystemExit (sys.exit(0) was called) in plugin code (" in err
    assert f"{tmp_path / 'quitting.py'}:" in err  # the plugin file and line that called it
    assert "step 2 failed before its update; checkpoint of step 1" in err
    assert _steps(tmp_path / "out" / "checkpoints") == [1]


@pytest.mark.parametrize("command", [["validate"], []], ids=["validate", "run"])
@pytest.mark.parametrize("code", [0, 3])
def test_a_plugin_file_calling_sys_exit_at_import_is_an_invalid_spec(tmp_path, write_spec, capsys, command, code):
    (tmp_path / "bye.py").write_text(f"import sys\nsys.exit({code})\n")
    spec = write_spec(tmp_path, plugins=["bye.py"])
    assert main([*command, str(spec)]) == 2
    err = capsys.readouterr().err
    assert f'Error importing plugin file "{tmp_path / "bye.py"}": SystemExit (sys.exit({code}) was called)' in err
    assert not (tmp_path / "out").exists()
