"""Another node's uplink, the level above its coordinator in a run of several nodes: it
joins node 0, waits for its START, passes this node's barriers and metrics up, and stops
when node 0 says so or falls silent."""
import os
import time

from . import control
from .failures import NodeStopped, WorkerFailed
from .hub import _reason
from .protocol import PROTOCOL_VERSION, TO_NODE, printable


class Uplink:
    """This node's link to node 0 at ``address`` (HOST:PORT) under the nodes' ``secret``."""

    def __init__(self, address, secret, node, nnodes, nlocal, node_timeout, join_timeout):
        self.link = control.Link(f"tcp://{address}", secret, node, nnodes, kinds=TO_NODE,
                                 watch_parent=False, fresh_key=True)
        self.address, self.node = address, node
        self.node_timeout, self.join_timeout = node_timeout, join_timeout
        self.t0 = self.heard = time.monotonic()
        self.started = False
        self.gen = 0  # the membership's generation (Hub): each DROP starts one
        self.joining = False  # this node joins a run under way, until its REGROUP
        self.link.send("JOIN", {"version": PROTOCOL_VERSION, "pid": os.getpid(),
                                "host": os.uname().nodename, "nlocal": nlocal})

    @property
    def sockets(self):
        return [self.link.socket]

    def attach(self, coordinator):
        self.coordinator = coordinator

    def handle(self, ready):
        if self.link.socket in ready:
            while (msg := self.link.read()) is not None:
                self._from_hub(*msg)

    def _from_hub(self, kind, data, blobs):
        self.heard = time.monotonic()
        if kind == "START":
            self.started = True
            self.gen, self.joining = data["gen"], data["joining"]
            self.coordinator.maybe_run()
        elif kind == "RELEASE":
            self.coordinator.release(data)
        elif kind == "DROP":
            self.gen = data["gen"]
            if data["node"] != self.node:  # (this node's own pause: its workers went back)
                self.coordinator.dropped(printable(data["reason"], 2000))
        elif kind == "REGROUP" and (data["gen"] == self.gen or self.joining):
            self.gen, self.joining = data["gen"], False
            self.coordinator.regroup(data)
        elif kind == "END":  # a loss came after the run's last barrier: finish
            self.coordinator.end()
        elif kind == "STOP":
            raise NodeStopped(None, f"node 0 stopped the run: "
                              f"{printable(data['reason'], 2000)}")

    def may_run(self):
        return self.started

    def arrive(self, arrival):
        self.link.send("ARRIVE", dict(arrival, gen=self.gen))

    def hold(self, data):
        self.link.send("HOLD", dict(data, gen=self.gen))

    def pause(self, rank, reason, joined):
        """A worker of this node (``rank``) lost, its replacement starting (new workers in
        the ranks ``joined``): every node goes back and waits for it."""
        self.link.send("PAUSE", {"gen": self.gen, "rank": rank, "joined": joined,
                                 "reason": reason})

    def report(self, rank, data):
        self.link.send("REPORT", {"rank": rank, "data": data})

    def done(self):
        return True

    def finish(self, mine):
        self.link.send("FINISH", {"results": mine})
        return mine

    def stop(self, error):
        """Node 0 hears why this node stops (and tells the rest); not when it said so."""
        if isinstance(error, NodeStopped):
            return
        if isinstance(error, WorkerFailed):
            rank, reason, details = error.rank, error.reason, error.details
        else:
            rank, reason, details = None, f"node {self.node} {_reason(error)}", ""
        try:
            self.link.send("FAIL", {"rank": rank, "reason": reason, "details": details[-20000:]})
        except Exception:
            pass  # node 0 may be gone already

    def close(self):
        self.link.close()

    def beat(self, now):
        pass

    def lost(self, now, silent):
        if self.started and now - self.heard > silent:
            return f"node 0 at {self.address} stopped answering: its launcher is gone"
        return None

    def check(self, now):
        if self.link.secret_mismatch:  # its JOIN is gone all the same: node 0 logs it
            raise WorkerFailed(None, f"node 0 at {self.address} answers under another "
                               "secret: give every node the same PYMPGU_SECRET (or "
                               "--secret-file)", node=0)
        if not self.started and now - self.t0 > self.join_timeout:
            raise WorkerFailed(None, f"node 0 did not answer at {self.address} within "
                               f"{self.join_timeout:.0f} s (started? the same secret? a "
                               "firewall?)", node=0)
        lost = self.lost(now, self.node_timeout)
        if lost is not None:
            raise WorkerFailed(None, lost, node=0)
