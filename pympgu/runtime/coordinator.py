"""One node's launcher at work: its workers' messages, processes and output, supervised.

What concerns every node goes to the level above this node's coordinator: ``Alone`` (a run
of one node), ``Hub`` (node 0 of several: pympgu.runtime.hub) or ``Uplink`` (another node:
pympgu.runtime.uplink), each with the same few calls: whether the workers may start, a
barrier this node's ranks have all reached, a metric, a node's loss, the results.
"""
import signal
import time

from .failures import WorkerFailed
from .membership import Membership
from .protocol import printable


class Alone:
    """The level above a run of one node: nothing but this node."""

    sockets = ()

    def attach(self, coordinator):
        self.coordinator = coordinator

    def handle(self, ready):
        pass

    def may_run(self):
        return True

    def arrive(self, arrival):
        self.coordinator.release(arrival)

    def report(self, rank, data):
        self.coordinator.metric(rank, data)

    def lost(self, now, silent):
        return None

    def beat(self, now):
        pass

    def check(self, now):
        pass

    def done(self):
        return True

    def finish(self, mine):
        return mine

    def stop(self, error):
        pass

    def close(self):
        pass


class NodeCoordinator:
    """This node's workers (``procs``, their ``outputs``), met through ``listener``; the
    level ``above`` this node. A rank silent for ``heartbeat_timeout`` seconds, or absent
    from a barrier (or register) for ``progress_timeout`` seconds while another rank waits
    there, fails the run; or, while more than ``min_workers`` remain (a run of one node),
    is dropped, killed if it still runs, and the others go on without it (Membership).
    ``restarting``: (start, restarts, retired, whole): start(slot, joining=True) starts a
    new worker in a lost one's place, at most ``restarts`` times in all, which joins the
    others once it is ready; the outputs it replaces go to ``retired``; ``whole``: across
    nodes every worker of the node is started again with the lost one (GPU workers, whose
    peers' kernels wait for it: docs/DECISIONS.md, "A GPU node starts its workers again")."""

    # Across nodes: how long a rank's error is held, and how long a node's silence then
    # says it is lost (the heartbeats come every second).
    HOLD_S, SILENT_S = 3.0, 2.5

    def __init__(self, listener, procs, outputs, node, nnodes, above, on_metric, log,
                 heartbeat_timeout, progress_timeout, min_workers=None, restarting=None):
        self.listener, self.procs, self.outputs = listener, procs, outputs
        self.node, self.nnodes, self.above = node, nnodes, above
        self.on_metric, self.log = on_metric, log
        self.heartbeat_timeout, self.progress_timeout = heartbeat_timeout, progress_timeout
        self.n = len(procs)
        self.offset = node * self.n
        # Across nodes a node is lost whole (docs/DECISIONS.md, "A node lost"): a worker's
        # loss fails its node, and node 0's hub decides whether the others go on.
        self.membership = Membership(self.n, min_workers if nnodes == 1 else None)
        self.start_worker, self.restarts, self.retired, self.whole = \
            restarting or (None, 0, [], False)
        # Where a node starts every worker again, each keeps its state where the new one in
        # its place takes it up (pympgu.training.carried).
        self.carries = bool(self.whole and nnodes > 1 and self.restarts > 0)
        # Restarted workers not yet in the run, by slot: "starting", "ready" (its RECOVER
        # came) or "joining" (the others are taking it in).
        self.joiners = {}
        now = time.monotonic()
        self.hello, self.registered, self.results, self.waiting = set(), {}, {}, {}
        self.stalled = set()  # ranks long at a barrier in shared memory (WAITING)
        self.last_beat = {r: now for r in range(self.n)}
        self.since = None  # when the first local rank reached the barrier others have not
        self.metric_failed = False
        self.running = False
        self.pending = None  # (a rank's error, when): held a moment across nodes
        self.ended = False  # a loss came after the run's last barrier (end)
        above.attach(self)

    def run(self):
        """Supervise until every rank is done; returns the results (Alone.finish's)."""
        import zmq
        self.poller = zmq.Poller()
        for s in (self.listener.socket, *self.above.sockets):
            self.poller.register(s, zmq.POLLIN)
        self.reading = {}
        for outs in self.outputs:
            self._watch(outs)
        # (No members left: a node's only worker, lost and being replaced.)
        while not self._finished():
            ready = dict(self.poller.poll(100))
            if self.listener.socket in ready:
                self.drain()
            self.above.handle(ready)
            for fd in [fd for fd in self.reading if fd in ready]:
                self.reading[fd].read()
            for fd in [fd for fd, out in self.reading.items() if not out.open]:
                self.poller.unregister(fd)
                del self.reading[fd]
            self._check(time.monotonic())
        if self.joiners:  # restarted, and the run ended before they could join
            self.listener.broadcast("STOP", {"reason": "the run ended before this worker "
                                             "joined"}, ranks=list(self.joiners))
        return self.above.finish([self.results[r] for r in self.membership.members
                                  if r in self.results])

    def _finished(self):
        """Every worker gave its result (once the run ended: every one still alive did)
        and the level above is done."""
        members = self.membership.members
        if self.ended:
            return self.above.done() and all(
                r in self.results or self.procs[r].exitcode is not None for r in members)
        return members and len(self.results) == len(members) and self.above.done()

    def end(self):
        """A loss came after every rank passed the run's last barrier (node 0's hub knows
        it by a node that finished): nothing is left to redo. This node finishes with the
        results of its workers still alive; a worker lost now, or waiting to recover, is
        let go (docs/DECISIONS.md, "A loss at the run's very end")."""
        self.ended = True
        self.since = None
        waiting = sorted(self.membership.recovered_slots)
        if waiting:
            self.listener.broadcast("STOP", {"reason": "the run has ended"}, ranks=waiting)

    def _watch(self, outs):
        import zmq
        for out in outs:
            self.reading[out.fileno()] = out
            self.poller.register(out.fileno(), zmq.POLLIN)

    def drain(self):
        while (msg := self.listener.receive(0)) is not None:
            self._from_worker(*msg)

    def node_of(self, rank):
        return rank // self.n if self.nnodes > 1 else None

    def rank_of(self, local):
        """The run's number now for this node's worker in slot ``local``."""
        return self.offset + self.membership.rank(local)

    # ---------------------------------------------------------------- the workers

    def _from_worker(self, local, kind, data, blobs):
        if local in self.joiners and kind != "ERROR":  # a joiner's exception fails the run
            self._from_joiner(local, kind, data)
            return
        if local not in self.joiners and not self.membership.heard(local, kind):
            return  # the dead's last words, or what a survivor said before it recovered
        rank = self.rank_of(local)
        self.last_beat[local] = time.monotonic()
        if kind in ("REGISTER", "BARRIER") and self.since is None:
            self.since = time.monotonic()
        if kind == "HELLO":
            self.hello.add(local)
            self.maybe_run()
        elif kind == "REGISTER":
            self.registered[local] = (data, blobs[0] if blobs else b"")
            if len(self.registered) == len(self.membership.members):
                _send_peers(self.listener, self.registered, self.offset)
                self.registered.clear()
                self.since = None
        elif kind == "BARRIER":
            self.waiting[local] = data
            if len(self.waiting) == len(self.membership.members):
                self._local_barrier()
        elif kind == "WAITING":
            if data["waiting"]:
                self.stalled.add(local)
                self.since = self.since or time.monotonic()
            else:
                self.stalled.discard(local)
                if not (self.stalled or self.waiting or self.registered):
                    self.since = None
        elif kind == "METRIC":
            if data.get("kind") == "recovered":  # the survivors' first exchange since
                data = self.membership.record()
                if data is None or self.offset:  # node 0's record is the run's
                    return
            self.above.report(rank, data)
        elif kind == "RECOVER" and self.ended:
            self.listener.send(local, "STOP", {"reason": "the run has ended"})
        elif kind == "RECOVER" and self.nnodes > 1:
            held = self.membership.holds(local, data["kept"], data["at"])
            if held is not None:
                self.above.hold(held)  # node 0 picks where every node goes back to
        elif kind == "RECOVER":
            reform = self.membership.recovered(local, data["kept"], data["at"])
            if reform is not None:
                self.since = None
                for r in [r for r, state in self.joiners.items() if state == "joining"]:
                    del self.joiners[r]  # a worker of the run from now on
                self.listener.broadcast("REFORM", reform, ranks=self.membership.members)
                self._admit()  # those that became ready meanwhile
        elif kind == "ERROR":
            if data["message"] is not None:  # a failure said whole: no traceback to show
                error = WorkerFailed(rank, printable(data["message"], 2000),
                                     node=self.node_of(rank))
            else:
                error = WorkerFailed(rank, "raised an exception",
                                     printable(data["traceback"]), node=self.node_of(rank))
            if self.nnodes == 1:
                raise error
            # Across nodes a rank's exception is often the echo of another node's loss (a
            # collective whose peer vanished): hold it while that shows (_check).
            if self.pending is None:
                self.pending = (error, time.monotonic())
        elif kind == "DONE":
            self.results[local] = data["result"]

    def _from_joiner(self, local, kind, data):
        """A restarted worker: started, then ready to join (its RECOVER) as soon as every
        other worker is back in step."""
        self.last_beat[local] = time.monotonic()
        if kind == "HELLO":
            self.listener.send(local, "RUN", {"joining": True, "carry": self.carries})
        elif kind == "RECOVER" and self.joiners[local] == "starting":
            self.joiners[local] = "ready"
            if self.nnodes > 1:  # every node waits for it (pause): this node may say now
                self.joiners[local] = "joining"
                held = self.membership.ready(local, data["kept"])
                if held is not None:
                    self.above.hold(held)
                return
            self._admit()

    def _admit(self):
        """The ready joiners join, where no recovery is under way: the others go back to
        their last exchange and take them in (SHRINK, then REFORM)."""
        ready = sorted(r for r, state in self.joiners.items() if state == "ready")
        if not ready or self.membership.recovering is not None:
            return
        for r in ready:
            self.joiners[r] = "joining"
        self._reshape(self.membership.grow(ready, time.monotonic()))

    def _restart(self, local, now, spend=True):
        """A new worker in slot ``local``'s place, to join once ready (``spend``: counted
        against the restarts; a node started again whole counts once)."""
        self.restarts -= spend
        self.listener.forget(local)
        self.retired.extend(self.outputs[local])
        self.procs[local], self.outputs[local] = self.start_worker(local, joining=True)
        self._watch(self.outputs[local])
        self.joiners[local] = "starting"
        self.hello.discard(local)
        self.last_beat[local] = now

    def metric(self, rank, data):
        """A worker's metric, for on_metric: a report that cannot be shown stops no run."""
        if self.on_metric is None:
            return
        try:
            self.on_metric(rank, data)
        except Exception as e:
            if not self.metric_failed:
                self.log(f"a metric of rank {rank} could not be shown "
                         f"({type(e).__name__}: {printable(e, 200)}); the run goes on")
            self.metric_failed = True

    def maybe_run(self):
        """RUN, once every worker said HELLO and the level above allows it."""
        if self.running or len(self.hello) < self.n or not self.above.may_run():
            return
        self.running = True
        joining = getattr(self.above, "joining", False)
        if joining:  # a node that joins a run under way: its workers hold nothing yet
            self.membership.late(time.monotonic())
        self.listener.broadcast("RUN", {"joining": joining, "carry": self.carries})

    def _local_barrier(self):
        members = self.membership.members
        first = self.waiting[members[0]]
        shape = {r: (d["seq"], d["local"], d["gather"]) for r, d in self.waiting.items()}
        if len(set(shape.values())) != 1:
            r = min(self.waiting)
            raise WorkerFailed(self.rank_of(r), "is out of step",
                               "barrier (sequence number, node-local, gather) by rank: " +
                               ", ".join(f"rank {self.rank_of(q)}: {v}"
                                         for q, v in sorted(shape.items())),
                               node=self.node_of(self.rank_of(r)))
        if not first["gather"]:
            for r in members[1:]:
                same(self.rank_of(r), first, self.waiting[r], self.offset, self.node_of)
        values = [self.waiting[r]["value"] for r in members] if first["gather"] else None
        self.waiting.clear()
        self.since = None
        arrival = {"seq": first["seq"], "what": first["what"], "value": first["value"],
                   "shared": first["shared"], "values": values}
        if first["local"]:
            self.release(arrival)
        else:
            self.above.arrive(arrival)

    def release(self, arrival):
        """Let this node's ranks through the barrier ``arrival`` (rank 0's shared value, and
        every rank's with a gather)."""
        self.listener.broadcast("RELEASE", {"seq": arrival["seq"], "shared": arrival["shared"],
                                            "values": arrival["values"]},
                                ranks=self.membership.members)

    def _pause(self, local, error, now):
        """Across nodes, with restarts left: the worker in slot ``local`` failed with
        ``error``; a new one takes its slot (with ``whole``, new ones take every slot of
        the node), and every node goes back and waits for it (docs/DECISIONS.md, "A worker
        restarted across nodes")."""
        rank = self.rank_of(local)
        slots = list(self.membership.members) if self.whole else [local]
        joined = [self.rank_of(s) for s in slots]
        for s in slots:  # (the lost one's rank and reason only: the rest stop with it)
            self.membership.pause(s, rank if s == local else None, error.reason, now)
            p = self.procs[s]
            if p.exitcode is None:  # hung, or a peer waiting for it: it must not write on
                p.kill()
                p.join(5)
            self.last_beat.pop(s, None)
        self._reshape({"lost": rank, "reason": error.reason})
        for s in slots:
            self._restart(s, now, spend=s == local)
        if self.whole and len(slots) > 1:
            self.log(f"node {self.node}'s other worker(s) stopped with rank {rank}: "
                     f"{len(slots)} new workers take their places")
        self.above.pause(rank, str(error).split("\n")[0], joined)

    def _restartable(self):
        """Across nodes: whether a lost worker is replaced (restarts left, training under
        way) rather than failing its node."""
        return self.nnodes > 1 and self.running and self.restarts > 0

    def _lose(self, local, error, now):
        """The worker in slot ``local`` failed with ``error``: raise it, or, where
        --min-workers allows, drop the worker (killed if it still runs) and tell the others
        to go on without it; across nodes, replace it while restarts are left."""
        if self.ended:  # past the run's last barrier: nothing to redo
            return
        if self._restartable():
            self._pause(local, error, now)
            return
        if not self.running:  # the survivors wait for RUN: there is nothing to go back to
            raise error
        shrink = self.membership.lose(local, error, now)
        p = self.procs[local]
        if p.exitcode is None:  # hung: it must not wake and write into the exchange
            p.kill()
            p.join(5)
        self.last_beat.pop(local, None)
        self._reshape(shrink)
        if self.restarts > 0:
            self._restart(local, now)

    def dropped(self, reason):
        """Node 0 dropped a node (``reason``): this node's workers go back too."""
        self.membership.external(time.monotonic())
        self._reshape({"lost": None, "reason": reason})

    def regroup(self, data, lost=(), reason=None, joined=()):
        """Node 0's REGROUP: the nodes from now on (``nodes``, in order) and the exchange
        every worker goes back to; ``lost``, ``reason``, ``joined``: for node 0's record."""
        nodes = data["nodes"]
        place = nodes.index(self.node)
        reform = self.membership.reform(data["back_to"], lost, reason,
                                        workers=len(nodes) * self.n, joined=joined)
        for r in [r for r, state in self.joiners.items() if state == "joining"]:
            del self.joiners[r]  # a worker of the run from now on
        reform.update(node=place, nnodes=len(nodes), source=data.get("source"),
                      keeper=data.get("keeper"))
        self.offset = place * self.n
        self.since = None
        self.listener.broadcast("REFORM", reform, ranks=self.membership.members)

    def _reshape(self, shrink):
        """Tell the workers to leave what they do and recover (SHRINK)."""
        self.registered.clear()
        self.waiting.clear()
        self.stalled.clear()
        self.since = time.monotonic()  # the hang check covers the recovery too
        self.listener.broadcast("SHRINK", shrink, ranks=self.membership.members)

    # ---------------------------------------------------------------- every poll

    def _check(self, now):
        for outs in self.outputs:
            for out in outs:
                out.tick(now)
        self.above.beat(now)  # even while an error is held
        if self.pending is not None:
            error, since = self.pending
            lost = self.above.lost(now, self.SILENT_S)
            if lost is not None:
                raise WorkerFailed(None, f"{lost}; then rank {error.rank} {error.reason}",
                                   error.details, node=error.node)
            if now - since > self.HOLD_S:
                raise error
            return  # its process's exit is this error's echo
        for local in list(self.joiners):
            p = self.procs[local]
            if p.exitcode is not None or now - self.last_beat[local] > self.heartbeat_timeout:
                self._lost_joiner(local, p, now)
        for local in list(self.membership.members):
            p = self.procs[local]
            if local in self.results:
                continue
            if p.exitcode is not None:
                error = self._exited(local, p)
                if error is None or self.ended:
                    continue
                if self.nnodes == 1:
                    self._lose(local, error, now)
                    continue
                if self._restartable():
                    self._pause(local, error, now)
                    continue
                if p.exitcode == -signal.SIGKILL:
                    raise error
                # Across nodes a worker's death may be the echo of another node's loss too
                # (JAX's runtime aborts a process whose peer vanished): held as an
                # exception. A SIGKILL is never such an echo.
                self.pending = (error, now)
                return
            if now - self.last_beat[local] > self.heartbeat_timeout:
                rank = self.rank_of(local)
                self._lose(local, WorkerFailed(rank, f"sent nothing for "
                                               f"{self.heartbeat_timeout:.0f} s (hung?)",
                                               node=self.node_of(rank)), now)
        if self.since is not None and now - self.since > self.progress_timeout:
            # Heartbeats say a process lives, not that it gets anywhere.
            waiting = (set(self.waiting) | set(self.registered) | self.stalled
                       | self.membership.recovered_slots)
            members = self.membership.members
            absent = min((r for r in members if r not in waiting), default=None)
            if absent is None:  # each at a barrier of its own: not in step
                raise WorkerFailed(self.offset, f"every rank of the node waited at a barrier "
                                   f"for {self.progress_timeout:.0f} s (out of step?)",
                                   node=self.node_of(self.offset))
            what = ("returned" if absent in self.results else
                    f"reached no barrier in {self.progress_timeout:.0f} s")
            rank = self.rank_of(absent)
            error = WorkerFailed(rank, f"{what} while rank(s) "
                                 f"{sorted(self.rank_of(r) for r in waiting)} waited at one "
                                 "(hung, or out of step?)", node=self.node_of(rank))
            if absent in self.results:
                raise error
            self._lose(absent, error, now)
        self.above.check(now)

    def _lost_joiner(self, local, p, now):
        """A restarted worker lost before it joined: dropped (and restarted again while
        restarts remain)."""
        del self.joiners[local]
        if p.exitcode is None:
            p.kill()
            p.join(5)
        for out in self.outputs[local]:
            out.read()
            out.close()
        how = (f"was killed by signal {-p.exitcode}" if p.exitcode < 0
               else f"exited with status {p.exitcode}")
        self.log(f"a restarted worker (pid {p.pid}) {how} before it joined")
        self.membership.drop_joiner(local)
        if self.restarts > 0:
            self._restart(local, now)
        elif self.nnodes > 1:  # its slot stays empty: the node fails whole
            rank = self.rank_of(local)
            raise WorkerFailed(rank, f"was lost, and its replacement {how} before it "
                               "joined, with no restart left", node=self.node_of(rank))

    def _exited(self, local, p):
        """The failure a worker's exit is, or None where it had finished: it may have
        exited before its last words (DONE, its traceback, its output) were read, so
        everything still queued is taken first."""
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            if self.listener.socket.poll(50):
                self.drain()
        for out in self.outputs[local]:
            out.read()
            out.close()
        if local in self.results:
            return None
        rank = self.rank_of(local)
        if p.exitcode == -signal.SIGABRT:
            for out in self.outputs[local]:
                if (why := out.abort_reason()) is not None:
                    return WorkerFailed(rank, f"was aborted by its C++ runtime (pid {p.pid}): "
                                        f"{printable(why, 1000)}",
                                        node=self.node_of(rank))
        how = (f"was killed by signal {-p.exitcode}" if p.exitcode < 0
               else f"exited with status {p.exitcode}")
        return WorkerFailed(rank, f"{how} (pid {p.pid})", node=self.node_of(rank))


def same(rank, first, d, first_rank, node_of):
    """Fail the run where ``rank``'s barrier ``d`` holds another value than ``first``."""
    if (d["what"], d["value"]) != (first["what"], first["value"]):
        raise WorkerFailed(rank, f"differs from rank {first_rank} in its {first['what']}",
                           f"rank {first_rank}: {printable(first['value'], 2000)}\n"
                           f"rank {rank}: {printable(d['value'], 2000)}",
                           node=node_of(rank))


def _send_peers(listener, registered, offset=0):
    """Every rank's registration to every rank (``registered``: by slot; ranks in slot
    order)."""
    slots = sorted(registered)
    layouts = [registered[r][0]["layout"] for r in slots]
    for r in range(1, len(slots)):
        if layouts[r] != layouts[0]:
            raise WorkerFailed(offset + r, "registered a different parameter layout",
                               f"rank {offset}: {_describe(layouts[0])}\n"
                               f"rank {offset + r}: {_describe(layouts[r])}")
    facts = [registered[r][0]["facts"] for r in slots]
    sms = [f.get("sm_count") for f in facts if f.get("sm_count")]
    payload = {"facts": facts, "max_blocks": min(2 * min(sms), 512) if sms else None}
    listener.broadcast("PEERS", payload, [registered[r][1] for r in slots], ranks=slots)


def _describe(layout):
    return ", ".join(f"{name} {tuple(shape)} {dtype}" for name, shape, dtype in layout)
