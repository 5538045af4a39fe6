"""Several nodes of one process launch: where the ranks sit, and how the nodes' launchers watch each other.

The same command runs on every node, as with torchrun: `--launcher torchrun --nnodes N
--node-rank R --nproc-per-node P --rdzv-endpoint HOST:PORT` (`resolve_nodes`; under SLURM,
SLURM_NNODES, SLURM_NODEID and the first host of SLURM_JOB_NODELIST where not given). Each
node's launcher (`harness.launch`) starts torchrun with the static rendezvous: node R's ranks are
R*P .. R*P + P - 1, node 0's torchrun hosts the rendezvous store at HOST:PORT, and the job's
WORLD_SIZE is N*P. It watches its own ranks through their progress records (`harness.progress`).

How a node learns that another died (`NodeLink`). The launchers share a TCPStore of their own,
hosted by node 0's launcher at HOST:PORT+1 (the launcher outlives its torchrun and its ranks, so
the store does too). Every poll (0.1 s) each launcher writes one key: a beat counter, its status
(running | done | failed), its host name and its ranks' latest progress records; and reads every
other node's key. So
- every node's watch sees every rank of the job: a rank that hangs on node 1 is named alike by
  every node's launcher;
- a node whose key stops changing for NODE_SILENCE_S (its launcher killed, the node down or cut
  off) is dead: "node 1 (host b, ranks 2-3) went silent: no heartbeat from its launcher for 5.0s";
- a store that stops answering, or takes longer than NODE_SILENCE_S to answer (its timeout once
  connected), means node 0 (which hosts it) is gone;
- a node that fails publishes why (its watch's blame, a rank's exit, a signal) under a sequence
  number the store hands out; every node ends with the earliest failure, so all name the same one.
A rank whose collective fails because a peer went away exits with COLLECTIVE_FAILED_EXIT: its
launcher takes that for a consequence and waits (at most NODE_SILENCE_S + 1 s) for the cause
elsewhere before naming its own ranks. The node's other ranks that torchrun then stopped (SIGTERM,
listed as failures in its report) are bystanders and change nothing: a node killed while its
peers' ranks are in a collective with it is named, not the peer's rank that lost it first.

The bound: a node's death ends every other node within NODE_SILENCE_S + the poll + the kill of
its torchrun session (at most 10 s of SIGTERM, then SIGKILL, waits), whatever `--timeout` says.
A launcher killed with SIGKILL takes its torchrun with it (PR_SET_PDEATHSIG, set on torchrun by
the launcher), and each rank goes with its torchrun (the same, set by the worker).

Joining, a launcher checks that the store is this launch's (node 0 wrote the same layout, and the
same MUSEBENCH_JOB_ID where one is set) and claims its node rank: a store of another job on the
port, two launchers given one --node-rank, or a node 0 that cannot listen on PORT+1 exit 2 (the
others then end when node 0 does not answer, or a node does not join, within the startup bound).

Before launching, the launchers exchange their host names through the store (`exchange_hosts`),
then each node's verdict on its groups' transports (`exchange`): a group of ranks that sits on
several hosts and that its transport cannot serve (the CPU model's shared memory is one host's),
as any node judges it, is refused on every node alike, exit 2, before any torchrun starts.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import socket
import time
from collections.abc import Mapping

SLURM_PORT = 29500  # torchrun's default master port: the rendezvous port under SLURM when none is given
HEARTBEAT_S = 0.1  # a launcher writes its key every poll
NODE_SILENCE_S = 5.0  # a node whose key has not changed for this long is dead
CONNECT_S = 2.0  # one attempt to reach the launchers' store
COLLECTIVE_FAILED_EXIT = 3  # a rank whose collective failed (a peer went away): a consequence, not the cause


class NodesRefused(ValueError):
    """Node options that cannot work (exit 2 before anything launches)."""


class LinkLost(RuntimeError):
    """The launchers' store stopped answering: node 0 is gone."""


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Where a process launch's ranks sit: `nnodes` nodes of `nproc_per_node` ranks each, this
    launcher being node `node_rank`; the rendezvous at `endpoint` (HOST:PORT; None on one node)."""

    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    endpoint: str | None = None

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node)

    @property
    def ranks(self) -> range:
        """This node's ranks of the job."""
        return self.ranks_of(self.node_rank)

    @property
    def host(self) -> str:
        return (self.endpoint or "127.0.0.1:0").rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int((self.endpoint or "127.0.0.1:0").rsplit(":", 1)[1])

    def torchrun_arguments(self) -> list[str]:
        """torchrun's options for this node (the static rendezvous; `--standalone` on one node)."""
        if self.nnodes == 1 and self.endpoint is None:
            return ["--standalone", f"--nproc-per-node={self.nproc_per_node}"]
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", f"--nproc-per-node={self.nproc_per_node}",
                "--rdzv-backend=static", f"--rdzv-endpoint={self.endpoint}"]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `gb[003-010,012],login1` -> `gb003`."""
    first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if first is None or not first.group(1):
        raise NodesRefused(f"SLURM_JOB_NODELIST {nodelist!r} names no host")
    prefix, ranges = first.group(1), first.group(3)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def resolve_nodes(*, launcher: str, nnodes: int | None = None, node_rank: int | None = None,
                  nproc_per_node: int | None = None, endpoint: str | None = None,
                  environ: Mapping[str, str] | None = None) -> Nodes | None:
    """The launch's nodes from the options, the SLURM environment filling what is not given
    (SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST's first host, port SLURM_PORT; the GPUs of the
    node, SLURM_GPUS_ON_NODE, for --nproc-per-node), or None: no node option and no SLURM job of
    several nodes, today's one-node launch (`--tp` processes). NodesRefused for options that
    cannot work: node options without the torchrun launcher, a node rank outside 0..N-1, several
    nodes without a rendezvous endpoint or without --nproc-per-node, a malformed endpoint, an
    --nnodes that disagrees with SLURM_NNODES where the node rank would come from SLURM_NODEID."""
    environ = os.environ if environ is None else environ
    given = {name: value for name, value in (("--nnodes", nnodes), ("--node-rank", node_rank),
                                             ("--nproc-per-node", nproc_per_node), ("--rdzv-endpoint", endpoint))
             if value is not None}
    if launcher != "torchrun":
        if given:
            raise NodesRefused(f"{', '.join(given)} need --launcher torchrun (virtual ranks are threads of one "
                               "process on one node)")
        return None
    slurm = "SLURM_JOB_ID" in environ and "SLURM_NNODES" in environ
    if slurm and nnodes is None:
        nnodes = int(environ["SLURM_NNODES"])
    if not given and (nnodes or 1) == 1:
        return None
    nnodes = 1 if nnodes is None else nnodes
    if nnodes < 1:
        raise NodesRefused(f"--nnodes must be >= 1, got {nnodes}")
    if node_rank is None and slurm and "SLURM_NODEID" in environ and nnodes != int(environ["SLURM_NNODES"]):
        raise NodesRefused(f"--nnodes {nnodes} disagrees with SLURM_NNODES={environ['SLURM_NNODES']}: this node's "
                           "rank would be SLURM_NODEID of the allocation's nodes; give --node-rank too, or leave "
                           "--nnodes to SLURM")
    if node_rank is None:
        node_rank = int(environ["SLURM_NODEID"]) if slurm and "SLURM_NODEID" in environ else 0
    if not 0 <= node_rank < nnodes:
        raise NodesRefused(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    if nproc_per_node is None and slurm and environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        nproc_per_node = int(environ["SLURM_GPUS_ON_NODE"])
    if nproc_per_node is None:
        raise NodesRefused("--nnodes, --node-rank and --rdzv-endpoint need --nproc-per-node (ranks per node)")
    if nproc_per_node < 1:
        raise NodesRefused(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if endpoint is None and slurm and nnodes > 1:
        endpoint = f"{first_slurm_host(environ.get('SLURM_JOB_NODELIST', ''))}:{SLURM_PORT}"
    if endpoint is None and nnodes > 1:
        raise NodesRefused(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's host, the same on every node)")
    if endpoint is not None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65534:
            raise NodesRefused(f"--rdzv-endpoint must be HOST:PORT with PORT in 1..65534 (PORT+1 is the launchers' "
                               f"store), got {endpoint!r}")
    return Nodes(nnodes=nnodes, node_rank=node_rank, nproc_per_node=nproc_per_node, endpoint=endpoint)


def check_tp(nodes: Nodes, tp: int) -> None:
    """NodesRefused unless the job's WORLD_SIZE is a multiple of `tp` (its groups of tp ranks)."""
    if nodes.world % tp:
        raise NodesRefused(f"--nnodes {nodes.nnodes} x --nproc-per-node {nodes.nproc_per_node} = {nodes.world} ranks "
                           f"cannot be split into groups of tp {tp}")


def describe(nodes: Nodes, node: int, host: str | None = None) -> str:
    """`node 1 (host b, ranks 2-3)`."""
    ranks = nodes.ranks_of(node)
    where = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
    return f"node {node} ({f'host {host}, ' if host else ''}{where})"


class NodeLink:
    """This launcher's link to the others (see the module docstring): node 0 hosts the store at
    the rendezvous host's PORT+1, the others connect within `startup_s`."""

    def __init__(self, nodes: Nodes, job: str, startup_s: float) -> None:
        import torch.distributed as dist

        self.nodes, self.host = nodes, socket.gethostname()
        self.beats = 0
        self.heard: dict[int, tuple[str, float]] = {}  # node -> (its last key, when it last changed, here)
        self.hosts: dict[int, str] = {}
        self.started = time.monotonic()
        port = nodes.port + 1
        timeout = datetime.timedelta(seconds=max(startup_s, 30.0))
        if nodes.node_rank == 0:
            try:
                self.store = dist.TCPStore(nodes.host if nodes.host not in ("localhost",) else "127.0.0.1", port,
                                           is_master=True, wait_for_workers=False, timeout=timeout)
            except RuntimeError as error:  # DistNetworkError: the port is taken, or the host is not this one
                line = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise NodesRefused(f"node 0 cannot host the launchers' store at {nodes.host}:{port} (the rendezvous "
                                   f"port + 1: {line}); pick another --rdzv-endpoint port, the same on every node"
                                   ) from None
            self.store.set("layout", self._layout())
            self.store.set("job", job)
        else:
            deadline = time.monotonic() + startup_s
            while not _answers(nodes.host, port):
                if time.monotonic() > deadline:
                    raise LinkLost(f"{describe(nodes, 0)}: its launcher's store at {nodes.host}:{port} did not answer "
                                   f"within {startup_s:.0f}s")
                time.sleep(0.2)
            self.store = dist.TCPStore(nodes.host, port, is_master=False, timeout=timeout)
        # no question to the store waits longer than a node may be silent: a node 0 that hangs or
        # is cut off keeps its connections open, and the store's client would wait for its answer
        # without end, holding this launcher's watch (over its own ranks too)
        self.store = BoundedStore(self.store, NODE_SILENCE_S)
        if nodes.node_rank != 0:
            self._join(port)
        self.job = self.store.get("job").decode()  # node 0's: every node names the job's files alike
        self.beat({})

    def _layout(self) -> str:
        return f"nnodes={self.nodes.nnodes} nproc-per-node={self.nodes.nproc_per_node} rdzv={self.nodes.endpoint}"

    def _join(self, port: int) -> None:
        """NodesRefused unless the store is this launch's (node 0 wrote the same layout, and the job
        id where MUSEBENCH_JOB_ID names one) and this node rank is not taken by another launcher:
        a store of another job on the port, or two launchers given one --node-rank, never run."""
        where = f"the launchers' store at {self.nodes.host}:{port}"
        try:
            deadline = time.monotonic() + NODE_SILENCE_S  # node 0 writes the layout, then the job, once listening
            while not self.store.check(["job"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            layout = self.store.get("layout").decode() if self.store.check(["layout"]) else "no musebench layout"
            if layout != self._layout():
                raise NodesRefused(f"{where} serves another launch ({layout}; this node's: {self._layout()}): run "
                                   "the same command on every node, or pick another --rdzv-endpoint port")
            job, mine = self.store.get("job").decode(), os.environ.get("MUSEBENCH_JOB_ID")
            if mine and job != mine:
                raise NodesRefused(f"{where} serves job {job}, this node's is {mine} (MUSEBENCH_JOB_ID): another "
                                   "job holds the port")
            claims = self.store.add(f"claim/{self.nodes.node_rank}", 1)
        except NodesRefused:
            raise
        except Exception as error:
            raise self._lost(error) from None
        if claims != 1:
            raise NodesRefused(f"node {self.nodes.node_rank} has joined {where} already: two launchers were given "
                               f"--node-rank {self.nodes.node_rank}")

    def _key(self, node: int) -> str:
        return f"node/{node}"

    def beat(self, records: Mapping, status: str = "running", reason: str | None = None) -> None:
        """Write this node's key: a new beat, its status and its ranks' records (`progress.records_to_json`)."""
        from musebench.harness.progress import records_to_json

        self.beats += 1
        value = json.dumps({"beat": self.beats, "status": status, "reason": reason, "host": self.host,
                            "records": records_to_json(records)})
        try:
            self.store.set(self._key(self.nodes.node_rank), value)
        except Exception as error:
            raise self._lost(error) from None

    def _lost(self, error: BaseException) -> LinkLost:
        line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return LinkLost(f"{describe(self.nodes, 0, self.hosts.get(0))} is gone: the launchers' store at "
                        f"{self.nodes.host}:{self.nodes.port + 1} stopped answering ({line})")

    def poll(self, now: float | None = None) -> dict:
        """Every other node's latest state ({node: {"status", "reason", "host", "records"}}), noting
        when each last changed."""
        now = time.monotonic() if now is None else now
        others = [node for node in range(self.nodes.nnodes) if node != self.nodes.node_rank]
        states = {}
        try:
            for node in others:
                if not self.store.check([self._key(node)]):
                    continue
                raw = self.store.get(self._key(node)).decode()
                if self.heard.get(node, ("", 0.0))[0] != raw:
                    self.heard[node] = (raw, now)
                states[node] = json.loads(raw)
                self.hosts[node] = states[node]["host"]
        except Exception as error:
            raise self._lost(error) from None
        return states

    def silent(self, states: Mapping[int, dict], now: float | None = None) -> str | None:
        """The first running node whose key has not changed for NODE_SILENCE_S (never heard: since
        this link started, bounded by the startup), as one line; None while every node beats."""
        now = time.monotonic() if now is None else now
        for node in range(self.nodes.nnodes):
            if node == self.nodes.node_rank or states.get(node, {}).get("status", "running") != "running":
                continue
            since = self.heard.get(node, ("", self.started))[1]
            if now - since > NODE_SILENCE_S:
                return (f"{describe(self.nodes, node, self.hosts.get(node))} went silent: no heartbeat from its "
                        f"launcher for {now - since:.1f}s (killed, or the node is down)")
        return None

    def fail(self, reason: str) -> None:
        """Publish this node's failure (first come, first named); never raises."""
        try:
            seq = self.store.add("failures", 1)
            self.store.set(f"failure/{seq}", reason)
            self.beat({}, status="failed", reason=reason)
        except Exception:
            pass

    def first_failure(self) -> str | None:
        """The earliest failure any node published, or None (a failure numbered but not yet
        written, its node killed between the two, is passed over: never waited for)."""
        try:
            for seq in range(1, self.store.add("failures", 0) + 1):
                if self.store.check([f"failure/{seq}"]):
                    return self.store.get(f"failure/{seq}").decode()
            return None
        except Exception as error:
            raise self._lost(error) from None

    def exchange_hosts(self, deadline_s: float) -> list[str]:
        """Every node's host name, by node (each node waits for all, at most `deadline_s`)."""
        hosts = self.exchange("host", self.host, deadline_s)
        self.hosts.update(enumerate(hosts))
        return hosts

    def exchange(self, name: str, value: str, deadline_s: float) -> list[str]:
        """Every node's `value` of `name`, by node (each node waits for all, at most `deadline_s`;
        LinkLost naming the nodes that never gave theirs)."""
        self.store.set(f"{name}/{self.nodes.node_rank}", value)
        keys = [f"{name}/{node}" for node in range(self.nodes.nnodes)]
        deadline = time.monotonic() + deadline_s
        try:
            while not self.store.check(keys):
                if time.monotonic() > deadline:
                    missing = [node for node, key in enumerate(keys) if not self.store.check([key])]
                    raise LinkLost(f"{', '.join(describe(self.nodes, node) for node in missing)} did not join within "
                                   f"{deadline_s:.0f}s (is the same command running on every node?)")
                time.sleep(0.1)
            return [self.store.get(key).decode() for key in keys]
        except LinkLost:
            raise
        except Exception as error:
            raise self._lost(error) from None

    def finish(self, status: str, reason: str | None = None) -> None:
        """This node is over: publish it; node 0 keeps the store up until every other node is over
        too (at most NODE_SILENCE_S + 1 s), so none mistakes its end for its death. Never raises."""
        try:
            self.beat({}, status=status, reason=reason)
        except LinkLost:
            return
        if self.nodes.node_rank != 0:
            return
        deadline = time.monotonic() + NODE_SILENCE_S + 1.0
        while time.monotonic() < deadline:
            try:
                states = self.poll()
            except LinkLost:
                return
            if all(states.get(node, {}).get("status", "running") != "running"
                   for node in range(1, self.nodes.nnodes)):
                return
            time.sleep(0.1)


class BoundedStore:
    """A store whose every call answers within `bound_s` or raises TimeoutError: the calls run, one
    at a time, on a daemon thread of their own, and the caller waits at most `bound_s` for each.
    After a call that did not answer in time the store is stuck (its thread may never return) and
    every later call raises at once."""

    def __init__(self, store, bound_s: float) -> None:
        import queue
        import threading

        self._store, self._bound_s = store, bound_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck: str | None = None
        threading.Thread(target=self._serve, name="musebench-node-link", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, answer, done = self._calls.get()
            try:
                answer.append((True, call()))
            except BaseException as error:  # handed to the caller
                answer.append((False, error))
            done.set()

    def _call(self, name: str, *args):
        import threading

        if self._stuck is not None:
            raise TimeoutError(self._stuck)
        answer: list = []
        done = threading.Event()
        self._calls.put((lambda: getattr(self._store, name)(*args), answer, done))
        if not done.wait(self._bound_s):
            self._stuck = f"no answer to {name} within {self._bound_s:.1f}s"
            raise TimeoutError(self._stuck)
        ok, value = answer[0]
        if not ok:
            raise value
        return value

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args: self._call(name, *args)


def _answers(host: str, port: int) -> bool:
    """Whether something listens at host:port (a plain connect: the store's own client logs every
    failed try)."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_S):
            return True
    except OSError:
        return False


def die_with_parent(sig: int | None = None) -> None:
    """Ask Linux to send `sig` (SIGKILL) to this process when its parent ends (PR_SET_PDEATHSIG):
    a rank whose torchrun was killed does not outlive it. Elsewhere, or without libc, nothing."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(sig if sig is not None else signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the request: end now
        os.kill(os.getpid(), int(sig if sig is not None else signal.SIGKILL))
