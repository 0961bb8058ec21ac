"""What a worker knows of its run, and how it meets its peers: through the launcher, or in
the node's shared memory."""
import time

# A rank waiting in shared memory looks for the launcher's STOP this often, and tells the
# launcher it waits (for the hang check) once it has waited this long (docs/DECISIONS.md,
# "CPU workers meet in shared memory").
MEET_SLICE_S, MEET_REPORT_S = 0.02, 0.5
MEET_SPINS = 20000  # polls before the first sleep: about 20 us


class WorkerContext:
    """What a worker knows of the run: its rank among all (``rank`` of ``nranks``) and on
    its node (``local_rank`` of ``local_nranks``), its node (``node`` of ``nnodes``), its
    device, the run's public id (which names its shared memory) and the way to the
    coordinator."""

    def __init__(self, place, device, run_id, link, data_address=None, joining=False,
                 progress_timeout=600.0, carry=None):
        (self.rank, self.nranks, self.local_rank, self.local_nranks, self.node,
         self.nnodes) = place
        self.device, self.run_id, self.link = device, run_id, link
        self.data_address = data_address  # node 0's host (runtime.datalinks)
        # The launcher's hang check: a wait for a peer of another node ends after it too.
        self.progress_timeout = progress_timeout
        # A restarted worker, to join the run at its next epoch (pympgu.training.recovery).
        self.joining = joining
        # Where this worker keeps its state for the one that may take its place (None:
        # survivors hand it over instead): pympgu.training.carried.
        self.carry = carry
        self.source = self.keeper = None  # (recover)
        # Barriers counted apart: the run's, whose numbers every node compares, and this
        # node's alone (a node's own business, such as taking in a replacement worker).
        self._seq = {False: 0, True: 0}
        self._next_check = 0.0  # when check() next reads the launcher's socket

    @property
    def is_cpu(self) -> bool:
        return self.device is None

    def barrier(self, what=None, value=None, shared=None, local=False) -> object:
        """A host barrier of every rank (of this node's alone with ``local``), through the
        coordinator. With ``what``, every rank must also hold the same ``value`` (a JSON
        value): otherwise the run fails, naming the first rank whose ``what`` differs from
        rank 0's. Returns rank 0's ``shared`` (any JSON value; the other ranks' are
        ignored): what rank 0 alone decided, such as whether to stop."""
        return self._meet(what, value, shared, local, False)["shared"]

    def gather(self, value, local=False) -> list:
        """Every rank's ``value`` (a JSON value), in rank order: a barrier that hands out
        what each rank brought (only this node's ranks' with ``local``)."""
        return self._meet(None, value, None, local, True)["values"]

    def _meet(self, what, value, shared, local, gather):
        local = bool(local)
        self._seq[local] += 1
        self.link.send("BARRIER", {"seq": self._seq[local], "what": what, "value": value,
                                   "shared": shared, "local": bool(local), "gather": gather})
        data, _ = self.link.receive("RELEASE")
        return data

    def check(self) -> None:
        """Raise control.Stopped if the launcher has said STOP (control.Shrunk for a lost
        peer), reading its socket at most once every MEET_SLICE_S: cheap enough for every
        step of a loop that never waits for the launcher otherwise."""
        if (now := time.monotonic()) >= self._next_check:
            self._next_check = now + MEET_SLICE_S
            self.link.check()

    def meet(self, barrier) -> None:
        """Pass ``barrier`` (pympgu._host.Barrier of this node's ranks, in shared memory)
        with every rank of the node: no message unless the wait lasts. A STOP from the
        launcher (a peer died, the run is stopped) raises control.Stopped within
        MEET_SLICE_S of the next meeting, waiting or not; a wait past MEET_REPORT_S is told
        to the launcher, whose hang check then names the rank that does not arrive."""
        if barrier.arrive() or barrier.wait(0.0, MEET_SPINS):
            # Peers that never wait long would never read the socket: a STOP while every
            # rank keeps pace (Ctrl-C) is looked for here too.
            self.check()
            return
        start, told = time.monotonic(), False
        try:
            while not barrier.wait(MEET_SLICE_S):
                self.link.check()
                if not told and time.monotonic() - start > MEET_REPORT_S:
                    self.link.send("WAITING", {"waiting": True})
                    told = True
        finally:
            if told:
                self.link.send("WAITING", {"waiting": False})

    def recover(self, kept, at) -> tuple:
        """After control.Shrunk (or, joining, at once): tell the launcher the positions whose
        state this rank holds (``kept``, lists whose first two entries order them) and where
        it was (``at``), and wait for REFORM: this rank is renumbered among the workers from
        now on. Returns the position all of them go back to, and the rank whose state every
        one takes (None: no worker joins, the replicas are alike). Another loss meanwhile
        raises Shrunk again."""
        self.link.send("RECOVER", {"kept": kept, "at": at})
        data, _ = self.link.receive("REFORM")
        members = data["members"]
        self.local_rank = members.index(self.link.rank)
        self.local_nranks = len(members)
        # Across nodes a node is lost whole: every node has as many workers, numbered
        # node after node among the nodes that remain.
        self.node, self.nnodes = data["node"], data["nnodes"]
        self.source = data["source"]  # the node whose state a node that joins takes
        # The node from which a replaced worker takes what every node keeps alike.
        self.keeper = data["keeper"]
        self.rank = self.node * self.local_nranks + self.local_rank
        self.nranks = self.nnodes * self.local_nranks
        self._seq = {False: 0, True: 0}
        return data["back_to"], data["root"]

    def await_word(self, seconds) -> None:
        """Wait up to ``seconds`` for the launcher's word on a peer that vanished (a link to
        another node closed): STOP raises control.Stopped, SHRINK control.Shrunk; silence
        returns, and the caller raises what it saw."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.link.check()
            time.sleep(MEET_SLICE_S)

    def register(self, layout, facts, blob) -> tuple:
        """Announce this rank's buffer to its node's ranks; returns every local rank's
        (facts, blob) and max_blocks."""
        self.link.send("REGISTER", {"layout": layout, "facts": facts}, [blob])
        data, blobs = self.link.receive("PEERS")
        return data["facts"], blobs, data.get("max_blocks")

    def metric(self, **values) -> None:
        """Send metrics to the launcher (node 0's), which prints or records them."""
        self.link.send("METRIC", values)
