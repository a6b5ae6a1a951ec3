"""An example launcher plugin: the processes of a run spread over "hosts", each host's ranks
numbered locally, as a launcher for a cluster scheduler would place them.

Here every "host" is this machine (the processes rendezvous on 127.0.0.1), so that it runs
anywhere; a SLURM or Ray launcher differs only in where it starts ``run.command()``: ``srun``
per task, or a Ray actor per rank, with the address of rank 0's host as ``master_addr``.
It imports public names only: ``grpo_core.hookimpl``, the contract's ``RunArguments`` and the
supervision in ``grpo_core.launching``.

Use it by listing this file under the spec's ``plugins:`` (or publishing it under the ``grpo``
entry-point group), then::

    grpo-run run spec.yaml --launcher hosts --nproc 2 --launcher-option hosts=2
"""

from __future__ import annotations

import json
import os
import subprocess

from pydantic import BaseModel, ConfigDict, Field

from grpo_core import hookimpl
from grpo_core.contracts import RunArguments
from grpo_core.launching import PARENT_ENV, forwarding_signals, free_port, supervise


class HostsOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hosts: int = Field(1, ge=1, description="How many hosts the processes are spread over (nproc divisible by it).")
    record: str | None = Field(None, description="A file to write each process's command and rank variables to.")


class Hosts:
    """The run's processes over ``hosts`` hosts (all this machine here), ranks numbered per host."""

    def __init__(self, options: HostsOptions):
        self.options = options

    def launch(self, run: RunArguments, spec) -> int:
        hosts = self.options.hosts
        if run.nproc % hosts:
            raise ValueError(f"hosts launcher: --nproc {run.nproc} is not divisible by hosts={hosts}")
        per_host = run.nproc // hosts
        port = free_port()
        procs: list[subprocess.Popen] = []
        placed = []
        with forwarding_signals(procs):
            for rank in range(run.nproc):
                ranks = run.environment(rank, run.nproc, "127.0.0.1", port,
                                        local_rank=rank % per_host, local_world_size=per_host)
                placed.append({"host": rank // per_host, "command": run.command(), "run_folder": run.run_folder,
                               **ranks})
                env = {**os.environ, **ranks, "OMP_NUM_THREADS": "1", PARENT_ENV: str(os.getpid())}
                procs.append(subprocess.Popen(run.command(), env=env, start_new_session=True))
            if self.options.record:
                with open(self.options.record, "w", encoding="utf-8") as out:
                    json.dump(placed, out)
            return supervise(procs)


@hookimpl
def register_launchers(register):
    register.add("hosts", Hosts, options=HostsOptions)
