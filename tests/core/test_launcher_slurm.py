"""The ``slurm`` launcher on a real SLURM (Debian's ``slurmctld`` and ``slurmd``, one node of 2
CPUs), started once for this module as root from a slurm.conf in a temporary folder (no munge:
``auth/none`` on a one-machine cluster). Under ``salloc`` and through ``sbatch`` two ranks take
bitwise the steps of the ``local`` launcher's two; a request the cluster can never hold is refused
at once with SLURM's reason (or the plan's), never left pending.

The fixture installs the packages with apt-get where they are missing and it can (root, Debian);
elsewhere the module is skipped saying why, unless ``GRPO_REQUIRE_SLURM=1``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_core.launching import free_port

from .conftest import CHILD_ENV, load_weights, tagged_processes

# One cluster for the module, on one xdist worker (--dist loadgroup): a batch job's MASTER_PORT is
# 20000 + its job id, and two workers' clusters both number their jobs from 1, so their jobs 3 met
# on port 20003 (EADDRINUSE; it failed a full run). One cluster numbers its jobs apart.
pytestmark = pytest.mark.xdist_group("slurm-cluster")

PACKAGES = ("slurmctld", "slurmd", "slurm-client")
SPEC = {
    "data": {"name": "arithmetic", "train_size": 8, "eval_size": 0},
    "rollout": {"group_size": 2, "max_new_tokens": 4},
    "algorithm": {"advantage": {"name": "grpo", "std_scope": "batch"}},
    "train": {"steps": 2, "prompts_per_step": 2, "seed": 7},
    "checkpoint": {"every": 0},
}


def _unavailable() -> str | None:
    """Why SLURM cannot run here, after installing it where it can; None when it can."""
    if shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("sbatch"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "SLURM's daemons are not installed, and apt-get (as root) is not available to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            return f"{' '.join(argv)} failed: {done.stderr[-500:]}"
    return None


CONF = """\
ClusterName=grpo
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=30
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster; the environment that points its commands at it."""
    why = _unavailable() or (None if os.geteuid() == 0 else "the daemons are started as root")
    if why:
        if os.environ.get("GRPO_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(host=socket.gethostname().split(".")[0], root=root, ctld_port=free_port(),
                                d_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen([name, "-D", *flags, "-f", str(conf)], env=env, start_new_session=True,
                                stdout=(root / f"{name}.log").open("wb"), stderr=subprocess.STDOUT)
               for name, flags in (("slurmctld", ["-i"]), ("slurmd", []))]
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip() \
                != "idle":
            assert time.monotonic() < deadline and all(d.poll() is None for d in daemons), \
                (root / "slurmctld.log").read_text() + (root / "slurmd.log").read_text()
            time.sleep(0.5)
        yield {"SLURM_CONF": str(conf)}
    finally:
        for daemon in daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in daemons:
            daemon.wait(30)


def _run(argv: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    full = {**os.environ, **CHILD_ENV, **env}
    full.pop("WORLD_SIZE", None)
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=full, capture_output=True, text=True, timeout=400)


def _grpo(*args) -> list:
    return [sys.executable, "-m", "grpo_core.cli", "run", *args]


@pytest.mark.slow
def test_salloc_and_sbatch_take_bitwise_the_steps_of_local(slurm, tmp_path, write_spec):
    spec = write_spec(tmp_path, **SPEC)
    local = _run(_grpo(spec, "--nproc", "2", "--set", "train.output_dir=local"), tmp_path, {})
    assert local.returncode == 0, local.stderr[-3000:]
    inside = _run(["salloc", "--ntasks=2", *_grpo(spec, "--launcher", "slurm", "--nproc", "2", "--set",
                                                   "train.output_dir=salloc")], tmp_path, slurm)
    assert inside.returncode == 0, inside.stderr[-3000:]
    submitted = _run(_grpo(spec, "--launcher", "slurm", "--nproc", "2", "--set", "train.output_dir=sbatch"),
                     tmp_path, slurm)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    reference = load_weights(tmp_path / "local" / "final")
    for name in ("salloc", "sbatch"):
        weights = load_weights(tmp_path / name / "final")
        assert weights.keys() == reference.keys()
        assert all(torch.equal(weights[k], reference[k]) for k in reference), name
    # Each rank's lines reach the launcher labelled with its rank; the job's came from its output file.
    for done in (inside, submitted):
        assert "0: grpo-run: finished 2 steps." in done.stderr + done.stdout
    assert "grpo-run: submitted SLURM job" in submitted.stderr
    script = (tmp_path / "sbatch" / "slurm" / "job.sbatch").read_text()
    assert "#SBATCH --ntasks=2" in script and "srun --ntasks=2" in script


@pytest.mark.slow
def test_a_rank_killed_under_salloc_ends_the_step_and_leaves_no_process(slurm, tmp_path, write_spec, kit):
    """SIGKILL to rank 1: srun ends the step (--kill-on-bad-exit), the launcher exits with the
    failed task's code, and no rank is left."""
    tag = os.urandom(8).hex()
    spec = write_spec(tmp_path, **{**SPEC, "train": {"steps": 60, "prompts_per_step": 2, "seed": 7}})
    env = {**os.environ, **CHILD_ENV, **slurm, "GRPO_TEST_TAG": tag}
    env.pop("WORLD_SIZE", None)
    log = (tmp_path / "salloc.log").open("wb")
    proc = subprocess.Popen(["salloc", "--ntasks=2", *_grpo(spec, "--launcher", "slurm", "--nproc", "2")],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while kit.last_step(tmp_path / "out" / "metrics.jsonl") < 1:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "salloc.log").read_text()
            time.sleep(0.5)
        ranks = {rank: pid for pid, rank in tagged_processes(tag).items() if rank >= 0}
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    output = (tmp_path / "salloc.log").read_text(errors="replace")
    assert code == 128 + signal.SIGKILL, output[-3000:]
    assert "task 1: Killed" in output, output[-3000:]
    assert not tagged_processes(tag)


@pytest.mark.slow
def test_a_request_slurm_can_never_hold_is_refused_at_once_with_its_reason(slurm, tmp_path, write_spec):
    spec = write_spec(tmp_path, **SPEC)
    started = time.monotonic()
    # Beyond what the plan can see (memory): SLURM's own answer to sbatch --test-only.
    done = _run(_grpo(spec, "--launcher", "slurm", "--nproc", "2", "--launcher-option",
                      'sbatch_args=["--mem=99999999"]'), tmp_path, slurm)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "SLURM refuses the job" in done.stderr and "Requested node configuration is not available" in done.stderr
    # More CPUs than the partition has: the plan, from sinfo, names them before submitting.
    done = _run(_grpo(spec, "--launcher", "slurm", "--nproc", "2", "--launcher-option", "cpus_per_rank=2"),
                tmp_path, slurm)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "2 learner process(es) of 2 CPUs each need 4 CPUs; the cluster has 2 free over 1 node(s)" in done.stderr
    assert time.monotonic() - started < 60
    queue = subprocess.run(["squeue", "-h"], env={**os.environ, **slurm}, capture_output=True, text=True)
    assert queue.stdout.strip() == ""  # nothing left pending


@pytest.mark.slow
def test_a_submitting_grpo_run_killed_by_sigkill_leaves_no_job_and_no_rank(slurm, tmp_path, write_spec, kit):
    """grpo-run waits for its sbatch job; killed (SIGKILL, nothing of it can run), its watcher
    cancels the job: SLURM stops the ranks and the queue is empty."""
    tag = os.urandom(8).hex()
    spec = write_spec(tmp_path, **{**SPEC, "train": {"steps": 60, "prompts_per_step": 2, "seed": 7}})
    env = {**os.environ, **CHILD_ENV, **slurm, "GRPO_TEST_TAG": tag}
    env.pop("WORLD_SIZE", None)
    log = (tmp_path / "submit.log").open("wb")
    proc = subprocess.Popen(_grpo(spec, "--launcher", "slurm", "--nproc", "2"), cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while kit.last_step(tmp_path / "out" / "metrics.jsonl") < 1:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "submit.log").read_text()
            time.sleep(0.5)
        assert sorted(r for r in tagged_processes(tag).values() if r >= 0) == [0, 1]
        proc.kill()
        proc.wait(30)
        killed_at = time.monotonic()
        while (tagged_processes(tag) or _queue(slurm)) and time.monotonic() - killed_at < 60:
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert not _queue(slurm), (tmp_path / "submit.log").read_text()[-3000:]
    assert not tagged_processes(tag)


def _queue(slurm: dict) -> str:
    return subprocess.run(["squeue", "-h"], env={**os.environ, **slurm}, capture_output=True, text=True).stdout.strip()
