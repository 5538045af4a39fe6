"""Node options (resolved from flags and SLURM's environment, refused before launching), the host
check of groups, and the launchers' link."""

from __future__ import annotations

import pytest

from musebench.harness.nodes import Nodes, NodesRefused, check_tp, describe, first_slurm_host, resolve_nodes
from tests._processes import free_port_pair


def test_no_node_option_keeps_the_one_node_launch():
    assert resolve_nodes(launcher="torchrun", environ={}) is None
    assert resolve_nodes(launcher="virtual", environ={"SLURM_JOB_ID": "1", "SLURM_NNODES": "8"}) is None


def test_options_give_the_nodes_and_their_ranks():
    nodes = resolve_nodes(launcher="torchrun", nnodes=2, node_rank=1, nproc_per_node=4, endpoint="10.0.0.1:29500",
                          environ={})
    assert nodes == Nodes(2, 1, 4, "10.0.0.1:29500") and nodes.world == 8 and list(nodes.ranks) == [4, 5, 6, 7]
    assert nodes.torchrun_arguments() == ["--nnodes=2", "--node-rank=1", "--nproc-per-node=4", "--rdzv-backend=static",
                                          "--rdzv-endpoint=10.0.0.1:29500"]
    assert describe(nodes, 1, "gb2") == "node 1 (host gb2, ranks 4-7)"


def test_slurm_fills_what_is_not_given():
    environ = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "8", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "gb[003-010]",
               "SLURM_GPUS_ON_NODE": "4"}
    assert resolve_nodes(launcher="torchrun", environ=environ) == Nodes(8, 3, 4, "gb003:29500")
    assert resolve_nodes(launcher="torchrun", endpoint="gb003:29571", environ=environ).endpoint == "gb003:29571"
    assert first_slurm_host("node7,login[1-2]") == "node7" and first_slurm_host("a[10,12-14]") == "a10"


@pytest.mark.parametrize("options, message", [
    (dict(launcher="virtual", nnodes=2), "need --launcher torchrun"),
    (dict(launcher="torchrun", nnodes=2, node_rank=2, nproc_per_node=2, endpoint="h:1"), "--node-rank 2 is outside 0..1"),
    (dict(launcher="torchrun", nnodes=2, node_rank=-1, nproc_per_node=2, endpoint="h:1"), "outside 0..1"),
    (dict(launcher="torchrun", nnodes=2, nproc_per_node=2), "needs --rdzv-endpoint"),
    (dict(launcher="torchrun", nnodes=2, endpoint="h:1"), "need --nproc-per-node"),
    (dict(launcher="torchrun", nnodes=2, nproc_per_node=2, endpoint="h"), "HOST:PORT"),
    (dict(launcher="torchrun", nnodes=2, nproc_per_node=2, endpoint="h:65535"), "PORT in 1..65534"),
    (dict(launcher="torchrun", nnodes=0, nproc_per_node=2), "--nnodes must be >= 1"),
])
def test_options_that_cannot_work_are_refused(options, message):
    with pytest.raises(NodesRefused, match=message):
        resolve_nodes(environ={}, **options)


def test_tp_must_divide_the_ranks():
    check_tp(Nodes(2, 0, 4, "h:1"), 8)
    with pytest.raises(NodesRefused, match="8 ranks cannot be split into groups of tp 16"):
        check_tp(Nodes(2, 0, 4, "h:1"), 16)


def test_the_cpu_model_refuses_a_group_on_two_hosts_by_host_name():
    """Host names decide, not LOCAL_WORLD_SIZE: two nodes of one host share its memory; a group that
    spans two hosts is refused naming the group and where its ranks sit."""
    from musebench.harness.case import RunOptions
    from musebench.harness.driver import group_transports
    from musebench.harness.launch import Spec, check_hosts
    from musebench.cases.tail_inputs import TailCase

    options = RunOptions(backend="cpu", launcher="torchrun")
    assert [t.name for t in group_transports(options, 2, ["a", "a", "b", "b"], local_world=2)] == ["shm", "shm"]
    assert [t.name for t in group_transports(options, 4, ["a"] * 4, local_world=2)] == ["shm"]
    with pytest.raises(ValueError, match=r"every rank on one host.*group 0 \(ranks 0-3\) spans 2 hosts \(a: ranks "
                                         r"0-1; b: ranks 2-3\)"):
        group_transports(options, 4, ["a", "a", "b", "b"] * 2, local_world=2)
    nodes = Nodes(2, 0, 2, "a:1")
    check_hosts([Spec((TailCase(mode="ep", tp=2, tokens=1),), options)], nodes, ["a", "b"])
    with pytest.raises(NodesRefused, match="the job spans 2 hosts"):
        check_hosts([Spec((TailCase(mode="ep", tp=4, tokens=1),), options)], nodes, ["a", "b"])


def test_a_rank_waiting_in_a_group_names_its_peer_by_job_rank():
    from musebench.harness.progress import RankProgress

    record = RankProgress(rank=4, phase="gather", error="rank 0: timed out waiting for rank 1", group_base=4)
    assert record.waiting_for() == {5}


def test_a_store_call_that_does_not_answer_raises_within_the_bound():
    """The launchers' store client waits for an answer without end where node 0 hangs: every call
    is bounded; once one ran out the store is stuck and every later call raises at once."""
    import threading
    import time

    from musebench.harness.nodes import BoundedStore

    release = threading.Event()

    class Store:
        def get(self, key):
            return key.encode()

        def add(self, key, amount):
            raise RuntimeError("refused")

        def check(self, keys):
            release.wait(30)
            return True

    store = BoundedStore(Store(), 0.3)
    assert store.get("job") == b"job"
    with pytest.raises(RuntimeError, match="refused"):
        store.add("n", 1)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer to check within 0.3s"):
        store.check(["job"])
    assert time.monotonic() - started < 2
    with pytest.raises(TimeoutError):
        store.get("job")
    release.set()


def test_node_0_refuses_a_taken_store_port():
    """PORT+1 held by another process: node 0 exits 2 naming it (it raised a bare DistNetworkError)."""
    import socket

    from musebench.harness.nodes import NodeLink

    port = free_port_pair()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        with pytest.raises(NodesRefused, match=rf"cannot host the launchers' store at 127.0.0.1:{port + 1}.*"
                                               "pick another --rdzv-endpoint port"):
            NodeLink(Nodes(2, 0, 2, f"127.0.0.1:{port}"), "job", startup_s=5)


def test_a_node_refuses_a_store_of_another_launch_and_a_taken_node_rank(monkeypatch):
    """Node 1 never joins the store of a launch of another layout or job (it would watch, and fail,
    another job's nodes), and a second launcher given --node-rank 1 is refused."""
    from musebench.harness.nodes import NodeLink

    monkeypatch.delenv("MUSEBENCH_JOB_ID", raising=False)
    port = free_port_pair()
    endpoint = f"127.0.0.1:{port}"
    node0 = NodeLink(Nodes(2, 0, 2, endpoint), "job-a", startup_s=5)
    with pytest.raises(NodesRefused, match=r"serves another launch \(nnodes=2 nproc-per-node=2 .*this node's: "
                                           r"nnodes=2 nproc-per-node=4"):
        NodeLink(Nodes(2, 1, 4, endpoint), "job-b", startup_s=5)
    monkeypatch.setenv("MUSEBENCH_JOB_ID", "job-b")
    with pytest.raises(NodesRefused, match="serves job job-a, this node's is job-b"):
        NodeLink(Nodes(2, 1, 2, endpoint), "job-b", startup_s=5)
    monkeypatch.setenv("MUSEBENCH_JOB_ID", "job-a")
    node1 = NodeLink(Nodes(2, 1, 2, endpoint), "job-a", startup_s=5)
    assert node1.job == "job-a"
    with pytest.raises(NodesRefused, match="node 1 has joined .* already: two launchers were given --node-rank 1"):
        NodeLink(Nodes(2, 1, 2, endpoint), "job-a", startup_s=5)
    del node0, node1


def test_a_refusal_on_one_node_is_every_nodes():
    """The nodes judge their groups' transports with their own GPUs and environment: where one
    refuses, every node refuses alike (exit 2), naming the refusing node, before any launch."""
    import threading

    from musebench.harness.launch import agree_on_hosts
    from musebench.harness.nodes import NodeLink

    endpoint = f"127.0.0.1:{free_port_pair()}"
    links = [NodeLink(Nodes(2, 0, 2, endpoint), "job", startup_s=5)]
    links.append(NodeLink(Nodes(2, 1, 2, endpoint), "job", startup_s=5))
    outcomes: dict[int, BaseException | None] = {}

    def check(node):
        def judge(hosts):
            assert len(hosts) == 2
            if node == 1:
                raise NodesRefused("transport multicast: no multicast here")
        return judge

    def run(node):
        try:
            agree_on_hosts(links[node], check(node))
            outcomes[node] = None
        except BaseException as error:
            outcomes[node] = error

    threads = [threading.Thread(target=run, args=(node,)) for node in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(isinstance(outcomes[node], NodesRefused) for node in (0, 1)), outcomes
    assert str(outcomes[0]) == str(outcomes[1])
    assert str(outcomes[0]).startswith("node 1 (host ") and "no multicast here" in str(outcomes[0])


def test_an_nnodes_that_disagrees_with_slurm_is_refused_where_slurm_gives_the_node_rank():
    """Under an allocation of 8 nodes, `--nnodes 2` took node ranks 0..7 from SLURM_NODEID (nodes
    2..7 refused one by one, or a job of 2 on 8 launchers); now refused, unless --node-rank is given."""
    environ = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "8", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gb[003-010]",
               "SLURM_GPUS_ON_NODE": "4"}
    with pytest.raises(NodesRefused, match="--nnodes 2 disagrees with SLURM_NNODES=8"):
        resolve_nodes(launcher="torchrun", nnodes=2, environ=environ)
    assert resolve_nodes(launcher="torchrun", nnodes=2, node_rank=1, environ=environ) == Nodes(2, 1, 4, "gb003:29500")
    assert resolve_nodes(launcher="torchrun", nnodes=8, environ=environ) == Nodes(8, 1, 4, "gb003:29500")
