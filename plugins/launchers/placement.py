"""The placement plan the ``ray`` and ``slurm`` launchers read: one pure function,
:func:`plan`, from the run (its number of learner ranks), the launcher's options (the
resources of a rank and of a rollout server, how many servers, pack or spread) and a view of
the cluster (its nodes and what each has free) to the roles, their bundles (one per process:
the node it runs on, its CPUs and GPUs) and each process's variables.

What it guarantees, whatever the input (tests/core/test_placement.py checks it with hypothesis):

- every bundle fits its node, and no node gives more CPUs or GPUs than it has;
- learner ranks are numbered node by node (``RANK`` 0 on the first node that holds one,
  consecutive on a node), so ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are those of the node and
  ``MASTER_ADDR`` is rank 0's node, where :func:`plan` asks for ``MASTER_PORT``;
- rollout servers go to nodes without a learner rank first, and each gets a port free on its
  node; the trainer ranks get their URLs, the shared secret and the weight channel's host
  (rank 0's node) as ``--set`` overrides and variables, so the user writes no URL;
- a request the cluster cannot hold is a :class:`~grpo_core.errors.RunError` at once, naming
  what is missing (the CPUs or GPUs asked for and the most a node has, or the totals), never a
  wait.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from grpo_core.errors import RunError

#: Where the trainer ranks and the rollout servers find the servers' shared secret.
SECRET_ENV = "GRPO_SERVE_SECRET"
STRATEGIES = ("pack", "spread")


@dataclass(frozen=True)
class Node:
    """One node of the cluster as a launcher sees it: its address (the one the other nodes
    reach it at) and the CPUs and GPUs free on it."""

    address: str
    cpus: float
    gpus: float = 0.0


@dataclass(frozen=True)
class Bundle:
    """One process of the run, placed: its role (``learner`` or ``server``), its index in the
    role (a learner's ``RANK``), its node, the resources it holds there, and the variables
    added to its environment. A server's ``port`` is its HTTP port on its node."""

    role: str
    index: int
    node: str
    cpus: float
    gpus: float
    env: Mapping[str, str] = field(default_factory=dict)
    port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.node}:{self.port}"


@dataclass(frozen=True)
class Plan:
    """The whole run placed: the learner ranks in rank order, the rollout servers, the
    rendezvous, and what the trainer ranks are handed about the servers."""

    learners: tuple[Bundle, ...]
    servers: tuple[Bundle, ...]
    master_addr: str
    master_port: int

    @property
    def nodes(self) -> list[str]:
        """The nodes the run uses, in the order of first use (learners first)."""
        return list(dict.fromkeys(b.node for b in (*self.learners, *self.servers)))

    def overrides(self) -> tuple[str, ...]:
        """The ``--set`` assignments that hand the servers to the trainer: their URLs, the
        variable that holds their shared secret (:data:`SECRET_ENV`, set in every process), and
        the weight channel's host (rank 0's node; its ports chosen free there by the learner,
        ``weight_port: 0``, as they are known to be free only on that node when it binds them)."""
        if not self.servers:
            return ()
        return (f"rollout.urls={json.dumps([s.url for s in self.servers])}",
                f"rollout.secret_env={SECRET_ENV}", f"rollout.weight_host={self.master_addr}")


def _describe(cpus: float, gpus: float) -> str:
    parts = [f"{cpus:g} CPU{'s' if cpus != 1 else ''}"]
    if gpus:
        parts.append(f"{gpus:g} GPU{'s' if gpus != 1 else ''}")
    return " and ".join(parts)


def check_fits(role: str, count: int, cpus: float, gpus: float, nodes: Sequence[Node]) -> None:
    """A :class:`RunError` when ``count`` bundles of ``cpus`` and ``gpus`` can never fit the
    nodes: one bundle larger than every node, or more in all than the cluster has."""
    if not nodes:
        raise RunError("the cluster has no node to place the run on")
    for what, need, have in (("CPUs", cpus, [n.cpus for n in nodes]), ("GPUs", gpus, [n.gpus for n in nodes])):
        if need > max(have):
            raise RunError(f"one {role} process asks for {need:g} {what}, and no node has that many: the most "
                           f"a node of the cluster has free is {max(have):g} ({len(nodes)} node(s))")
        if count * need > sum(have):
            raise RunError(f"{count} {role} process(es) of {need:g} {what} each need {count * need:g} {what}; "
                           f"the cluster has {sum(have):g} free over {len(nodes)} node(s)")


def _place(count: int, cpus: float, gpus: float, order: list[int], free: list[list[float]],
           spread: bool, role: str) -> list[int]:
    """Node index of each of ``count`` bundles, taken from ``free`` (updated): first fit in
    ``order`` (pack), or one per node in turn (spread)."""
    placed: list[int] = []
    turn = 0
    for _ in range(count):
        for k in range(len(order)):
            i = order[(turn + k) % len(order)] if spread else order[k]
            if free[i][0] >= cpus and free[i][1] >= gpus:
                free[i][0] -= cpus
                free[i][1] -= gpus
                placed.append(i)
                turn = (turn + k + 1) % len(order)
                break
        else:
            raise RunError(f"the {role} processes do not fit the cluster's nodes together ({len(placed)} of {count} "
                           f"placed, each of {_describe(cpus, gpus)}); ask for fewer or smaller ones, or add nodes")
    return placed


def plan(nproc: int, nodes: Sequence[Node], *, cpus: float = 1.0, gpus: float = 0.0, servers: int = 0,
         server_cpus: float = 1.0, server_gpus: float = 0.0, strategy: str = "pack",
         port_on: Callable[[str], int], secret: str | None = None) -> Plan:
    """Place ``nproc`` learner ranks of ``cpus`` and ``gpus`` each and ``servers`` rollout
    servers of ``server_cpus`` and ``server_gpus`` on ``nodes`` (the first node is filled first
    under ``pack``; ``spread`` puts the ranks on the nodes in turn). ``port_on(address)`` is a
    port free on that node (asked once for the rendezvous and once per server); ``secret`` is
    the servers' shared secret, given to every process as ``GRPO_SERVE_SECRET`` when there are
    servers. A :class:`RunError` when the request cannot be placed (see the module docstring)."""
    if nproc < 1:
        raise RunError(f"a run needs at least one learner process, got nproc={nproc}")
    if strategy not in STRATEGIES:
        raise RunError(f"placement strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if servers < 0:
        raise RunError(f"servers must be 0 or more, got {servers}")
    check_fits("learner", nproc, cpus, gpus, nodes)
    if servers:
        check_fits("rollout server", servers, server_cpus, server_gpus, nodes)
    free = [[n.cpus, n.gpus] for n in nodes]
    every = list(range(len(nodes)))
    at = _place(nproc, cpus, gpus, every, free, strategy == "spread", "learner")
    used = set(at)
    # Servers on nodes without a learner first, one per node in turn; then wherever they fit.
    server_at = _place(servers, server_cpus, server_gpus, [i for i in every if i not in used] + sorted(used),
                       free, True, "rollout server")
    node_order = list(dict.fromkeys(at))  # nodes in the order their first rank was placed
    by_node = {i: [k for k, n in enumerate(at) if n == i] for i in node_order}
    master = nodes[node_order[0]].address
    master_port = port_on(master)
    shared = {SECRET_ENV: secret} if servers and secret else {}
    server_bundles = tuple(
        Bundle("server", k, nodes[i].address, server_cpus, server_gpus, env=dict(shared),
               port=port_on(nodes[i].address))
        for k, i in enumerate(server_at))
    learners: list[Bundle] = []
    for i in node_order:
        for local, _ in enumerate(by_node[i]):
            rank = len(learners)
            env = {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(local),
                   "LOCAL_WORLD_SIZE": str(len(by_node[i])), "MASTER_ADDR": master,
                   "MASTER_PORT": str(master_port), **shared}
            learners.append(Bundle("learner", rank, nodes[i].address, cpus, gpus, env=env))
    return Plan(tuple(learners), server_bundles, master, master_port)
