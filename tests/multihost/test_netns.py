"""The harness itself (:mod:`.netns`): hosts that reach each other by their addresses only (each
its own loopback), a cut link that drops packets rather than refusing them, a teardown that
happens when the test body fails, and a skip that says why where namespaces cannot be made."""

from __future__ import annotations

import subprocess
import sys

import pytest

from . import netns

PORT = 29650

# Accepts connections on every interface of its host and writes each peer's address.
LISTENER = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
while True:
    conn, peer = server.accept()
    conn.sendall(peer[0].encode())
    conn.close()
"""

# What a connection to ADDRESS:PORT gives: the peer address the other side saw, "refused", or
# "timeout" (nothing answered within 2 s).
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as conn:
        print(conn.recv(64).decode())
except ConnectionRefusedError:
    print("refused")
except (TimeoutError, socket.timeout):
    print("timeout")
"""


def connect(host: netns.Host, address: str) -> str:
    done = host.run([sys.executable, "-c", CONNECT, address, str(PORT)], timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_hosts_reach_each_other_by_address_only_and_a_cut_link_drops_packets(network, tmp_path):
    first, _, server = network.hosts
    assert [h.address for h in network.hosts] == ["10.231.0.1", "10.231.0.2", "10.231.0.3"]
    addresses = first.run(["ip", "-4", "-br", "addr"]).stdout.split()
    assert "10.231.0.1/24" in addresses and "10.231.0.3/24" not in addresses
    server.start([sys.executable, "-c", LISTENER, str(PORT)], tmp_path / "listener.log")
    netns.wait_for(lambda: connect(server, "127.0.0.1") == "127.0.0.1", 30, "the listener")
    # Host 0 reaches host 2 at its address, from its own; its loopback is its own.
    assert connect(first, server.address) == first.address
    assert connect(first, "127.0.0.1") == "refused"
    # A cut link answers nothing (no refusal), as a pulled cable; back up, it works again.
    network.cut(server)
    assert connect(first, server.address) == "timeout"
    network.restore(server)
    netns.wait_for(lambda: connect(first, server.address) == first.address, 30, "the link back")


def test_the_network_is_torn_down_even_when_the_test_body_fails(tmp_path):
    with pytest.raises(RuntimeError, match="the body failed"), netns.made_network(2) as net:
        names = [h.namespace for h in net.hosts] + [net.switch]
        sleeper = net.hosts[0].start(["sleep", "300"], tmp_path / "sleep.log")
        assert set(names) <= set(netns.namespaces())
        raise RuntimeError("the body failed")
    assert not set(names) & set(netns.namespaces())
    assert sleeper.poll() is not None


def test_where_namespaces_cannot_be_made_the_tests_skip_saying_why(monkeypatch):
    """As in a container without CAP_SYS_ADMIN; with GRPO_REQUIRE_NETNS=1 a failure instead."""
    def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        if args[:2] == ("netns", "add"):
            raise subprocess.CalledProcessError(1, ["ip", *args], stderr="mount --make-shared /run/netns failed: "
                                                "Operation not permitted\n")
        return subprocess.CompletedProcess(["ip", *args], 0, stdout="", stderr="")

    monkeypatch.setattr(netns, "ip", ip)
    monkeypatch.delenv("GRPO_REQUIRE_NETNS", raising=False)
    why = r"network namespaces cannot be made here \(mount --make-shared /run/netns failed: Operation not " \
          r"permitted\); the multi-host tests need root"
    with pytest.raises(pytest.skip.Exception, match=why), netns.made_network(3):
        pass
    monkeypatch.setenv("GRPO_REQUIRE_NETNS", "1")
    with pytest.raises(pytest.fail.Exception, match=why), netns.made_network(3):
        pass
