"""The built-in ``local`` launcher: the processes of a run on this host, one per rank
(``grpo-run run SPEC --nproc N``), with the environment torchrun would give them.

It is written with the public pieces of :mod:`grpo_core.launching` only, as a Ray or SLURM
launcher in a plugin of its own would be.
"""

from __future__ import annotations

import os
import subprocess

from pydantic import BaseModel, ConfigDict, Field

from grpo_core import hookimpl
from grpo_core.contracts import RunArguments
from grpo_core.launching import PARENT_ENV, forwarding_signals, free_port, supervise


class LocalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threads: int | None = Field(
        None, ge=1, description="OMP_NUM_THREADS of each process; default: the launcher's own OMP_NUM_THREADS, "
        "else this host's cores divided by the number of processes.")


class Local:
    """The processes of the run on this host, one per rank, supervised."""

    def __init__(self, options: LocalOptions):
        self.options = options

    def launch(self, run: RunArguments, spec) -> int:
        port = free_port()
        threads = (self.options.threads or os.environ.get("OMP_NUM_THREADS")
                   or max(1, (os.cpu_count() or 1) // run.nproc))
        procs: list[subprocess.Popen] = []
        with forwarding_signals(procs):
            for rank in range(run.nproc):
                env = {**os.environ, **run.environment(rank, run.nproc, "127.0.0.1", port),
                       "OMP_NUM_THREADS": str(threads), PARENT_ENV: str(os.getpid())}
                # Own session: a terminal's Ctrl-C reaches the children once, forwarded by this
                # process, not twice (a second signal means "stop now, no checkpoint").
                procs.append(subprocess.Popen(run.command(), env=env, start_new_session=True))
            return supervise(procs)


@hookimpl
def register_launchers(register):
    register.add("local", Local, options=LocalOptions)
