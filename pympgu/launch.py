"""The launcher: one worker process per GPU (or CPU slot), run to completion or stopped cleanly.

``launch(target, args, gpus=[0, 1])`` starts one spawned process per rank, each calling
``target(ctx, *args)`` with a :class:`WorkerContext`, and coordinates them over ZMQ
(:mod:`pympgu.control`). It returns every rank's return value. If any rank raises, dies
(even by SIGKILL), stops sending heartbeats, or leaves its peers waiting at a barrier for
``progress_timeout`` seconds, the others are told to stop, killed after a grace period if
they do not, every shared-memory segment of the run is unlinked, and :class:`WorkerFailed`
names the rank and carries its traceback. Ctrl-C and SIGTERM do the same and raise
KeyboardInterrupt (:class:`Terminated` for SIGTERM). No worker outlives the launcher: each
one exits if its parent disappears, removing the shared memory it created.

With ``nodes`` (pympgu.nodes.Nodes) of several nodes, one launch runs on each node and
starts that node's workers; node 0's also listens for the others' at ``nodes.address``,
authenticated by the run's shared ``secret``. Run-wide barriers wait for every rank of
every node; a failure anywhere stops every node within ``node_timeout`` seconds or so.
Ranks are numbered node after node; node 0's launch returns every rank's value, another
node's its own ranks'.
"""
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback

from . import control, shm
from .errors import ExchangeError


class WorkerFailed(ExchangeError):
    """A rank raised, died or hung, or a node was lost; ``rank`` is the first rank that
    failed (None for a node lost whole), ``node`` its node."""

    def __init__(self, rank, reason, details="", node=None):
        self.rank, self.reason, self.details, self.node = rank, reason, details, node
        who = "" if rank is None else f"rank {rank} "
        where = "" if node is None or rank is None else f" (node {node})"
        super().__init__(f"{who}{reason}{where}" + (f"\n{details}" if details else ""))


class Terminated(KeyboardInterrupt):
    """The launcher received SIGTERM (a scheduler's stop, say): the run stopped as Ctrl-C
    stops it."""


class WorkerContext:
    """What a worker knows of the run: its rank among all (``rank`` of ``nranks``) and on
    its node (``local_rank`` of ``local_nranks``), its node (``node`` of ``nnodes``), its
    device, the run's public id (which names its shared memory) and the way to the
    coordinator."""

    def __init__(self, place, device, run_id, link, data_address=None):
        (self.rank, self.nranks, self.local_rank, self.local_nranks, self.node,
         self.nnodes) = place
        self.device, self.run_id, self.link = device, run_id, link
        self.data_address = data_address  # node 0's address for the data plane's rendezvous
        self._barrier_seq = 0

    @property
    def is_cpu(self):
        return self.device is None

    def barrier(self, what=None, value=None, shared=None, local=False):
        """A host barrier of every rank (of this node's alone with ``local``), through the
        coordinator. With ``what``, every rank must also hold the same ``value`` (a JSON
        value): otherwise the run fails, naming the first rank whose ``what`` differs from
        rank 0's. Returns rank 0's ``shared`` (any JSON value; the other ranks' are
        ignored): what rank 0 alone decided, such as whether to stop."""
        return self._meet(what, value, shared, local, False)["shared"]

    def gather(self, value, local=False):
        """Every rank's ``value`` (a JSON value), in rank order: a barrier that hands out
        what each rank brought (only this node's ranks' with ``local``)."""
        return self._meet(None, value, None, local, True)["values"]

    def _meet(self, what, value, shared, local, gather):
        self._barrier_seq += 1
        self.link.send("BARRIER", {"seq": self._barrier_seq, "what": what, "value": value,
                                   "shared": shared, "local": bool(local), "gather": gather})
        data, _ = self.link.receive("RELEASE")
        return data

    def register(self, layout, facts, blob):
        """Announce this rank's buffer to its node's ranks; returns every local rank's
        (facts, blob) and max_blocks."""
        self.link.send("REGISTER", {"layout": layout, "facts": facts}, [blob])
        data, blobs = self.link.receive("PEERS")
        return data["facts"], blobs, data.get("max_blocks")

    def metric(self, **values):
        """Send metrics to the launcher (node 0's), which prints or records them."""
        self.link.send("METRIC", values)


def _worker_main(place, device, address, secret, run_id, data_address, target, args):
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group; the launcher alone
    # decides how to stop, and tells the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    local_rank, local_nranks = place[2], place[3]
    link = control.WorkerLink(address, secret, local_rank, local_nranks,
                              on_orphaned=shm.unlink_created)
    code = 0
    try:
        if device is not None:
            from . import cuda
            cuda.set_device(device)
        link.send("HELLO", {"version": control.PROTOCOL_VERSION, "pid": os.getpid(),
                            "device": device})
        link.receive("RUN")
        ctx = WorkerContext(place, device, run_id, link, data_address)
        if ctx.nnodes > 1 and device is None:
            from .exchange import across
            across.join(ctx)  # before the target's first JAX computation
        result = target(ctx, *args)
        link.send("DONE", {"result": result})
        if ctx.nnodes > 1 and device is None:
            across.leave()  # with every rank, so that no rank's runtime outlives the rest
    except control.Stopped:
        code = 0
    except BaseException:
        link.send("ERROR", {"traceback": traceback.format_exc()})
        code = 1
    finally:
        link.close()
        shm.unlink_created()  # what a failure left open (closed segments are gone already)
    sys.stdout.flush()
    os._exit(code)


def launch(target, args=(), *, gpus=None, cpu=None, host="127.0.0.1", port=None,
           on_metric=None, heartbeat_timeout=120.0, progress_timeout=600.0, grace=3.0,
           log=None, nodes=None, secret=None, node_timeout=5.0, join_timeout=120.0):
    """Run target(ctx, *args) on one process per GPU in gpus, or on cpu CPU workers (of
    this node, with ``nodes``).

    on_metric(rank, payload) gets each ctx.metric(); an exception it raises is reported
    once and does not stop the run. A rank silent for heartbeat_timeout seconds, or absent
    from a barrier (or register) for progress_timeout seconds while another rank waits
    there, fails the run; so does a node silent for node_timeout seconds, or not there
    join_timeout seconds after the first."""
    if (gpus is None) == (cpu is None):
        raise ValueError("give exactly one of gpus= and cpu=")
    devices = list(gpus) if gpus is not None else [None] * int(cpu)
    nlocal = len(devices)
    if not 1 <= nlocal <= 8:
        raise ValueError(f"pympgu runs 1 to 8 workers a node, got {nlocal}")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    multi = nodes is not None and nodes.nnodes > 1
    if multi and not secret:
        raise ValueError("a run of several nodes needs their shared secret (secret=; "
                         "pympgu.nodes.read_secret)")
    ctx = mp.get_context("spawn")
    procs, hub, up = [], None, None
    coord = control.Coordinator(nlocal, host=host, port=None if multi else port, log=log)
    run_id = control.new_run_id()
    # The secret reaches each worker through its spawn pipe: never argv, env or a file.
    with _sigterm_raises():
        try:
            if multi and nodes.node_rank == 0:
                hub = control.Coordinator(nodes.nnodes, host=_bind_host(nodes), port=nodes.port,
                                          secret=secret, log=log, kinds=control.TO_HUB,
                                          hello="JOIN", fresh_key=True)
            elif multi:
                up = control.WorkerLink(f"tcp://{nodes.address}", secret, nodes.node_rank,
                                        nodes.nnodes, kinds=control.TO_NODE,
                                        watch_parent=False, fresh_key=True)
            nnodes, node = (nodes.nnodes, nodes.node_rank) if multi else (1, 0)
            data_address = f"{nodes.host}:{nodes.port + 1}" if multi else None
            for r, device in enumerate(devices):
                place = (node * nlocal + r, nnodes * nlocal, r, nlocal, node, nnodes)
                p = ctx.Process(target=_worker_main, name=f"pympgu-rank{place[0]}",
                                daemon=True,
                                args=(place, device, coord.address, coord.secret, run_id,
                                      data_address, target, args))
                p.start()
                procs.append(p)
            sup = _Supervisor(coord, procs, node, nnodes, hub, up, on_metric, log,
                              heartbeat_timeout, progress_timeout, node_timeout, join_timeout)
            return sup.run()
        except BaseException as e:
            coord.broadcast("STOP", {"reason": "the run is stopping"})
            _tell_the_nodes(hub, up, e)
            raise
        finally:
            _reap(procs, grace)
            shm.unlink_run(run_id)
            coord.close()
            for end in (hub, up):
                if end is not None:
                    end.close()


def _bind_host(nodes):
    """Node 0 listens on loopback when every node is on this host, else on every interface."""
    return "127.0.0.1" if nodes.loopback else "*"


def _tell_the_nodes(hub, up, error):
    """A run that stops on one node stops on every node: node 0 tells the others, another
    node tells node 0 (which tells the rest)."""
    if isinstance(error, WorkerFailed):
        rank, reason, details = error.rank, error.reason, error.details
    elif isinstance(error, KeyboardInterrupt):
        rank, reason, details = None, "was interrupted (Ctrl-C or SIGTERM)", ""
    else:
        rank, reason, details = None, f"stopped: {type(error).__name__}: {error}", ""
    if hub is not None:
        text = (str(error).split("\n")[0] if isinstance(error, WorkerFailed)
                else f"node 0 {reason}")
        hub.broadcast("STOP", {"reason": text})
    elif up is not None and not isinstance(error, _NodeStopped):
        if rank is None and not isinstance(error, WorkerFailed):
            reason = f"node {up.rank} {reason}"
        try:  # node 0 names this node
            up.send("FAIL", {"rank": rank, "reason": reason, "details": details[-20000:]})
        except Exception:
            pass  # node 0 may be gone already


class _NodeStopped(WorkerFailed):
    """Node 0 stopped the run: another node's rank failed, or a node was lost."""


class _sigterm_raises:
    """While a run is supervised from the main thread, SIGTERM raises Terminated there, so
    that the workers are stopped and reaped as on Ctrl-C; the handler before is restored."""

    def __enter__(self):
        import threading
        self.before = None
        if threading.current_thread() is threading.main_thread():
            self.before = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise Terminated()

    def __exit__(self, *exc):
        if self.before is not None:
            signal.signal(signal.SIGTERM, self.before)


class _Supervisor:
    """One node's launcher at work: its workers' messages (and, on node 0 of several, the
    other nodes' through the hub; on another node, node 0's through the uplink)."""

    BEAT_S = 1.0

    def __init__(self, coord, procs, node, nnodes, hub, up, on_metric, log, heartbeat_timeout,
                 progress_timeout, node_timeout, join_timeout):
        self.coord, self.procs, self.node, self.nnodes = coord, procs, node, nnodes
        self.hub, self.up, self.on_metric, self.log = hub, up, on_metric, log
        self.heartbeat_timeout, self.progress_timeout = heartbeat_timeout, progress_timeout
        self.node_timeout, self.join_timeout = node_timeout, join_timeout
        self.n = len(procs)
        self.offset = node * self.n
        now = time.monotonic()
        self.t0 = now
        self.hello, self.registered, self.results, self.waiting = set(), {}, {}, {}
        self.last_beat = {r: now for r in range(self.n)}
        self.since = None  # when the first local rank reached the barrier others have not
        self.metric_failed = False
        self.running = False
        self.pending = None  # (a rank's error, when): held a moment across nodes
        # Node 0 of several: the other nodes.
        self.joined, self.arrived, self.finished = {}, {}, {}
        self.node_beat, self.node_since, self.beat_sent = {}, None, 0.0
        # Another node: node 0.
        self.started, self.heard = False, now
        if up is not None:
            up.send("JOIN", {"version": control.PROTOCOL_VERSION, "pid": os.getpid(),
                             "host": os.uname().nodename, "nlocal": self.n})

    def run(self):
        import zmq
        poller = zmq.Poller()
        poller.register(self.coord.socket, zmq.POLLIN)
        for end in (self.hub, self.up):
            if end is not None:
                poller.register(end.socket, zmq.POLLIN)
        while not self._done():
            ready = dict(poller.poll(100))
            if self.coord.socket in ready:
                self._drain_local()
            if self.hub is not None and self.hub.socket in ready:
                while (msg := self.hub.receive(0)) is not None:
                    self._from_node(*msg)
            if self.up is not None and self.up.socket in ready:
                while (msg := self.up.read()) is not None:
                    self._from_hub(*msg)
            self._check(time.monotonic())
        if self.up is not None:
            mine = [self.results[r] for r in range(self.n)]
            self.up.send("FINISH", {"results": mine})
            return mine
        everyone = [self.results[r] for r in range(self.n)]
        for k in range(1, self.nnodes):
            everyone += self.finished[k]
        return everyone

    def _done(self):
        """This node's ranks are done (and, on node 0, every other node)."""
        return len(self.results) == self.n and (self.hub is None
                                                 or len(self.finished) == self.nnodes - 1)

    def _drain_local(self):
        while (msg := self.coord.receive(0)) is not None:
            self._from_worker(*msg)

    # ---------------------------------------------------------------- this node's workers

    def _from_worker(self, local, kind, data, blobs):
        rank = self.offset + local
        self.last_beat[local] = time.monotonic()
        if kind in ("REGISTER", "BARRIER") and self.since is None:
            self.since = time.monotonic()
        if kind == "HELLO":
            self.hello.add(local)
            self._maybe_run()
        elif kind == "REGISTER":
            self.registered[local] = (data, blobs[0] if blobs else b"")
            if len(self.registered) == self.n:
                _send_peers(self.coord, self.registered, self.offset)
                self.registered.clear()
                self.since = None
        elif kind == "BARRIER":
            self.waiting[local] = data
            if len(self.waiting) == self.n:
                self._local_barrier()
        elif kind == "METRIC":
            if self.up is not None:
                self.up.send("REPORT", {"rank": rank, "data": data})
            else:
                self._metric(rank, data)
        elif kind == "ERROR":
            error = WorkerFailed(rank, "raised an exception",
                                 control.printable(data["traceback"]), node=self._node_of(rank))
            if self.nnodes == 1:
                raise error
            # Across nodes a rank's exception is often the echo of another node's loss (a
            # collective whose peer vanished): hold it while that shows (_check).
            if self.pending is None:
                self.pending = (error, time.monotonic())
        elif kind == "DONE":
            self.results[local] = data["result"]

    def _node_of(self, rank):
        return rank // self.n if self.nnodes > 1 else None

    def _metric(self, rank, data):
        if self.on_metric is None:
            return
        try:
            self.on_metric(rank, data)
        except Exception as e:  # a report that cannot be shown stops no run
            if not self.metric_failed:
                self.log(f"pympgu: a metric of rank {rank} could not be shown "
                         f"({type(e).__name__}: {control.printable(e, 200)}); the run goes on")
            self.metric_failed = True

    def _maybe_run(self):
        if self.running or len(self.hello) < self.n:
            return
        if self.hub is not None:
            if len(self.joined) < self.nnodes - 1:
                return
            self.hub.broadcast("START")
        if self.up is not None and not self.started:
            return
        self.running = True
        self.coord.broadcast("RUN")

    def _local_barrier(self):
        first = self.waiting[0]
        shape = {r: (d["seq"], d["local"], d["gather"]) for r, d in self.waiting.items()}
        if len(set(shape.values())) != 1:
            r = min(self.waiting)
            raise WorkerFailed(self.offset + r, "is out of step",
                               "barrier (sequence number, node-local, gather) by rank: " +
                               ", ".join(f"rank {self.offset + q}: {v}"
                                         for q, v in sorted(shape.items())),
                               node=self._node_of(self.offset + r))
        if not first["gather"]:
            for r in range(1, self.n):
                self._same(self.offset + r, first, self.waiting[r], self.offset)
        values = [self.waiting[r]["value"] for r in range(self.n)] if first["gather"] else None
        self.waiting.clear()
        self.since = None
        arrival = {"seq": first["seq"], "what": first["what"], "value": first["value"],
                   "shared": first["shared"], "values": values}
        if first["local"] or self.nnodes == 1:
            self._release(arrival)
        elif self.hub is not None:
            self._arrive(0, arrival)
        else:
            self.up.send("ARRIVE", arrival)

    def _same(self, rank, first, d, first_rank):
        if (d["what"], d["value"]) != (first["what"], first["value"]):
            raise WorkerFailed(rank, f"differs from rank {first_rank} in its {first['what']}",
                               f"rank {first_rank}: {control.printable(first['value'], 2000)}\n"
                               f"rank {rank}: {control.printable(d['value'], 2000)}",
                               node=self._node_of(rank))

    def _release(self, arrival):
        self.coord.broadcast("RELEASE", {"seq": arrival["seq"], "shared": arrival["shared"],
                                         "values": arrival["values"]})

    # ---------------------------------------------------------------- node 0: the others

    def _from_node(self, k, kind, data, blobs):
        now = time.monotonic()
        self.node_beat[k] = now
        if k == 0:
            return  # node 0 is this launcher: nothing of its own comes over the socket
        if kind == "JOIN":
            if data["nlocal"] != self.n:
                raise WorkerFailed(None, f"node {k} ({control.printable(data['host'], 100)}) "
                                   f"runs {data['nlocal']} workers and node 0 runs {self.n}: "
                                   "every node must run as many", node=k)
            self.joined[k] = data
            self._maybe_run()
        elif kind == "ARRIVE":
            self._arrive(k, data)
        elif kind == "REPORT":
            self._metric(data["rank"], data["data"])
        elif kind == "FAIL":
            raise WorkerFailed(data["rank"], control.printable(data["reason"], 2000),
                               control.printable(data["details"]), node=k)
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
        if not gather:
            for q in range(1, self.nnodes):
                self._same(q * self.n, first, self.arrived[q], 0)
        values = [v for q in range(self.nnodes) for v in self.arrived[q]["values"]] \
            if gather else None
        self.arrived.clear()
        self.node_since = None
        release = dict(first, values=values)
        self.hub.broadcast("RELEASE", {"seq": release["seq"], "shared": release["shared"],
                                       "values": values})
        self._release(release)

    # ---------------------------------------------------------------- another node: node 0

    def _from_hub(self, kind, data, blobs):
        self.heard = time.monotonic()
        if kind == "START":
            self.started = True
            self._maybe_run()
        elif kind == "RELEASE":
            self._release(data)
        elif kind == "STOP":
            raise _NodeStopped(None, f"node 0 stopped the run: "
                               f"{control.printable(data['reason'], 2000)}")

    # ---------------------------------------------------------------- every poll

    # How long a rank's error is held, and how long a node's silence then says it is lost
    # (the heartbeats come every BEAT_S).
    HOLD_S, SILENT_S = 3.0, 2.5

    def _check(self, now):
        if self.hub is not None and now - self.beat_sent >= self.BEAT_S:
            self.hub.broadcast("HEARTBEAT")  # even while an error is held
            self.beat_sent = now
        if self.pending is not None:
            error, since = self.pending
            lost = self._lost(now, self.SILENT_S)
            if lost is not None:
                raise WorkerFailed(None, f"{lost}; then rank {error.rank} {error.reason}",
                                   error.details, node=error.node)
            if now - since > self.HOLD_S:
                raise error
            return  # its process's exit is this error's echo
        for local, p in enumerate(self.procs):
            if local not in self.results and p.exitcode is not None:
                # It may have exited before its last words (DONE, or its traceback) were
                # read: handle everything still queued before judging it.
                deadline = time.monotonic() + 0.2
                while time.monotonic() < deadline:
                    if self.coord.socket.poll(50):
                        self._drain_local()
                if local in self.results:
                    continue
                how = (f"was killed by signal {-p.exitcode}" if p.exitcode < 0
                       else f"exited with status {p.exitcode}")
                rank = self.offset + local
                error = WorkerFailed(rank, f"{how} (pid {p.pid})", node=self._node_of(rank))
                if self.nnodes == 1 or p.exitcode == -signal.SIGKILL:
                    raise error
                # Across nodes a worker's death may be the echo of another node's loss too
                # (JAX's runtime aborts a process whose peer vanished): held as an exception.
                # A SIGKILL is never such an echo.
                self.pending = (error, now)
                return
            if local not in self.results and now - self.last_beat[local] > self.heartbeat_timeout:
                rank = self.offset + local
                raise WorkerFailed(rank, f"sent nothing for {self.heartbeat_timeout:.0f} s "
                                   "(hung?)", node=self._node_of(rank))
        if self.since is not None and now - self.since > self.progress_timeout:
            # Heartbeats say a process lives, not that it gets anywhere.
            waiting = set(self.waiting) | set(self.registered)
            absent = min(r for r in range(self.n) if r not in waiting)
            what = ("returned" if absent in self.results else
                    f"reached no barrier in {self.progress_timeout:.0f} s")
            rank = self.offset + absent
            raise WorkerFailed(rank, f"{what} while rank(s) "
                               f"{sorted(self.offset + r for r in waiting)} waited at one "
                               "(hung, or out of step?)", node=self._node_of(rank))
        if self.hub is not None:
            self._check_nodes(now)
        if self.up is not None:
            self._check_node_0(now)

    def _lost(self, now, silent):
        """A node silent for ``silent`` seconds, in words, or None."""
        if self.hub is not None:
            for k in self.joined:
                if k not in self.finished and now - self.node_beat[k] > silent:
                    return (f"node {k} ({control.printable(self.joined[k]['host'], 100)}) "
                            f"stopped answering: its launcher is gone")
        elif self.up is not None and self.started and now - self.heard > silent:
            return f"node 0 at {self.up.address} stopped answering: its launcher is gone"
        return None

    def _check_nodes(self, now):
        missing = [k for k in range(1, self.nnodes) if k not in self.joined]
        if missing and now - self.t0 > self.join_timeout:
            raise WorkerFailed(None, f"node(s) {missing} did not join within "
                               f"{self.join_timeout:.0f} s at {self.hub.address} (started? "
                               "the same secret? a firewall?)", node=missing[0])
        lost = self._lost(now, self.node_timeout)
        if lost is not None:
            raise WorkerFailed(None, lost)
        if self.node_since is not None and now - self.node_since > self.progress_timeout:
            absent = min(k for k in range(self.nnodes) if k not in self.arrived)
            raise WorkerFailed(None, f"node {absent} reached no barrier in "
                               f"{self.progress_timeout:.0f} s while node(s) "
                               f"{sorted(self.arrived)} waited at one", node=absent)

    def _check_node_0(self, now):
        if self.up.secret_mismatch:  # its JOIN is gone all the same: node 0 logs it
            raise WorkerFailed(None, f"node 0 at {self.up.address} answers under another "
                               "secret: give every node the same PYMPGU_SECRET (or "
                               "--secret-file)", node=0)
        if not self.started and now - self.t0 > self.join_timeout:
            raise WorkerFailed(None, f"node 0 did not answer at {self.up.address} within "
                               f"{self.join_timeout:.0f} s (started? the same secret? a "
                               "firewall?)", node=0)
        lost = self._lost(now, self.node_timeout)
        if lost is not None:
            raise WorkerFailed(None, lost, node=0)


def _send_peers(coord, registered, offset=0):
    ranks = sorted(registered)
    layouts = {r: registered[r][0]["layout"] for r in ranks}
    for r in ranks[1:]:
        if layouts[r] != layouts[0]:
            raise WorkerFailed(offset + r, "registered a different parameter layout",
                               f"rank {offset}: {_describe(layouts[0])}\n"
                               f"rank {offset + r}: {_describe(layouts[r])}")
    facts = [registered[r][0]["facts"] for r in ranks]
    sms = [f.get("sm_count") for f in facts if f.get("sm_count")]
    payload = {"facts": facts, "max_blocks": min(2 * min(sms), 512) if sms else None}
    coord.broadcast("PEERS", payload, [registered[r][1] for r in ranks])


def _describe(layout):
    return ", ".join(f"{name} {tuple(shape)} {dtype}" for name, shape, dtype in layout)


def _reap(procs, grace):
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
