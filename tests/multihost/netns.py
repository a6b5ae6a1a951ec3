"""Several network hosts on one machine: Linux network namespaces joined by veth pairs to a
bridge, for tests of what loopback hides (which address a process binds and advertises, which
interface gloo picks, a link that drops).

A :class:`Network` of ``n`` hosts is ``n + 1`` namespaces: a switch holding a bridge, and one
namespace per host with its own loopback and one interface, ``eth0``, at ``10.231.0.(i+1)/24``,
whose other end is the switch's port ``port<i>``. The addresses exist only inside the
namespaces: nothing touches the machine's own interfaces, routes or files, and each network is
a world of its own (two test sessions may use the same subnet at once). Cutting a host's link
(:meth:`Network.cut`) sets its switch port down: its packets are dropped silently, as when a
cable is pulled or a switch fails, not refused.

Namespace names carry the creating process's id (``grpo-net-<pid>-<n>-...``): a network left
behind by a killed test session is deleted, with its processes, by the next
:meth:`Network.create` (:func:`sweep_leftovers`). Needs root (``CAP_SYS_ADMIN`` and
``CAP_NET_ADMIN``) and iproute2's ``ip``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PREFIX = "grpo-net-"
SUBNET = "10.231.0"
INTERFACE = "eth0"
_COUNTER = itertools.count()


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``ip ARGS`` (iproute2), its output captured; CalledProcessError if it fails and ``check``."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespaces() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def delete_namespace(name: str) -> None:
    """Kill every process in namespace ``name``, then delete it."""
    for pid in ip("netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "delete", name, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers() -> list[str]:
    """Delete the namespaces of networks whose creating process is gone (a test session killed
    before its teardown); return their names."""
    swept = []
    for name in namespaces():
        found = re.match(rf"{re.escape(PREFIX)}(\d+)-", name)
        if found and not _alive(int(found.group(1))):
            delete_namespace(name)
            swept.append(name)
    return swept


@dataclass
class Host:
    """One host of a :class:`Network`: a namespace with one address."""

    network: Network
    index: int
    namespace: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run in this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        """Start ``argv`` on this host in a session of its own (stdout and stderr to ``log``);
        it is killed with its whole process group when the network is torn down."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(self.command(argv), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True)
        self.network.processes.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to completion, output captured as text."""
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, **kwargs)


@dataclass
class Network:
    """``size`` hosts on ``10.231.0.0/24`` behind one switch (see the module doc)."""

    size: int = 3
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-{next(_COUNTER)}")
    hosts: list[Host] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def create(self) -> Network:
        """Make the namespaces, the bridge and the links; CalledProcessError (with ``ip``'s
        message) or OSError where namespaces cannot be made. Half-made networks are removed."""
        sweep_leftovers()
        try:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.size):
                host = Host(self, i, f"{self.tag}-h{i}", f"{SUBNET}.{i + 1}")
                self.hosts.append(host)
                ip("netns", "add", host.namespace)
                ip("-n", self.switch, "link", "add", f"port{i}", "type", "veth", "peer", "name", INTERFACE,
                   "netns", host.namespace)
                ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
                ip("-n", self.switch, "link", "set", f"port{i}", "up")
                ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
                ip("-n", host.namespace, "link", "set", INTERFACE, "up")
                ip("-n", host.namespace, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def cut(self, host: Host) -> None:
        """Take ``host``'s link down at the switch: its packets are dropped from now on."""
        ip("-n", self.switch, "link", "set", f"port{host.index}", "down")

    def restore(self, host: Host) -> None:
        ip("-n", self.switch, "link", "set", f"port{host.index}", "up")

    def stop(self, proc: subprocess.Popen) -> None:
        """Kill ``proc``'s process group (a process started by :meth:`Host.start`)."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)

    def destroy(self) -> None:
        """Kill every process started on the network (their process groups), then delete the
        namespaces (killing whatever still runs in them)."""
        for proc in self.processes:
            self.stop(proc)
        for name in [h.namespace for h in self.hosts] + [self.switch]:
            if name in namespaces():
                delete_namespace(name)


@contextlib.contextmanager
def made_network(size: int = 3) -> Iterator[Network]:
    """A :class:`Network` of ``size`` hosts for the body, destroyed after it whatever happens.
    Where namespaces cannot be made the test is skipped, saying why; ``GRPO_REQUIRE_NETNS=1``
    makes that a failure instead (a machine where these tests must run)."""
    net = Network(size)
    try:
        net.create()
    except (OSError, subprocess.SubprocessError) as exc:
        why = " ".join(str(getattr(exc, "stderr", None) or exc).split())
        message = (f"network namespaces cannot be made here ({why}); the multi-host tests need root "
                   "(CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2's ip command")
        if os.environ.get("GRPO_REQUIRE_NETNS") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        yield net
    finally:
        net.destroy()


def wait_for(condition, timeout: float, what: str, poll: float = 0.1) -> float:
    """Poll ``condition()`` until it is true; the seconds it took, or AssertionError naming ``what``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)
    return time.monotonic() - start
