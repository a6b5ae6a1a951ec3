"""An asynchronous run ends as a synchronous one does (issue 34, items 10 and 11): a second
signal, or a full disk while the actor generates ahead, exits with the documented code (130 /
143, 1) and a message, never ``terminate called without an active exception`` (SIGABRT, 134)
from a generation thread still inside torch while Python finalizes. A full disk names the run
folder and the command that carries on. Real ``grpo-run`` processes, completions long enough
that the actor is inside torch when the run ends."""

from __future__ import annotations

import signal

import pytest

from grpo_core import checkpoint as ckpt

ABORT = "terminate called"

DISK_FULL = '''
import errno, os
from pathlib import Path
from grpo_core import checkpoint, hookimpl, tracking

FROM_STEP = 2
_log, _write = tracking.RunLog.log_metrics, checkpoint.write_checkpoint


def log_metrics(self, metrics, step):
    if os.environ["FULL_AT"] == "metrics" and step >= FROM_STEP:
        raise OSError(errno.ENOSPC, "No space left on device", str(self.metrics_path))
    return _log(self, metrics, step)


def write_checkpoint(root, step, *args, **kwargs):
    if os.environ["FULL_AT"] == "checkpoint" and step >= FROM_STEP:
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(root) / f".step-{step:06d}.tmp"))
    return _write(root, step, *args, **kwargs)


tracking.RunLog.log_metrics = log_metrics
checkpoint.write_checkpoint = write_checkpoint


@hookimpl
def register_reward_functions(register):
    pass
'''


def _long_generation(**changes) -> dict:
    rollout = {"group_size": 4, "max_new_tokens": 128, **changes.pop("rollout", {})}
    return {"rollout": rollout, "train": {"steps": 3}, **changes}


@pytest.mark.parametrize(("at", "k"), [("metrics", 1), ("checkpoint", 0)])
def test_a_full_disk_exits_1_naming_the_run_folder_and_the_resume_command(tmp_path, write_spec, child, at, k):
    """Before: ``OSError: [Errno 28] No space left on device`` alone, and under max_staleness
    a SIGABRT (134) when the failure came while the actor generated (a metrics write)."""
    (tmp_path / "disk_full.py").write_text(DISK_FULL)
    spec = write_spec(tmp_path, plugins=["disk_full.py"], checkpoint={"every": 1},
                      **_long_generation(rollout={"max_staleness": k}))
    proc = child([spec], env={"FULL_AT": at})
    code, out = proc.wait(180), proc.output()
    assert code == 1 and ABORT not in out, out
    folder = tmp_path / "out"
    assert (f"no space left on the device writing {folder}" in out
            and f"the run folder is {folder}, and the last checkpoint is {folder / 'checkpoints' / 'step-000001'}. "
                f"Free some space, then resume with: grpo-run {spec} --resume" in out), out
    assert ckpt.verify(folder / "checkpoints" / "step-000001") is None


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_stops_an_asynchronous_run_at_once_with_the_signals_code(tmp_path, write_spec, child,
                                                                                 kit, signum):
    """Before: the second Ctrl-C printed "grpo-run: interrupted", then the generation thread,
    still inside torch, aborted the process (134); a second SIGTERM gave 130, not 143."""
    spec = write_spec(tmp_path, **_long_generation(rollout={"max_staleness": 1}, train={"steps": 50}))
    proc = child([spec])
    proc.wait_for(lambda: kit.last_step(tmp_path / "out" / "metrics.jsonl") >= 1, 150, "step 1")
    proc.signal(signum)  # the first: stop after this step (the actor is generating the next batch)
    proc.wait_for(lambda: "received; stopping after this step" in proc.output(), 30, "the first signal's message")
    proc.signal(signum)  # the second: stop now
    code, out = proc.wait(60), proc.output()
    assert code == 128 + signum, out
    assert ABORT not in out and "grpo-run: interrupted" in out, out
    assert "stopped at step" not in out  # the second signal ended it, not the first one's checkpoint
