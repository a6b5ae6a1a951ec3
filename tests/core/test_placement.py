"""The placement plan of the ``ray`` and ``slurm`` launchers (grpo_plugins.launchers.placement),
without any cluster: over many clusters and requests (hypothesis), every bundle fits its node,
ranks are numbered node by node with rank 0 on MASTER_ADDR's node, servers get their own nodes
first and their URLs reach the trainer; a request that cannot fit fails naming what is missing."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from grpo_plugins.launchers.placement import SECRET_ENV, Node, plan
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.errors import RunError


def _ports():
    counter = Counter()

    def port_on(address: str) -> int:
        counter[address] += 1
        return 20000 + counter[address]

    return port_on


nodes_st = st.lists(st.builds(Node, address=st.sampled_from([f"10.0.0.{i}" for i in range(1, 9)]),
                              cpus=st.integers(0, 16).map(float), gpus=st.integers(0, 8).map(float)),
                    min_size=1, max_size=6, unique_by=lambda n: n.address)


@settings(max_examples=300, deadline=None)
@given(nodes=nodes_st, nproc=st.integers(1, 12), cpus=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
       gpus=st.sampled_from([0.0, 1.0, 2.0]), servers=st.integers(0, 3), strategy=st.sampled_from(["pack", "spread"]))
def test_every_plan_fits_its_nodes_and_numbers_ranks_node_by_node(nodes, nproc, cpus, gpus, servers, strategy):
    try:
        placed = plan(nproc, nodes, cpus=cpus, gpus=gpus, servers=servers, server_cpus=1.0, strategy=strategy,
                      port_on=_ports(), secret="s3")
    except RunError as exc:
        # Refused only when it truly cannot fit: the totals or one bundle exceed the cluster,
        # or first fit found no room (then the message says how many were placed).
        total_cpus, total_gpus = sum(n.cpus for n in nodes), sum(n.gpus for n in nodes)
        assert (nproc * cpus + servers > total_cpus or nproc * gpus > total_gpus
                or cpus > max(n.cpus for n in nodes) or gpus > max(n.gpus for n in nodes)
                or "placed" in str(exc)), str(exc)
        return
    by_address = {n.address: n for n in nodes}
    use = Counter()
    for b in (*placed.learners, *placed.servers):
        use[b.node, "cpu"] += b.cpus
        use[b.node, "gpu"] += b.gpus
    for (address, kind), amount in use.items():
        assert amount <= (by_address[address].cpus if kind == "cpu" else by_address[address].gpus)

    assert [b.index for b in placed.learners] == list(range(nproc))
    assert placed.master_addr == placed.learners[0].node
    # Ranks are consecutive on a node; LOCAL_RANK counts within the node, LOCAL_WORLD_SIZE is its count.
    runs = [b.node for b in placed.learners]
    assert runs == sorted(runs, key=lambda a: runs.index(a))
    for b in placed.learners:
        same = [o for o in placed.learners if o.node == b.node]
        assert b.env["LOCAL_RANK"] == str(same.index(b)) and b.env["LOCAL_WORLD_SIZE"] == str(len(same))
        assert b.env["RANK"] == str(b.index) and b.env["WORLD_SIZE"] == str(nproc)
        assert (b.env["MASTER_ADDR"], b.env["MASTER_PORT"]) == (placed.master_addr, str(placed.master_port))
    # Servers: on a node without a learner whenever one had room; each port distinct on its node.
    learner_nodes = {b.node for b in placed.learners}
    free_elsewhere = [n for n in nodes if n.address not in learner_nodes and n.cpus >= 1]
    if servers and free_elsewhere:
        assert placed.servers[0].node not in learner_nodes
    assert len({(s.node, s.port) for s in placed.servers}) == servers
    assert all(s.env == {SECRET_ENV: "s3"} and b.env[SECRET_ENV] == "s3"
               for s in placed.servers for b in placed.learners)
    if servers:
        urls = json.loads(placed.overrides()[0].split("=", 1)[1])
        assert urls == [f"http://{s.node}:{s.port}" for s in placed.servers]
        assert placed.overrides()[1:] == (f"rollout.secret_env={SECRET_ENV}",
                                          f"rollout.weight_host={placed.master_addr}")
    else:
        assert placed.overrides() == () and all(SECRET_ENV not in b.env for b in placed.learners)


def test_pack_fills_the_first_node_and_spread_takes_the_nodes_in_turn():
    nodes = [Node("a", 4), Node("b", 4), Node("c", 4)]
    packed = plan(4, nodes, port_on=_ports(), servers=1)
    assert [b.node for b in packed.learners] == ["a"] * 4 and packed.servers[0].node == "b"
    assert packed.learners[3].env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
                                      "MASTER_ADDR": "a", "MASTER_PORT": "20001"}
    spread = plan(4, nodes[:2], strategy="spread", port_on=_ports())
    assert [(b.node, b.env["LOCAL_RANK"], b.env["LOCAL_WORLD_SIZE"]) for b in spread.learners] == [
        ("a", "0", "2"), ("a", "1", "2"), ("b", "0", "2"), ("b", "1", "2")]
    assert spread.nodes == ["a", "b"]


def test_a_rank_larger_than_every_node_is_refused_naming_what_is_missing():
    with pytest.raises(RunError, match=r"one learner process asks for 2 GPUs, and no node has that many: "
                                       r"the most a node of the cluster has free is 1 \(2 node\(s\)\)"):
        plan(1, [Node("a", 8, 1), Node("b", 8, 1)], gpus=2, port_on=_ports())


def test_more_than_the_cluster_has_in_all_is_refused_with_the_totals():
    with pytest.raises(RunError, match=r"3 learner process\(es\) of 4 CPUs each need 12 CPUs; "
                                       r"the cluster has 8 free over 2 node\(s\)"):
        plan(3, [Node("a", 4), Node("b", 4)], cpus=4, port_on=_ports())


def test_bad_requests_are_refused_naming_what_is_valid():
    with pytest.raises(RunError, match="strategy 'fill' is not one of pack, spread"):
        plan(1, [Node("a", 1)], strategy="fill", port_on=_ports())
    with pytest.raises(RunError, match="no node"):
        plan(1, [], port_on=_ports())


def test_an_srun_task_gets_the_run_variables_from_slurms():
    from grpo_plugins.launchers.slurm import rank_environment, tasks_per_node

    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "3",
             "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_STEP_TASKS_PER_NODE": "2(x3),3", "MASTER_ADDR": "node1",
             "MASTER_PORT": "20007"}
    assert rank_environment(slurm) == {"RANK": "5", "WORLD_SIZE": "7", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
                                       "MASTER_ADDR": "node1", "MASTER_PORT": "20007"}
    with pytest.raises(RunError, match="cannot read SLURM's per-node count '2x'"):
        tasks_per_node("2x")
