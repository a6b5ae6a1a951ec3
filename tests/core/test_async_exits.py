"""An asynchronous run ends as a synchronous one does (issue 34, items 10 and 11): a second
signal, or a full disk while the actor generates ahead, exits with the documented code (130 /
143, 1) and a message, never ``terminate called without an active exception`` (SIGABRT, 134)
from a generation thread still inside torch while Python finalizes. A full disk names the run
folder and the command that carries on. Real ``grpo-run`` processes, completions long enough
that the actor is inside torch when the run ends."""

from __future__ import annotations

import signal
import threading
import time

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


# The second signal at several delays after the first, sent as soon as step 2 is logged: the
# actor is then generating the next batch (48 tokens, a batch of 16 rows), so the early ones
# reach the learner while it waits for that batch at a checkpoint's or the stop's rest point,
# the later ones after the first signal's checkpoint, while the process is leaving.
SECOND_SIGNAL = [(signal.SIGINT, 0), (signal.SIGINT, 30), (signal.SIGINT, 100), (signal.SIGINT, 250),
                 (signal.SIGINT, 500), (signal.SIGTERM, 30), (signal.SIGTERM, 250)]


@pytest.mark.parametrize(("signum", "delay_ms"), SECOND_SIGNAL,
                         ids=[f"{signal.Signals(s).name}-{d}ms" for s, d in SECOND_SIGNAL])
def test_a_second_signal_at_any_delay_while_the_actor_generates_exits_with_the_signals_code(
        tmp_path, write_spec, child, kit, signum, delay_ms):
    """Issue 47, item 10. Before: SIGABRT (``terminate called without an active exception``,
    -6) when the second signal interrupted the wait for the actor's batch (CPython marks a
    thread whose ``join`` was interrupted as stopped, python/cpython#90882, so the run did not
    know the actor still ran and let the interpreter finalize under it), and killed by the
    signal itself (-2, no message) when it came while the interpreter finalized after the
    first one's checkpoint. After: 128 + N at every delay, and the last checkpoint whole."""
    spec = write_spec(tmp_path, checkpoint={"every": 1}, train={"steps": 50, "prompts_per_step": 4},
                      rollout={"group_size": 4, "max_new_tokens": 48, "max_staleness": 1})
    proc = child([spec])
    proc.wait_for(lambda: kit.last_step(tmp_path / "out" / "metrics.jsonl") >= 2, 150, "step 2", poll=0.005)
    proc.signal(signum)
    time.sleep(delay_ms / 1000)
    proc.signal(signum)
    code, out = proc.wait(60), proc.output()
    assert code == 128 + signum and ABORT not in out, out
    assert "grpo-run: interrupted" in out or "grpo-run: stopped at step" in out, out
    saved = ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")
    assert saved and ckpt.verify(saved[-1]) is None, (saved, out)
    found = ckpt.find_resumable(tmp_path / "out" / "checkpoints")
    assert found is not None and found.folder == saved[-1]


GATE = '''
import os, time
from pathlib import Path
from grpo_core import hookimpl


def gate(prompts, completions, **kwargs):
    """Its second call (the batch the actor collects ahead) says so, then holds the actor's
    thread until the test releases it."""
    folder = Path(os.environ["GATE_DIR"])
    calls = folder / "calls"
    n = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(n))
    if n == 2:
        (folder / "entered").touch()
        while not (folder / "release").exists():
            time.sleep(0.01)
    return [0.0] * len(completions)


@hookimpl
def register_reward_functions(register):
    register.add("gate", gate)
'''


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def test_an_interrupted_wait_for_the_actors_batch_does_not_leave_it_running_beside_the_run(
        tmp_path, write_spec, monkeypatch):
    """Issue 47, item 10, in one process (a notebook's Ctrl-C checkpoints after stopping the
    actor). Before: after a KeyboardInterrupt in the wait for the actor's batch, stopping the
    actor again returned at once (the interrupted ``Thread.join`` had marked the thread
    stopped, python/cpython#90882) while it still ran, so a checkpoint or a restart went ahead
    beside it. After: stopping waits for its batch."""
    from grpo_core.spec import load_spec
    from grpo_core.train.loop.assemble import build_run

    (tmp_path / "gate.py").write_text(GATE)
    monkeypatch.setenv("GATE_DIR", str(tmp_path))
    spec = write_spec(tmp_path, plugins=["gate.py"], rewards=[{"name": "gate"}],
                      rollout={"group_size": 2, "max_staleness": 1})
    run = build_run(load_spec(spec))
    release = tmp_path / "release"
    run.feed.start(run.model, 0)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "entered").exists():  # the actor is inside batch 1
            assert time.monotonic() < deadline, "the actor never reached batch 1"
            time.sleep(0.01)
        previous = signal.signal(signal.SIGALRM, _interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            with pytest.raises(KeyboardInterrupt):
                run.feed.pause(run.model, 0)  # waits for the actor's batch: the alarm interrupts the wait
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        timer = threading.Timer(0.5, release.touch)
        timer.start()
        run.feed.stop(run.model, 0)
        assert release.exists(), "stop() returned while the actor was still inside its batch"
        assert not run.feed.running
    finally:
        release.touch()
        run.feed.close()
