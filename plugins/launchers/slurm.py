"""The ``slurm`` launcher: the learner ranks started by ``srun`` (``grpo-run run SPEC --launcher
slurm --nproc N``).

- Inside an allocation (``salloc``, or a batch script: ``SLURM_JOB_ID`` is set), it checks the
  request against the allocation's nodes (the placement plan, :func:`.placement.plan`), then
  runs one ``srun`` step of ``N`` tasks, each labelled with its rank in the output. Every task
  runs this module, which turns SLURM's variables into the run's (``RANK`` from
  ``SLURM_PROCID``, ``LOCAL_RANK`` from ``SLURM_LOCALID``, ``LOCAL_WORLD_SIZE`` from the step's
  tasks on its node; :func:`rank_environment`) and becomes the trainer; ``MASTER_ADDR`` is the
  first host of the allocation's node list, ``MASTER_PORT`` a port free there (or one derived
  from the job id when the launcher runs on another host).
- Outside one, it submits: an ``sbatch`` script written from the run and the options into the
  run folder (``slurm/job.sbatch``), with as many nodes as the plan needs on the partition's
  nodes (``sinfo``), which runs the same ``srun`` step. It is first tried with
  ``sbatch --test-only``: a request the partition can never hold is refused at once with
  SLURM's reason, never left pending; a submitted job pending for a reason that cannot pass
  (a partition or association limit) is cancelled with that reason. The launcher waits for the
  job (``sbatch --wait``), streams its output file, and exits with its code.

Supervision: SIGINT and SIGTERM are passed on once to the ranks (``scancel --signal``, which
signals the job's steps); a rank that fails makes ``srun`` end the step
(``--kill-on-bad-exit``: the others get SIGTERM, SIGKILL after the cluster's ``KillWait``),
and the exit code is ``srun``'s, the failed task's. ``srun`` dies with the launcher
(``PR_SET_PDEATHSIG``), and each rank with its ``slurmstepd``; a submitted job is cancelled
when the launcher is gone, however it ended (SIGKILL included: a watcher process scancels the
job when the launcher's end of its pipe closes).

The grace period is SLURM's, not ``local``'s 5 s then SIGTERM then 30 s: the others get SIGTERM at
once, SIGKILL after ``KillWait``. Only ``srun`` sees each task end (the launcher sees the step), and
srun's own delay (``--wait``) also counts a task that ended well, so it would kill rank 0 while it
writes the final model after the others are done. SIGTERM at once loses nothing here: a rank's first
SIGTERM only asks it to stop at the step's end, and one waiting on the failed rank fails on the
broken connection as under ``local`` (ddp's rank 0 still writes the checkpoint of the last
completed step); SIGKILL after ``KillWait`` is what ``slurmstepd`` enforces on every step end.
"""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo_core import hookimpl
from grpo_core.contracts import RunArguments
from grpo_core.errors import RunError
from grpo_core.launching import PARENT_ENV, forwarding_signals, free_port, supervise

from .placement import Node, plan

CANCEL_FLAG = "--cancel-when-gone"
#: Pending reasons that never pass by waiting: the job is cancelled and the run fails with it.
HOPELESS = ("PartitionNodeLimit", "PartitionConfig", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
            "InvalidQOS", "QOSMaxCpuPerJobLimit", "QOSMaxGRESPerJob", "QOSMaxNodePerJobLimit", "AssocMaxJobsLimit",
            "AssocMaxCpuPerJobLimit", "AssocMaxNodePerJobLimit", "AssocMaxGRESPerJob")


class SlurmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "srun", "sbatch"] = Field(
        "auto", description="srun: start the ranks in the current allocation; sbatch: submit a job that does; "
        "auto: srun inside an allocation (SLURM_JOB_ID set), else sbatch")
    cpus_per_rank: int = Field(1, ge=1, description="CPUs of each rank (srun --cpus-per-task)")
    gpus_per_rank: int = Field(0, ge=0, description="GPUs of each rank (srun --gpus-per-task)")
    strategy: Literal["pack", "spread"] = Field(
        "pack", description="sbatch: pack, as few nodes as hold the ranks; spread: the ranks over the "
        "partition's nodes in turn")
    partition: str | None = Field(None, description="sbatch --partition; default: the cluster's default")
    account: str | None = Field(None, description="sbatch --account")
    time: str | None = Field(None, description="sbatch --time (e.g. 04:00:00)")
    sbatch_args: list[str] = Field(default_factory=list, description="more #SBATCH lines' options, as given")
    python: str | None = Field(None, description="the Python of the ranks on every node; default: this one")
    threads: int | None = Field(None, ge=1, description="OMP_NUM_THREADS of each rank; default: cpus_per_rank")
    poll_s: float = Field(5.0, gt=0, description="sbatch: how often a pending job's reason is read")


def tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed counts, ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise RunError(f"cannot read SLURM's per-node count {value!r}")
        out += [int(match[1])] * int(match[2] or 1)
    return out


def rank_environment(slurm: Mapping[str, str]) -> dict[str, str]:
    """The run's variables of one ``srun`` task from SLURM's: ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (``MASTER_ADDR`` and ``MASTER_PORT`` are the step's,
    set by the launcher or the batch script)."""
    counts = tasks_per_node(slurm.get("SLURM_STEP_TASKS_PER_NODE") or slurm["SLURM_TASKS_PER_NODE"])
    return {"RANK": slurm["SLURM_PROCID"], "WORLD_SIZE": slurm.get("SLURM_STEP_NUM_TASKS") or slurm["SLURM_NTASKS"],
            "LOCAL_RANK": slurm["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": str(counts[int(slurm["SLURM_NODEID"])]),
            "MASTER_ADDR": slurm["MASTER_ADDR"], "MASTER_PORT": slurm["MASTER_PORT"]}


def _slurm(*argv: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise RunError(f"--launcher slurm: {argv[0]} is not on PATH (run it where SLURM's commands are)") from None
    if done.returncode != 0:
        raise RunError(f"{' '.join(argv[:2])}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def _hostnames(nodelist: str) -> list[str]:
    return _slurm("scontrol", "show", "hostnames", nodelist).split()


def _die_with_parent() -> None:  # in srun's child, before exec: SIGTERM when the launcher dies
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


class _Job(subprocess.Popen):
    """``srun`` or ``sbatch --wait`` as :func:`supervise` sees it; a signal goes to the job's
    steps (``scancel --signal``), that is to every rank once."""

    job_id: str | None = None

    def send_signal(self, signum: int) -> None:
        if self.job_id and self.poll() is None:
            subprocess.run(["scancel", f"--signal={signal.Signals(signum).name[3:]}", self.job_id],
                           capture_output=True, timeout=60)


class Slurm:
    """The ranks started by ``srun``, in the current allocation or in a job submitted for it."""

    def __init__(self, options: SlurmOptions):
        self.options = options

    def launch(self, run: RunArguments, spec) -> int:
        inside = bool(os.environ.get("SLURM_JOB_ID"))
        mode = self.options.mode if self.options.mode != "auto" else ("srun" if inside else "sbatch")
        if mode == "srun" and not inside:
            raise RunError("--launcher slurm with mode=srun runs inside an allocation (salloc or a batch script): "
                           "SLURM_JOB_ID is not set here; leave mode to auto to submit a job instead")
        return self._srun(run) if mode == "srun" else self._sbatch(run)

    def _srun_argv(self, run: RunArguments) -> list[str]:
        o = self.options
        argv = ["srun", f"--ntasks={run.nproc}", f"--cpus-per-task={o.cpus_per_rank}", "--kill-on-bad-exit=1",
                "--label", "--unbuffered"]
        if o.gpus_per_rank:
            argv.append(f"--gpus-per-task={o.gpus_per_rank}")
        return [*argv, o.python or sys.executable, "-m", __name__, *run.command(o.python)]

    def _srun(self, run: RunArguments) -> int:
        o = self.options
        hosts = _hostnames(os.environ["SLURM_JOB_NODELIST"])
        cpus = tasks_per_node(os.environ.get("SLURM_JOB_CPUS_PER_NODE", ",".join(["1"] * len(hosts))))
        gpus = float(os.environ.get("SLURM_GPUS_ON_NODE", 0))
        nodes = [Node(h, c, gpus) for h, c in zip(hosts, cpus)]
        job = os.environ["SLURM_JOB_ID"]
        here = os.uname().nodename.split(".")[0] == hosts[0].split(".")[0]
        port = free_port("0.0.0.0") if here else 20000 + int(job) % 20000
        plan(run.nproc, nodes, cpus=o.cpus_per_rank, gpus=o.gpus_per_rank, strategy="pack",
             port_on=lambda _: port)  # refuses, naming it, what the allocation cannot hold
        env = {**os.environ, "MASTER_ADDR": hosts[0], "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": str(o.threads or o.cpus_per_rank)}
        procs: list[_Job] = []
        with forwarding_signals(procs):
            proc = _Job(self._srun_argv(run), env=env, start_new_session=True, preexec_fn=_die_with_parent)
            proc.job_id = job
            procs.append(proc)
            return supervise(procs)

    def script(self, run: RunArguments, nodes: int) -> str:
        """The batch script of the run: its resources, then the same ``srun`` step."""
        o = self.options
        folder = Path(run.run_folder).resolve()
        lines = ["#!/bin/bash", f"#SBATCH --job-name=grpo-{folder.name}", f"#SBATCH --nodes={nodes}",
                 f"#SBATCH --ntasks={run.nproc}", f"#SBATCH --cpus-per-task={o.cpus_per_rank}",
                 f"#SBATCH --output={folder}/slurm/job-%j.out", f"#SBATCH --chdir={os.getcwd()}"]
        for flag, value in (("--partition", o.partition), ("--account", o.account), ("--time", o.time)):
            if value:
                lines.append(f"#SBATCH {flag}={value}")
        lines += [f"#SBATCH {arg}" for arg in o.sbatch_args]
        lines += ['export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
                  "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
                  f"export OMP_NUM_THREADS={o.threads or o.cpus_per_rank}",
                  "exec " + shlex.join(self._srun_argv(run))]
        return "\n".join(lines) + "\n"

    def _sbatch(self, run: RunArguments) -> int:
        o = self.options
        listing = _slurm("sinfo", "-h", "-N", "-o", "%N %c", *(["-p", o.partition] if o.partition else []))
        seen = dict(line.split()[:2] for line in listing.splitlines() if line.strip())
        nodes = [Node(name, float(cpus)) for name, cpus in seen.items()]
        placed = plan(run.nproc, nodes, cpus=o.cpus_per_rank, gpus=0, strategy=o.strategy, port_on=lambda _: 0)
        folder = Path(run.run_folder).resolve() / "slurm"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "job.sbatch"
        path.write_text(self.script(run, len(placed.nodes)), encoding="utf-8")
        check = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=60)
        if check.returncode != 0:
            raise RunError(f"SLURM refuses the job {path}: {check.stderr.strip()}")
        procs: list[_Job] = []
        with forwarding_signals(procs):
            proc = _Job(["sbatch", "--wait", "--parsable", str(path)], stdout=subprocess.PIPE, text=True,
                        start_new_session=True)
            procs.append(proc)
            proc.job_id = proc.stdout.readline().strip().split(";")[0] or None
            print(f"grpo-run: submitted SLURM job {proc.job_id} ({path})", file=sys.stderr)
            watcher = _cancel_when_gone(proc.job_id) if proc.job_id else None
            stop = threading.Event()
            copier = threading.Thread(target=_stream, args=(folder / f"job-{proc.job_id}.out", stop), daemon=True)
            copier.start()
            try:
                return self._wait(proc, procs)
            finally:
                stop.set()
                copier.join(10)
                if watcher is not None:  # the job has ended, or this launcher gives up on it: cancelled
                    watcher.stdin.close()
                    watcher.wait(60)

    def _wait(self, proc: _Job, procs: list[_Job]) -> int:
        while proc.poll() is None:
            state = subprocess.run(["squeue", "-h", "-j", str(proc.job_id), "-o", "%T %r"], capture_output=True,
                                   text=True, timeout=60).stdout.split()
            if len(state) == 2 and state[0] == "PENDING" and state[1].startswith(HOPELESS):
                subprocess.run(["scancel", str(proc.job_id)], capture_output=True, timeout=60)
                proc.wait(60)
                raise RunError(f"SLURM job {proc.job_id} cannot start ({state[1]}); it was cancelled")
            try:
                proc.wait(self.options.poll_s)
            except subprocess.TimeoutExpired:
                pass
        return supervise(procs)


def _cancel_when_gone(job: str) -> subprocess.Popen:
    """A watcher that cancels ``job`` once this process is gone, however it ends (SIGKILL
    included): its stdin is a pipe only this process holds, which the kernel closes then. After
    a job that ended, the ``scancel`` does nothing."""
    return subprocess.Popen([sys.executable, "-m", __name__, CANCEL_FLAG, job], stdin=subprocess.PIPE,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stream(path: Path, stop: threading.Event) -> None:
    """Copy the job's output file to this process's stderr as it grows, until ``stop``."""
    offset = 0
    while True:
        done = stop.is_set()
        if path.exists():
            with path.open("rb") as fh:
                fh.seek(offset)
                chunk = fh.read()
            offset += len(chunk)
            sys.stderr.write(chunk.decode("utf-8", "replace"))
            sys.stderr.flush()
        if done:
            return
        time.sleep(0.5)


def main(argv: list[str]) -> None:
    """One ``srun`` task: the run's variables from SLURM's, then the trainer's command in place
    of this process (which dies with its ``slurmstepd``). With ``--cancel-when-gone JOB``: the
    launcher's watcher (:func:`_cancel_when_gone`), which cancels the job at the end of its stdin."""
    if argv[:1] == [CANCEL_FLAG]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stdin.buffer.read()
        subprocess.run(["scancel", argv[1]], capture_output=True, timeout=60)
        return
    env = {**os.environ, **rank_environment(os.environ), PARENT_ENV: str(os.getppid())}
    os.execve(argv[0], argv, env)


@hookimpl
def register_launchers(register):
    register.add("slurm", Slurm, options=SlurmOptions)


if __name__ == "__main__":
    main(sys.argv[1:])
