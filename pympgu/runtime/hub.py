"""Node 0's hub, the level above its coordinator in a run of several nodes: the other nodes
join it, arrive at each run-wide barrier once all their ranks have, pass their ranks'
metrics on, say when one failed, and finish with their results; it heartbeats to them and
tells them to stop. With ``min_workers`` below every worker, a node other than node 0 that
fails or falls silent is dropped while enough workers remain: every other node's workers go
back to the newest exchange all of them hold (DROP, HOLD, REGROUP) and go on without it.
With restarts, a node's lost worker is replaced instead: every node goes back the same way
and waits for the replacement (PAUSE), whose node says what it holds once it is ready. A
node that left (or never came) and is started again with the same command joins the same
way once its workers are ready, and takes node 0's state."""
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
                 progress_timeout, min_workers=None):
        self.listener = control.Listener(nnodes, endpoint, secret=secret, log=log,
                                         kinds=TO_HUB, hello="JOIN", fresh_key=True)
        self.nnodes = nnodes
        self.node_timeout, self.join_timeout = node_timeout, join_timeout
        self.progress_timeout = progress_timeout
        self.t0 = time.monotonic()
        self.joined, self.arrived, self.finished = {}, {}, {}
        self.node_beat, self.node_since, self.beat_sent = {}, None, 0.0
        self.log, self.min_workers = log, min_workers
        # The nodes in the run, and the membership's generation (each drop starts one;
        # what a node sent in an earlier one is dropped); while the others go back:
        # what each node holds (HOLD), and the drop's facts.
        self.alive, self.gen, self.holding, self.dropping = list(range(nnodes)), 0, None, None
        self.paused = set()  # nodes whose lost worker is replaced, until the next REGROUP
        # Nodes that join a run under way: "starting" (told START), then "ready" (their
        # workers compiled: HOLD), then taken in at the next REGROUP ("joining").
        self.started, self.coming = False, {}
        # Once a loss came after the run's last barrier: nothing is left to redo (_over).
        self.ended = False

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

    @property
    def others(self):
        """The other nodes still in the run."""
        return [k for k in self.alive if k != 0]

    def may_run(self):
        if len(self.joined) < self.nnodes - 1:
            return False
        self.listener.broadcast("START", {"gen": self.gen, "joining": False})
        self.started = True
        return True

    def arrive(self, arrival):
        self._arrive(0, dict(arrival, gen=self.gen))

    def report(self, rank, data):
        self.coordinator.metric(rank, data)

    def done(self):
        return all(k in self.finished for k in self.others)

    def _over(self, why):
        """A loss after some node finished: that node's workers passed the run's last
        barrier, so every rank of every node did, and the last checkpoint is written.
        Nothing is left to redo: the nodes not finished are told (END) and finish with the
        results their workers give (docs/DECISIONS.md, "A loss at the run's very end")."""
        if self.ended:
            return
        self.ended = True
        self.log(f"{why}: every rank had done the run's last epoch; the run ends")
        self.holding = self.dropping = None
        self.paused = set()
        self.listener.broadcast("END", {"reason": why},
                                ranks=[k for k in self.others if k not in self.finished])
        self.coordinator.end()

    def finish(self, mine):
        if self.coming:
            self.listener.broadcast("STOP", {"reason": "the run ended before this node "
                                             "joined"}, ranks=list(self.coming))
        return mine + [r for k in self.others for r in self.finished[k]]

    def stop(self, error):
        """Every other node stops too, told why."""
        text = (str(error).split("\n")[0] if isinstance(error, WorkerFailed)
                else f"node 0 {_reason(error)}")
        self.listener.broadcast("STOP", {"reason": text}, ranks=self.others)

    def close(self):
        self.listener.close()

    def _from_node(self, k, kind, data, blobs):
        self.node_beat[k] = time.monotonic()
        if k == 0:
            return  # node 0 is this launcher: nothing of its own comes over the socket
        if k in self.alive and kind == "PAUSE":  # whatever its generation: it must be heard
            self._pause(k, data["rank"], printable(data["reason"], 2000),
                        [r for r in data["joined"] if isinstance(r, int)])
            return
        if k not in self.alive and self.started:
            self._from_late_node(k, kind, data)
            return
        if k not in self.alive or data.get("gen", self.gen) != self.gen:
            return  # a dropped node's, or sent before the last drop
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
            error = WorkerFailed(data["rank"], printable(data["reason"], 2000),
                                 printable(data["details"]), node=k)
            self._drop(k, error)
        elif kind == "HOLD":
            self.holds(k, data)
        elif kind == "FINISH":
            self.finished[k] = data["results"]
            if self.holding is not None and k not in self.holding:
                # Ended while the others went back to hear what it holds: past the end.
                why = (self.dropping or {}).get("reason", "a node joined")
                self._over(f"{why}, and node {k} finished")

    def _from_late_node(self, k, kind, data):
        """A node that joins the run under way (started again, or late)."""
        if kind == "JOIN" and k not in self.coming:
            n = self.coordinator.n
            if data["nlocal"] != n:
                self.log(f"node {k} ({printable(data['host'], 100)}) runs {data['nlocal']} "
                         f"workers and node 0 runs {n}: it may not join")
                self.listener.send(k, "STOP", {"reason": f"every node must run {n} workers"})
                self.listener.forget(k)
                return
            self.joined[k] = data
            self.coming[k] = "starting"
            self.log(f"node {k} ({printable(data['host'], 100)}) joins the run; its workers "
                     "start")
            self.listener.send(k, "START", {"gen": self.gen, "joining": True})
        elif kind == "HOLD" and self.coming.get(k) == "starting":
            self.coming[k] = "ready"
            self._admit()
        elif kind == "FAIL" and k in self.coming:
            del self.coming[k]
            self.listener.forget(k)
            self.log(f"node {k} failed before it joined: {printable(data['reason'], 500)}")

    def _admit(self):
        """The ready late nodes join, where no other change is under way: every node goes
        back to an exchange all hold, and the new ones take node 0's state there."""
        ready = sorted(k for k, state in self.coming.items() if state == "ready")
        if not ready or self.holding is not None:
            return
        for k in ready:
            self.coming[k] = "joining"
        self.gen += 1
        self.arrived.clear()
        self.node_since = None
        why = f"node(s) {ready} join"
        self.dropping = {"lost": [], "joined": [], "reason": why}
        self.holding = {}
        self.listener.broadcast("DROP", {"gen": self.gen, "reason": why, "node": None},
                                ranks=self.others)
        self.coordinator.dropped(why)

    def _arrive(self, k, arrival):
        if self.node_since is None:
            self.node_since = time.monotonic()
        self.arrived[k] = arrival
        if len(self.arrived) < len(self.alive):
            return
        first = self.arrived[0]
        seqs = {q: a["seq"] for q, a in self.arrived.items()}
        if len(set(seqs.values())) != 1:
            raise WorkerFailed(None, "the nodes are out of step", "barrier numbers by node: " +
                               ", ".join(f"node {q}: {v}" for q, v in sorted(seqs.items())))
        gather = first["values"] is not None
        n = self.coordinator.n
        if not gather:
            for place, q in enumerate(self.others, 1):
                same(place * n, first, self.arrived[q], 0, self.coordinator.node_of)
        values = [v for q in self.alive for v in self.arrived[q]["values"]] \
            if gather else None
        self.arrived.clear()
        self.node_since = None
        release = dict(first, values=values)
        self.listener.broadcast("RELEASE", {"seq": release["seq"], "shared": release["shared"],
                                            "values": values}, ranks=self.others)
        self.coordinator.release(release)

    def beat(self, now):
        if now - self.beat_sent >= self.BEAT_S:
            self.listener.broadcast("HEARTBEAT", ranks=self.others + list(self.coming))
            self.beat_sent = now

    def lost(self, now, silent):
        """A node silent for ``silent`` seconds, in words, or None."""
        k = self._silent(now, silent)
        return None if k is None else self._gone(k)

    def _silent(self, now, silent):
        return next((k for k in self.joined if k in self.alive and k not in self.finished
                     and now - self.node_beat[k] > silent), None)

    def _gone(self, k):
        return (f"node {k} ({printable(self.joined[k]['host'], 100)}) stopped answering: "
                "its launcher is gone")

    # ---------------------------------------------------------------- a node dropped

    def _drop(self, k, error):
        """Node ``k`` failed (``error``): raise it, or, where --min-workers allows, go on
        without the node: every other node's workers go back to an exchange all hold."""
        n = self.coordinator.n
        left = (len(self.alive) - 1) * n
        if self.min_workers is None or self.min_workers >= self.nnodes * n:
            raise error
        if left < self.min_workers:
            raise WorkerFailed(error.rank, f"{error.reason}; {left} worker(s) would remain "
                               f"without node {k}, fewer than --min-workers "
                               f"{self.min_workers}: the run stops", error.details, node=k)
        if self._not_finished(error.reason):
            self.alive.remove(k)  # (it will not finish)
            self.listener.forget(k)
            return
        place = self.alive.index(k)
        self.alive.remove(k)
        self.listener.send(k, "STOP", {"reason": f"node 0 goes on without this node: "
                                                 f"{printable(error, 500)}"})
        self.listener.forget(k)  # started again, it may join
        self.gen += 1
        self.arrived.clear()
        self.node_since = None
        ranks = list(range(place * n, (place + 1) * n))
        why = str(error).split("\n")[0]
        self.log(f"{why}: node {k} leaves the run; {left} workers on {len(self.alive)} "
                 f"node(s) go on without it")
        first = self.dropping
        self.dropping = {"lost": (first or {}).get("lost", []) + ranks, "reason": why,
                         "joined": (first or {}).get("joined", [])}
        self.holding = {}
        self.listener.broadcast("DROP", {"gen": self.gen, "reason": self.dropping["reason"],
                                         "node": None}, ranks=self.others)
        self.coordinator.dropped(self.dropping["reason"])

    def pause(self, rank, reason, joined):
        """Node 0's own worker ``rank`` lost, its replacement starting."""
        self._pause(0, rank, reason, joined)

    def _pause(self, k, rank, reason, joined):
        """A worker of node ``k`` (``rank``) was lost (``reason``) and a new one starts in
        its place (new ones in the ranks ``joined``): every node's workers go back to an
        exchange all hold, and node ``k`` says what it holds once the replacement is ready
        (docs/DECISIONS.md, "A worker restarted across nodes")."""
        if self._not_finished(reason):
            return
        self.gen += 1
        self.arrived.clear()
        self.node_since = None
        self.log(f"{reason}: a new worker takes its place on node {k}; every node waits for "
                 "it")
        first = self.dropping or {}
        # Node 0's record takes its own workers' losses from its own membership.
        self.dropping = {"lost": first.get("lost", []) + ([rank] if k else []),
                         "joined": first.get("joined", []) + (joined if k else []),
                         "reason": first.get("reason", reason)}
        self.holding = {}
        self.paused.add(k)
        self.listener.broadcast("DROP", {"gen": self.gen, "reason": reason, "node": k},
                                ranks=self.others)
        if k != 0:
            self.coordinator.dropped(reason)

    def _not_finished(self, reason):
        """Whether a loss (``reason``) came at the run's very end, after some node finished
        (or the run was over already): then the run ends (_over) and True."""
        done = sorted(j for j in self.finished if j in self.alive)
        if done:
            self._over(f"{reason} after node(s) {done} finished")
        return self.ended

    def hold(self, data):
        """Node 0's workers' HOLD."""
        self.holds(0, data)

    def holds(self, k, data):
        """What node ``k``'s workers all hold (every node's, node 0's by a call): once every
        node has said, every node goes back to the newest exchange all of them hold."""
        if self.holding is None:
            return
        self.holding[k] = data
        if len(self.holding) < len(self.alive):
            return
        # A node whose workers are all new (one worker a node, replaced) holds nothing: it
        # takes another node's state, as a node that joins does.
        empty = {k for k, h in self.holding.items() if not h["kept"] and k in self.paused}
        held = [h for k, h in self.holding.items() if k not in empty]
        if not held:
            raise WorkerFailed(None, f"{self.dropping['reason']}: every node's workers are "
                               "new, and none holds the run's state: the run stops")
        common = set.intersection(*[{tuple(p[:2]) for p in h["kept"]} for h in held])
        if not common:
            from .membership import stops
            raise WorkerFailed(None, f"{self.dropping['reason']} "
                                     f"{stops(any(h.get('fresh') for h in self.holding.values()))}")
        back_to = max(common)
        step = next(p[2] for p in held[0]["kept"] if tuple(p[:2]) == back_to)
        joining = sorted(k for k, state in self.coming.items() if state == "joining")
        nodes = sorted(self.alive + joining)
        n = self.coordinator.n
        joined = [nodes.index(k) * n + r for k in joining for r in range(n)]
        # The first node whose workers all came through (its place) hands its state to the
        # nodes that join or hold nothing, and to a replaced worker what each node keeps
        # alike besides the replicas (an outer optimizer's slices); None: every node had a
        # worker replaced (docs/DECISIONS.md, "A worker restarted across nodes").
        keeper = next((nodes.index(k) for k in self.alive if k not in self.paused), None)
        source = keeper if keeper is not None else next(
            nodes.index(k) for k in self.alive if k not in empty)
        regroup = {"gen": self.gen, "back_to": [*back_to, step], "nodes": nodes,
                   "source": source if joining or empty else None,
                   "keeper": keeper if self.paused & set(nodes) else None}
        dropping, self.holding, self.dropping = self.dropping, None, None
        self.paused = set()
        self.alive = nodes
        for k in joining:
            del self.coming[k]
        self.listener.broadcast("REGROUP", regroup, ranks=self.others)
        self.coordinator.regroup(regroup, dropping["lost"], dropping["reason"],
                                 dropping.get("joined", []) + joined)
        self._admit()  # those that became ready meanwhile

    def check(self, now):
        missing = [k for k in range(1, self.nnodes) if k not in self.joined
                   and not self.started]
        if missing and now - self.t0 > self.join_timeout:
            raise WorkerFailed(None, f"node(s) {missing} did not join within "
                               f"{self.join_timeout:.0f} s at {self.address} (started? "
                               "the same secret? a firewall?)", node=missing[0])
        k = self._silent(now, self.node_timeout)
        if k is not None:
            self._drop(k, WorkerFailed(None, self._gone(k), node=k))
        for k in [k for k in self.coming if now - self.node_beat[k] > self.node_timeout]:
            del self.coming[k]  # it never joined: the run goes on as it was
            self.listener.forget(k)
            self.log(f"{self._gone(k)} before it joined")
        if self.node_since is not None and now - self.node_since > self.progress_timeout:
            absent = min(k for k in self.alive if k not in self.arrived)
            raise WorkerFailed(None, f"node {absent} reached no barrier in "
                               f"{self.progress_timeout:.0f} s while node(s) "
                               f"{sorted(self.arrived)} waited at one", node=absent)


def _reason(error):
    """Why a launcher stops, in words, for what is not a WorkerFailed."""
    if isinstance(error, KeyboardInterrupt):
        return "was interrupted (Ctrl-C or SIGTERM)"
    return f"stopped: {type(error).__name__}: {error}"
