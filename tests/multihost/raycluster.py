"""A real Ray cluster over the hosts of a :class:`~.netns.Network`: the head on host 0, a worker
on each other host, each ``ray start`` with its host's address (``--node-ip-address``) and a
temporary folder of its own (nodes on one machine would otherwise share their sockets and
session files), no dashboard, Ray's token authentication off (as on the one-node test cluster
of tests/core/test_launcher_ray.py). Kept small: a few CPUs a node and an 80 MB object store.

Used by tests/multihost/test_ray_cluster.py and, with the vLLM environment's Python, by
tests/vllm/test_ray_cluster.py. The processes of the nodes carry the caller's environment
(its ``PYTHONPATH`` above all: a Ray worker imports the launcher's functions from it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .netns import Network

#: The test clusters' drivers need no token file (Ray's token authentication is on by default
#: since Ray 2.5x; a real cluster's drivers read its token instead).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
#: The nodes' own variables. No memory monitor: Ray kills its workers when the *machine* is near
#: full (95 %), whoever fills it: on a shared test machine, other tests' processes; the kernel's
#: out-of-memory killer still applies. A node that stops answering is declared dead after 5
#: missed health checks of 1 s period and 3 s timeout (Ray's 3 s and 10 s: about a minute once
#: a cut link drops its packets), no sooner than a stalled rank's train.parallel.timeout_s (20 s).
NODE_ENV = {"RAY_memory_monitor_refresh_ms": "0", "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "3000", "RAY_health_check_failure_threshold": "5"}
PORT = 6379  # the head's GCS port: free, since host 0 is a network of its own
START_S = 240  # a node starting on a loaded 2-core machine

STATE = ("import json, ray; ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False); "
         "from ray._private import state; "
         "print(json.dumps({{'nodes': sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']), "
         "'groups': [g['state'] for g in ray.util.placement_group_table().values()], "
         "'actors': [a['State'] for a in state.actors().values()]}}))")


@dataclass
class RayCluster:
    network: Network
    python: str
    env: dict[str, str]
    folder: Path

    @property
    def address(self) -> str:
        """The head's ``HOST:PORT``, as ``--launcher-option address=`` takes it."""
        return f"{self.network.hosts[0].address}:{PORT}"

    def state(self) -> dict:
        """The live nodes, the placement groups' and the actors' states, read by a fresh driver
        on the head's host."""
        done = self.network.hosts[0].run([self.python, "-c", STATE.format(address=self.address)], timeout=180,
                                         env=self.env)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


def _node(cluster: RayCluster, index: int, cpus: int) -> subprocess.Popen:
    host = cluster.network.hosts[index]
    folder = cluster.folder / f"node{index}"
    folder.mkdir()
    argv = [cluster.python, "-m", "ray.scripts.scripts", "start", "--block", f"--node-ip-address={host.address}",
            f"--num-cpus={cpus}", "--num-gpus=0", "--object-store-memory=80000000", f"--temp-dir={folder}",
            "--disable-usage-stats"]
    head = ["--head", f"--port={PORT}", "--include-dashboard=false"]
    argv += head if index == 0 else [f"--address={cluster.address}"]
    return host.start(argv, cluster.folder / f"node{index}.log", env={**cluster.env, **NODE_ENV})


def _wait_started(cluster: RayCluster, nodes: list[subprocess.Popen], indices) -> None:
    deadline = time.monotonic() + START_S
    for k in indices:
        log = cluster.folder / f"node{k}.log"
        while "Ray runtime started" not in log.read_text(errors="replace"):
            assert nodes[k].poll() is None and time.monotonic() < deadline, (
                f"Ray node {k} did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)


@contextlib.contextmanager
def ray_cluster(network: Network, python: str = sys.executable, cpus: int = 2,
                env: dict[str, str] | None = None) -> Iterator[RayCluster]:
    """A Ray node on every host of ``network`` (head first, then the workers together), each
    of ``cpus`` CPUs, run by ``python``; stopped after the body (SIGTERM to each ``ray start``'s
    session, which stops its node, SIGKILL after 15 s; whatever is left dies with the network)."""
    # Short: Ray's unix sockets live under it, and a socket's path holds 107 bytes at most.
    folder = Path(tempfile.mkdtemp(prefix="grpo-ray-", dir="/tmp"))
    cluster = RayCluster(network, python, {**os.environ, **RAY_ENV, **(env or {})}, folder)
    nodes: list[subprocess.Popen] = []
    try:
        nodes.append(_node(cluster, 0, cpus))
        _wait_started(cluster, nodes, [0])
        nodes += [_node(cluster, k, cpus) for k in range(1, len(network.hosts))]
        _wait_started(cluster, nodes, range(1, len(network.hosts)))
        yield cluster
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15  # then SIGKILL: a node cut off may never finish stopping
        for node in nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(max(0.1, deadline - time.monotonic()))
            network.stop(node)
        shutil.rmtree(folder, ignore_errors=True)


def tagged(tag: str) -> dict[int, int]:
    """pid -> ``RANK`` (-1 for a process without one: a rollout server) of the live processes
    (zombies left out) whose environment carries ``GRPO_TEST_TAG=tag``, on every host: the
    namespaces share the machine's process table."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
            stat = (entry / "stat").read_text() if env else ""
        except OSError:
            continue
        if f"GRPO_TEST_TAG={tag}".encode() in env and stat[stat.rindex(")") + 2] != "Z":
            found[int(entry.name)] = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), -1)
    return found
