"""What a backend of rollout servers shares (:mod:`grpo_plugins.rollout.servers`): a server's
URL checked, the split of a step's prompts over servers, the failover bookkeeping and its error."""

from __future__ import annotations

import pytest
from grpo_plugins.rollout.servers import Failover, assign_prompts, check_url
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.errors import RunError


def test_check_url_keeps_a_path_prefix_and_refuses_a_query():
    assert check_url("https://h.example:443/vllm/") == "https://h.example:443/vllm"
    with pytest.raises(ValueError, match="write http://HOST:PORT"):
        check_url("http://h:80/?x=1")


@given(st.integers(0, 200), st.integers(1, 17))
def test_assign_prompts_gives_contiguous_near_equal_parts(n_prompts, n_servers):
    owners = assign_prompts(n_prompts, n_servers)
    assert len(owners) == n_prompts
    assert owners == sorted(owners)  # contiguous, in server order
    sizes = [owners.count(s) for s in range(n_servers)]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger parts first


def test_assign_prompts_exact_case():
    assert assign_prompts(7, 3) == [0, 0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="at least one server"):
        assign_prompts(3, 0)


def test_failover_moves_a_dropped_servers_prompts_to_the_live_ones_in_turn():
    urls = ["http://a:1", "http://b:2", "http://c:3"]
    failover = Failover(urls, "vllm-server")
    failover.drop("http://b:2", "ConnectTimeout: refused")
    failover.drop("http://b:2", "a second reason is not recorded")
    assert failover.live() == ["http://a:1", "http://c:3"]
    assert failover.reassign([4, 5, 6]) == {4: "http://a:1", 5: "http://c:3", 6: "http://a:1"}
    failover.drop("http://a:1", "HTTP 500")
    failover.drop("http://c:3", "timed out")
    with pytest.raises(RunError) as info:
        failover.reassign([4])
    message = str(info.value)
    assert message == ("vllm-server rollout: no rollout server is left (http://a:1: HTTP 500; "
                       "http://b:2: ConnectTimeout: refused; http://c:3: timed out)")
