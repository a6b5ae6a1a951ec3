"""The ``ray`` launcher: the whole run placed on a Ray cluster (``grpo-run run SPEC --launcher
ray --nproc N``; Ray from the ``ray`` extra).

- It joins a running cluster (``address: auto``, or the head's ``HOST:PORT``), or starts one
  on this machine for the run and stops it after (no address); no dashboard is needed.
- The plan (:func:`.placement.plan`) is made from the cluster's nodes before anything waits: a
  request no node or no total can hold fails at once naming what is missing. Each bundle is
  pinned to its planned node (Ray's ``node:ADDRESS`` resource) in one placement group per role
  (learner ranks, rollout servers); if the cluster cannot hand the resources over within
  ``wait_s`` (other jobs hold them) the run fails saying so, never hangs.
- The nodes are planned with the driver's own node first, then by address (the same cluster
  gives the same plan). Every process's gloo is bound to the interface that holds its node's
  address (``GLOO_SOCKET_IFNAME`` per node, unless the driver's environment sets it): what the
  host name resolves to is often loopback, where the ranks on other nodes cannot reach it.
- The run folder must be visible from every node the plan uses (a shared file system): a node
  that cannot see it is named and the run refused before any process starts.
- Rollout servers (``servers: K``) run ``grpo-run serve`` in their bundles (in ``server_python``,
  e.g. the vLLM environment), bound beyond loopback with a shared secret made for the run; the
  launcher waits for each one's ``/health`` and hands the trainer ranks their URLs, the secret
  and the weight channel's host as ``--set`` overrides: the user writes no URL (the launcher's
  ``rollout_servers`` tells the spec's validation so; the ranks' spec, with the overrides, is
  checked before anything is placed). Once the ranks are done the servers get SIGTERM and up to
  :data:`~grpo_core.launching.KILL_AFTER_S` to stop; a server dies with its actor in any case.
- Each process runs in an actor of its bundle that starts the command in a session of its
  own (its output goes to the driver through Ray's log forwarding) and dies with the actor
  (``die_with_launcher``). The supervision is :func:`grpo_core.launching.supervise`'s, across
  nodes: SIGINT/SIGTERM passed on once, the first failure stops the rest after the grace period,
  the exit code is the root failure's; every actor and placement group is removed on every way
  out (and Ray removes them itself when the driver dies, since they belong to its job).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import secrets
import signal
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo_core import hookimpl
from grpo_core.contracts import RunArguments
from grpo_core.errors import RunError, UsageError
from grpo_core.launching import KILL_AFTER_S, PARENT_ENV, forwarding_signals, supervise

from .placement import Node, Plan, plan

#: Variables of the driver's environment the processes it starts get on every node (those of
#: the node's Ray worker otherwise): the run's own, the Hub's, torch's, and the Python path.
FORWARDED = ("GRPO_", "HF_", "TORCH", "NCCL_", "GLOO_", "PYTHONPATH", "PYTHONUNBUFFERED", "OMP_", "MKL_",
             "TOKENIZERS_", "WANDB_", "MLFLOW_", "VLLM_")


class RayOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None, description="the Ray cluster to join: auto (the one this machine belongs to), or the head's HOST:PORT; "
        "null: start a cluster on this machine for the run (stopped after it)")
    local_cpus: int | None = Field(
        None, ge=1, description="CPUs of the cluster started on this machine when address is null; default: all")
    cpus_per_rank: float = Field(1.0, gt=0, description="CPUs of each learner rank's bundle")
    gpus_per_rank: float = Field(0.0, ge=0, description="GPUs of each learner rank's bundle (1 per rank on GPUs)")
    strategy: Literal["pack", "spread"] = Field(
        "pack", description="pack: fill a node before the next; spread: the learner ranks on the nodes in turn")
    servers: int = Field(0, ge=0, description="rollout servers (grpo-run serve) to place, on nodes without a "
                         "learner rank first; their URLs are handed to rollout.urls (rollout.name: vllm-server)")
    server_cpus: float = Field(1.0, gt=0, description="CPUs of each rollout server's bundle")
    server_gpus: float = Field(0.0, ge=0, description="GPUs of each rollout server's bundle")
    server_model: str | None = Field(None, description="the model the servers load; default: the spec's model.path")
    server_python: str | None = Field(
        None, description="the Python that runs grpo-run serve on the server nodes (e.g. a vLLM environment's); "
        "default: the trainer's")
    server_args: list[str] = Field(default_factory=list, description="more arguments of each grpo-run serve: "
                                   "its own (--dtype ...), then vLLM's after --")
    python: str | None = Field(None, description="the Python of the trainer ranks on every node; default: this one")
    threads: int | None = Field(None, ge=1, description="OMP_NUM_THREADS of each rank; default: its bundle's CPUs")
    wait_s: float = Field(120.0, gt=0, description="longest wait for the placement groups and the servers' health")


class RankProcess:
    """A process of the run started by an actor, seen by the driver as a ``Popen`` is by
    :func:`supervise`: ``poll()``, ``returncode``, ``send_signal()``."""

    def __init__(self, actor, ray, name: str = "a process"):
        self.actor, self._ray, self.name = actor, ray, name
        self._done = actor.wait.remote()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._ray.wait([self._done], timeout=0)[0]:
            try:
                self.returncode = self._ray.get(self._done)
            except self._ray.exceptions.RayError as exc:  # the actor (or its node) died: as a killed process
                why = " ".join(str(exc).split())[:400]
                print(f"grpo-run: the Ray actor of {self.name} is gone, its process taken as killed (its node "
                      f"died or left the cluster, or the actor was killed): {why}", file=sys.stderr)
                self.returncode = -signal.SIGKILL
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.actor.signal.remote(int(signum))


class _Process:
    """Body of the actor that runs one process in its bundle (made a Ray actor at launch)."""

    def __init__(self, name: str):
        self.name, self.proc = name, None

    def __repr__(self) -> str:  # Ray prefixes the process's output lines with it
        return self.name

    def start(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        import subprocess

        env = {**os.environ, **env, PARENT_ENV: str(os.getpid())}
        # Own session: only this actor signals it; it gets SIGTERM when the actor dies (a rank
        # asks again itself, die_with_launcher; a rollout server does not).
        # SIGINT and SIGTERM unblocked and at their defaults: Ray's worker threads block SIGINT,
        # and a blocked or ignored signal stays so across exec (the trainer would never see it).
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True, preexec_fn=_child_setup)
        return self.proc.pid

    def wait(self) -> int:
        return self.proc.wait()

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)


def _child_setup() -> None:  # in the child, before exec
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the actor


def _free_port() -> int:
    from grpo_core.launching import free_port

    return free_port("0.0.0.0")


def _sees(path: str) -> bool:
    return os.path.exists(path)


class Ray:
    """Learner ranks and rollout servers placed on a Ray cluster, supervised from here."""

    def __init__(self, options: RayOptions):
        self.options = options
        #: The servers it places (the Launcher contract's flag): the spec names none of its own.
        self.rollout_servers = options.servers

    def launch(self, run: RunArguments, spec) -> int:
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every rank's lines, not one of each (read at import)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        try:
            import ray
        except ImportError:
            raise UsageError("--launcher ray needs Ray: pip install 'grpo-core[ray]'") from None
        o = self.options
        local = o.address is None
        own = {"include_dashboard": False, "num_cpus": o.local_cpus, "object_store_memory": 10**8} if local else {}
        ray.init(address="local" if local else o.address, logging_level="WARNING", log_to_driver=True, **own)
        groups: list = []
        actors: list = []
        try:
            return self._launch(ray, run, spec, groups, actors)
        finally:
            for actor in actors:
                ray.kill(actor)
            for group in groups:
                ray.util.remove_placement_group(group)
            ray.shutdown()

    def _launch(self, ray, run: RunArguments, spec, groups: list, actors: list) -> int:
        o = self.options
        # This machine's node first (rank 0 beside the driver where it fits), then by address:
        # the same cluster gives the same plan, whatever order Ray lists its nodes in.
        here = ray.util.get_node_ip_address()
        nodes = sorted((Node(n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0))
                        for n in ray.nodes() if n["Alive"]), key=lambda n: (n.address != here, n.address))
        on = _on_node(ray)
        secret = secrets.token_urlsafe(24) if o.servers else None
        placed = plan(run.nproc, nodes, cpus=o.cpus_per_rank, gpus=o.gpus_per_rank, servers=o.servers,
                      server_cpus=o.server_cpus, server_gpus=o.server_gpus, strategy=o.strategy,
                      port_on=lambda address: ray.get(on(address, _free_port).remote()), secret=secret)
        _check_visible(ray, on, placed, run.run_folder)
        _check_rank_spec(run, placed)
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)}
        by_node = _node_env(ray, on, placed, env)
        actor = ray.remote(_Process)
        servers = self._place(ray, actor, placed.servers, groups, actors, "rollout server")
        learners = self._place(ray, actor, placed.learners, groups, actors, "learner")
        cwd = os.getcwd()
        procs: list[RankProcess] = []
        with forwarding_signals(procs):
            if servers:
                model = o.server_model or str(spec.model.path)
                for bundle, handle in zip(placed.servers, servers):
                    argv = [o.server_python or o.python or sys.executable, "-m", "grpo_core.cli", "serve", model,
                            "--host", "0.0.0.0", "--port", str(bundle.port), *o.server_args]
                    ray.get(handle.start.remote(argv, {**env, **by_node[bundle.node], **bundle.env}, cwd))
                    procs.append(RankProcess(handle, ray, f"rollout server {bundle.index} on {bundle.node}"))
                _wait_healthy(placed, procs, o.wait_s)
            command = dataclasses.replace(run, overrides=(*run.overrides, *placed.overrides())).command(o.python)
            threads = str(o.threads or max(1, int(o.cpus_per_rank)))
            for bundle, handle in zip(placed.learners, learners):
                variables = {**env, **by_node[bundle.node], **bundle.env, "OMP_NUM_THREADS": threads}
                ray.get(handle.start.remote(command, variables, cwd))
            procs[len(servers):] = [RankProcess(h, ray, f"learner {b.index} on {b.node}")
                                    for b, h in zip(placed.learners, learners)]
            return _supervise_run(procs, len(servers))

    def _place(self, ray, actor, bundles, groups: list, actors: list, role: str) -> list:
        """One placement group for ``bundles`` (each pinned to its node), ready within
        ``wait_s``, and one actor in each bundle."""
        if not bundles:
            return []
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        shapes = [{k: v for k, v in (("CPU", b.cpus), ("GPU", b.gpus), (f"node:{b.node}", 0.001)) if v}
                  for b in bundles]
        group = ray.util.placement_group(shapes, strategy="PACK")
        groups.append(group)
        ready, _ = ray.wait([group.ready()], timeout=self.options.wait_s)
        if not ready:
            raise RunError(f"the Ray cluster did not free the {role} bundles ({shapes}) within {self.options.wait_s:g} "
                           "s: other jobs hold those resources; free them or raise --launcher-option wait_s")
        handles = []
        for k, b in enumerate(bundles):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=k)
            handle = actor.options(num_cpus=b.cpus, num_gpus=b.gpus, max_concurrency=4,
                                   scheduling_strategy=strategy).remote(f"{b.role} {b.index}")
            actors.append(handle)
            handles.append(handle)
        return handles


def _on_node(ray):
    """``on(address, fn)``: ``fn`` as a Ray task pinned to the node at ``address``, taking no CPU."""

    def on(address: str, fn):
        return ray.remote(fn).options(num_cpus=0, resources={f"node:{address}": 0.001})

    return on


def _interface_of(address: str) -> str | None:
    """The name of this node's network interface that holds ``address``, or None."""
    import psutil  # accelerate's dependency, so every node that runs a rank has it

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


def _node_env(ray, on, placed: Plan, env: dict[str, str]) -> dict[str, dict[str, str]]:
    """Variables of every process on each node of the plan: ``GLOO_SOCKET_IFNAME``, the
    interface that holds the node's address (the one the plan advertises), unless the driver's
    environment names one for every node. Without it gloo binds whatever the host name resolves
    to, often a loopback address (``127.0.1.1 HOST`` in /etc/hosts), that the other nodes
    cannot reach: the ranks would never meet."""
    if "GLOO_SOCKET_IFNAME" in env:
        return {node: {} for node in placed.nodes}
    names = ray.get([on(node, _interface_of).remote(node) for node in placed.nodes])
    return {node: {"GLOO_SOCKET_IFNAME": name} if name else {} for node, name in zip(placed.nodes, names)}


def _check_visible(ray, on, placed: Plan, folder: str) -> None:
    """Refuse the run when a node of the plan cannot see the run folder (no shared file system)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    token = Path(folder).resolve() / f".grpo-ray-{uuid.uuid4().hex}"
    token.touch()
    try:
        seen = ray.get([on(node, _sees).remote(str(token)) for node in placed.nodes])
    finally:
        token.unlink(missing_ok=True)
    blind = [node for node, ok in zip(placed.nodes, seen) if not ok]
    if blind:
        raise RunError(f"the run folder {Path(folder).resolve()} is not visible from node(s) {', '.join(blind)}: "
                       "every node must see it (a shared file system), or the ranks could not write nor resume it")


def _check_rank_spec(run: RunArguments, placed: Plan) -> None:
    """Refuse the run before any process starts when the spec the ranks will validate (with the
    servers' URLs, secret variable and weight host handed to it) is refused: a rollout backend
    that takes no server URLs, say."""
    from grpo_core.errors import SpecError
    from grpo_core.spec import load_spec

    if not placed.servers:
        return
    try:
        load_spec(run.spec, (*run.overrides, *placed.overrides()))
    except SpecError as exc:
        raise RunError(f"--launcher-option servers={len(placed.servers)}: the ranks' spec, with the servers "
                       f"handed to its rollout backend, is refused (rollout.name: vllm-server takes them):\n{exc}"
                       ) from None


def _wait_healthy(placed: Plan, procs: list[RankProcess], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    for bundle, proc in zip(placed.servers, procs):
        while True:
            if proc.poll() is not None:
                raise RunError(f"rollout server {bundle.index} on {bundle.node} exited with code {proc.returncode} "
                               "before it was healthy (its output is above)")
            try:
                with urllib.request.urlopen(f"{bundle.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RunError(f"rollout server {bundle.index} at {bundle.url} was not healthy within {wait_s:g} s")
            time.sleep(1.0)


def _supervise_run(procs: list[RankProcess], servers: int) -> int:
    """The learner ranks supervised; the servers stopped once the ranks are done (a server
    that dies first is a failure of the run like a rank's)."""
    code = supervise(procs) if not servers else _with_servers(procs, servers)
    return code


def _with_servers(procs: list[RankProcess], servers: int) -> int:
    learners = procs[servers:]
    while any(p.poll() is None for p in learners):
        if any(p.poll() is not None for p in procs[:servers]):
            print("grpo-run: a rollout server stopped during the run; stopping the ranks", file=sys.stderr)
            return supervise(procs) or 1
        time.sleep(0.2)
    code = supervise(learners)
    for p in procs[:servers]:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + KILL_AFTER_S  # a server's engine stops with it; then its actor goes
    while any(p.poll() is None for p in procs[:servers]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return code


@hookimpl
def register_launchers(register):
    register.add("ray", Ray, options=RayOptions)
