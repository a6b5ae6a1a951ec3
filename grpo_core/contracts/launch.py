"""The launcher contract: what starts the processes of one run (``grpo-run run --launcher``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class RunArguments:
    """One run as ``grpo-run run`` was asked for it, for a launcher to start.

    Attributes:
        spec: the spec's path, as given on the command line.
        overrides: the ``--set PATH=VALUE`` assignments, in order.
        resume: ``--resume``'s checkpoint (``"latest"`` or a folder), or None.
        nproc: the number of processes asked for (``--nproc``).
        run_folder: the run's folder, already claimed for this run by ``grpo-run`` (moved
            aside with ``--overwrite``, refused if it holds another run) and locked while the
            launcher runs.
    """

    spec: str
    overrides: tuple[str, ...]
    resume: str | None
    nproc: int
    run_folder: str

    def command(self, python: str | None = None) -> list[str]:
        """The command line of one process of the run: ``python -m grpo_core.cli run SPEC``
        with the overrides and the resume. Every process of a run runs this same command; the
        environment (:meth:`environment`) tells each its rank."""
        argv = [python or sys.executable, "-m", "grpo_core.cli", "run", self.spec]
        for assignment in self.overrides:
            argv += ["--set", assignment]
        if self.resume is not None:
            argv += ["--resume", self.resume]
        return argv

    def environment(self, rank: int, world_size: int, master_addr: str, master_port: int, *,
                    local_rank: int | None = None, local_world_size: int | None = None) -> dict[str, str]:
        """The variables a process of the run reads (those torchrun sets): its global
        ``RANK`` of ``WORLD_SIZE``, its ``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE`` on its host
        (default: the global ones, one host), and the rendezvous at ``MASTER_ADDR:MASTER_PORT``.
        A launcher adds them to the environment it starts the process with."""
        return {
            "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        }


@runtime_checkable
class Launcher(Protocol):
    """Starts the processes of one run and waits for them (``--launcher NAME``).

    ``launch(run, spec)`` gets the run (:class:`RunArguments`) and its validated spec, starts
    ``run.command()`` once per process with ``run.environment(...)`` added to each one's
    environment, and returns the run's exit code: 0 when every process ended with 0, else the
    code of the first that failed. :mod:`grpo_core.launching` has the supervision the
    built-in ``local`` launcher uses (stop the others when one fails, signals passed on once).

    Optional flag:
        rollout_servers: how many rollout servers this launcher starts and wires into the run
            (``ray``'s ``servers``): it hands every rank their URLs, the shared secret's
            variable and the weight channel's host as the rollout backend's ``urls``,
            ``secret_env`` and ``weight_host`` (``--set`` overrides of ``run.command()``). The
            spec is validated knowing it (the validation context's ``rollout_servers``), so a
            backend of servers addressed by URL takes no ``rollout.urls`` of its own then.
            0 (the default): the spec names its servers, if any.
    """

    rollout_servers: int = 0

    def launch(self, run: RunArguments, spec: Any) -> int: ...
