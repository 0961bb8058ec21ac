"""Node 0's hub, the level above its coordinator in a run of several nodes: the other nodes
join it, arrive at each run-wide barrier once all their ranks have, pass their ranks'
metrics on, say when one failed, and finish with their results; it heartbeats to them and
tells them to stop."""
import time

from . import control
from .coordinator import same
from .failures import WorkerFailed
from .protocol import TO_HUB, printable


class Hub:
    """Node 0's end of the node links: a TCP Listener at ``endpoint`` under the nodes'
    ``secret``. A node silent for ``node_timeout`` seconds, or not there ``join_timeout``
    seconds after the hub started, fails the run."""

    BEAT_S = 1.0

    def __init__(self, nnodes, endpoint, secret, log, node_timeout, join_timeout,
                 progress_timeout):
        self.listener = control.Listener(nnodes, endpoint, secret=secret, log=log,
                                         kinds=TO_HUB, hello="JOIN", fresh_key=True)
        self.nnodes = nnodes
        self.node_timeout, self.join_timeout = node_timeout, join_timeout
        self.progress_timeout = progress_timeout
        self.t0 = time.monotonic()
        self.joined, self.arrived, self.finished = {}, {}, {}
        self.node_beat, self.node_since, self.beat_sent = {}, None, 0.0

    @property
    def address(self):
        """HOST:PORT, as the nodes are told it."""
        return self.listener.address.removeprefix("tcp://")

    @property
    def sockets(self):
        return self.listener.sockets

    def attach(self, coordinator):
        self.coordinator = coordinator

    def handle(self, ready):
        if self.listener.monitor in ready:
            self.listener.police()
        if self.listener.socket in ready:
            while (msg := self.listener.receive(0)) is not None:
                self._from_node(*msg)

    def may_run(self):
        if len(self.joined) < self.nnodes - 1:
            return False
        self.listener.broadcast("START")
        return True

    def arrive(self, arrival):
        self._arrive(0, arrival)

    def report(self, rank, data):
        self.coordinator.metric(rank, data)

    def done(self):
        return len(self.finished) == self.nnodes - 1

    def finish(self, mine):
        return mine + [r for k in range(1, self.nnodes) for r in self.finished[k]]

    def stop(self, error):
        """Every other node stops too, told why."""
        text = (str(error).split("\n")[0] if isinstance(error, WorkerFailed)
                else f"node 0 {_reason(error)}")
        self.listener.broadcast("STOP", {"reason": text})

    def close(self):
        self.listener.close()

    def _from_node(self, k, kind, data, blobs):
        self.node_beat[k] = time.monotonic()
        if k == 0:
            return  # node 0 is this launcher: nothing of its own comes over the socket
        if kind == "JOIN":
            n = self.coordinator.n
            if data["nlocal"] != n:
                raise WorkerFailed(None, f"node {k} ({printable(data['host'], 100)}) "
                                   f"runs {data['nlocal']} workers and node 0 runs {n}: "
                                   "every node must run as many", node=k)
            self.joined[k] = data
            self.coordinator.maybe_run()
        elif kind == "ARRIVE":
            self._arrive(k, data)
        elif kind == "REPORT":
            self.coordinator.metric(data["rank"], data["data"])
        elif kind == "FAIL":
            raise WorkerFailed(data["rank"], printable(data["reason"], 2000),
                               printable(data["details"]), node=k)
        elif kind == "FINISH":
            self.finished[k] = data["results"]

    def _arrive(self, k, arrival):
        if self.node_since is None:
            self.node_since = time.monotonic()
        self.arrived[k] = arrival
        if len(self.arrived) < self.nnodes:
            return
        first = self.arrived[0]
        seqs = {q: a["seq"] for q, a in self.arrived.items()}
        if len(set(seqs.values())) != 1:
            raise WorkerFailed(None, "the nodes are out of step", "barrier numbers by node: " +
                               ", ".join(f"node {q}: {v}" for q, v in sorted(seqs.items())))
        gather = first["values"] is not None
        n = self.coordinator.n
        if not gather:
            for q in range(1, self.nnodes):
                same(q * n, first, self.arrived[q], 0, self.coordinator.node_of)
        values = [v for q in range(self.nnodes) for v in self.arrived[q]["values"]] \
            if gather else None
        self.arrived.clear()
        self.node_since = None
        release = dict(first, values=values)
        self.listener.broadcast("RELEASE", {"seq": release["seq"], "shared": release["shared"],
                                            "values": values})
        self.coordinator.release(release)

    def beat(self, now):
        if now - self.beat_sent >= self.BEAT_S:
            self.listener.broadcast("HEARTBEAT")
            self.beat_sent = now

    def lost(self, now, silent):
        """A node silent for ``silent`` seconds, in words, or None."""
        for k in self.joined:
            if k not in self.finished and now - self.node_beat[k] > silent:
                return (f"node {k} ({printable(self.joined[k]['host'], 100)}) "
                        f"stopped answering: its launcher is gone")
        return None

    def check(self, now):
        missing = [k for k in range(1, self.nnodes) if k not in self.joined]
        if missing and now - self.t0 > self.join_timeout:
            raise WorkerFailed(None, f"node(s) {missing} did not join within "
                               f"{self.join_timeout:.0f} s at {self.address} (started? "
                               "the same secret? a firewall?)", node=missing[0])
        lost = self.lost(now, self.node_timeout)
        if lost is not None:
            raise WorkerFailed(None, lost)
        if self.node_since is not None and now - self.node_since > self.progress_timeout:
            absent = min(k for k in range(self.nnodes) if k not in self.arrived)
            raise WorkerFailed(None, f"node {absent} reached no barrier in "
                               f"{self.progress_timeout:.0f} s while node(s) "
                               f"{sorted(self.arrived)} waited at one", node=absent)


def _reason(error):
    """Why a launcher stops, in words, for what is not a WorkerFailed."""
    if isinstance(error, KeyboardInterrupt):
        return "was interrupted (Ctrl-C or SIGTERM)"
    return f"stopped: {type(error).__name__}: {error}"
