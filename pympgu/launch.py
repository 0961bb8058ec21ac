"""The launcher: one worker process per GPU (or CPU slot), run to completion or stopped cleanly.

``launch(target, args, gpus=[0, 1])`` starts one spawned process per rank, each calling
``target(ctx, *args)`` with a :class:`WorkerContext`, and coordinates them over ZMQ
(:mod:`pympgu.control`). It returns every rank's return value. If any rank raises, dies
(even by SIGKILL) or stops sending heartbeats, the others are told to stop, killed after a
grace period if they do not, every shared-memory segment of the run is unlinked, and
:class:`WorkerFailed` names the rank and carries its traceback. Ctrl-C does the same and
re-raises KeyboardInterrupt. No worker outlives the launcher: each one exits if its parent
disappears.
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
    """A rank raised, died or hung; ``rank`` is the first one that failed."""

    def __init__(self, rank, reason, details=""):
        self.rank, self.reason, self.details = rank, reason, details
        super().__init__(f"rank {rank} {reason}" + (f"\n{details}" if details else ""))


class WorkerContext:
    """What a worker knows of the run: its rank and device, and the way to the coordinator."""

    def __init__(self, rank, nranks, device, token, link):
        self.rank, self.nranks, self.device, self.token = rank, nranks, device, token
        self.link = link
        self._barrier_seq = 0

    @property
    def is_cpu(self):
        return self.device is None

    def barrier(self, what=None, value=None, shared=None):
        """A host barrier of every rank, through the coordinator. With ``what``, every rank
        must also hold the same ``value`` (a string): otherwise the run fails, naming the
        first rank whose ``what`` differs from rank 0's. Returns rank 0's ``shared`` (any
        JSON value; the other ranks' are ignored): what rank 0 alone decided, such as
        whether to stop."""
        self._barrier_seq += 1
        self.link.send("BARRIER", {"seq": self._barrier_seq, "what": what, "value": value,
                                   "shared": shared})
        data, _ = self.link.receive("RELEASE")
        return data.get("shared")

    def register(self, layout, facts, blob):
        """Announce this rank's buffer; returns every rank's (facts, blob) and max_blocks."""
        self.link.send("REGISTER", {"layout": layout, "facts": facts}, [blob])
        data, blobs = self.link.receive("PEERS")
        return data["facts"], blobs, data.get("max_blocks")

    def metric(self, **values):
        """Send metrics to the launcher, which prints or records them."""
        self.link.send("METRIC", values)


def _worker_main(rank, nranks, device, address, token, target, args):
    # Ctrl-C reaches the whole process group; the launcher alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    link = control.WorkerLink(address, token, rank)
    code = 0
    try:
        if device is not None:
            from . import cuda
            cuda.set_device(device)
        link.send("HELLO", {"version": control.PROTOCOL_VERSION, "pid": os.getpid(),
                            "device": device})
        link.receive("RUN")
        result = target(WorkerContext(rank, nranks, device, token, link), *args)
        link.send("DONE", {"result": result})
    except control.Stopped:
        code = 0
    except BaseException:
        link.send("ERROR", {"traceback": traceback.format_exc()})
        code = 1
    finally:
        link.close()
    sys.stdout.flush()
    os._exit(code)


def launch(target, args=(), *, gpus=None, cpu=None, host="127.0.0.1", port=None,
           on_metric=None, heartbeat_timeout=120.0, grace=3.0, log=None):
    """Run target(ctx, *args) on one process per GPU in gpus, or on cpu CPU workers."""
    if (gpus is None) == (cpu is None):
        raise ValueError("give exactly one of gpus= and cpu=")
    devices = list(gpus) if gpus is not None else [None] * int(cpu)
    nranks = len(devices)
    if not 1 <= nranks <= 8:
        raise ValueError(f"pympgu runs 1 to 8 workers, got {nranks}")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    coord = control.Coordinator(nranks, host=host, port=port, log=log)
    ctx = mp.get_context("spawn")
    procs = []
    try:
        for rank, device in enumerate(devices):
            p = ctx.Process(target=_worker_main, name=f"pympgu-rank{rank}", daemon=True,
                            args=(rank, nranks, device, coord.address, coord.token, target, args))
            p.start()
            procs.append(p)
        return _supervise(coord, procs, on_metric, heartbeat_timeout)
    except BaseException:
        coord.broadcast("STOP", {"reason": "the run is stopping"})
        raise
    finally:
        _reap(procs, grace)
        shm.unlink_run(coord.token)
        coord.close()


def _supervise(coord, procs, on_metric, heartbeat_timeout):
    n = len(procs)
    hello, registered, results, barrier_waiting = {}, {}, {}, {}
    last_beat = {r: time.monotonic() for r in range(n)}

    def handle(msg):
        rank, kind, data, blobs = msg
        last_beat[rank] = time.monotonic()
        if kind == "HELLO":
            hello[rank] = data
            if len(hello) == n:
                coord.broadcast("RUN")
        elif kind == "REGISTER":
            registered[rank] = (data, blobs[0] if blobs else b"")
            if len(registered) == n:
                _send_peers(coord, registered)
                registered.clear()
        elif kind == "BARRIER":
            barrier_waiting[rank] = data
            if len(barrier_waiting) == n:
                seqs = {r: d.get("seq") for r, d in barrier_waiting.items()}
                if len(set(seqs.values())) != 1:
                    raise WorkerFailed(min(barrier_waiting), "is out of step",
                                       f"barrier sequence numbers {seqs}")
                first = barrier_waiting[0]
                for r in range(1, n):
                    d = barrier_waiting[r]
                    if (d.get("what"), d.get("value")) != (first.get("what"), first.get("value")):
                        raise WorkerFailed(r, f"differs from rank 0 in its {first.get('what')}",
                                           f"rank 0: {first.get('value')}\n"
                                           f"rank {r}: {d.get('value')}")
                coord.broadcast("RELEASE", {"seq": first.get("seq"),
                                            "shared": first.get("shared")})
                barrier_waiting.clear()
        elif kind == "METRIC":
            if on_metric is not None:
                on_metric(rank, data)
        elif kind == "ERROR":
            raise WorkerFailed(rank, "raised an exception", data.get("traceback", ""))
        elif kind == "DONE":
            results[rank] = data.get("result")

    while len(results) < n:
        msg = coord.receive(100)
        if msg is not None:
            handle(msg)
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if rank not in results and p.exitcode is not None:
                # It may have exited before its last words (DONE, or its traceback) were
                # read: handle everything still queued before judging it.
                while (late := coord.receive(200)) is not None:
                    handle(late)
                if rank in results:
                    continue
                how = (f"was killed by signal {-p.exitcode}" if p.exitcode < 0
                       else f"exited with status {p.exitcode}")
                raise WorkerFailed(rank, f"{how} (pid {p.pid})")
            if rank not in results and now - last_beat[rank] > heartbeat_timeout:
                raise WorkerFailed(rank, f"sent nothing for {heartbeat_timeout:.0f} s (hung?)")
    return [results[r] for r in range(n)]


def _send_peers(coord, registered):
    ranks = sorted(registered)
    layouts = {r: registered[r][0]["layout"] for r in ranks}
    for r in ranks[1:]:
        if layouts[r] != layouts[0]:
            raise WorkerFailed(r, "registered a different parameter layout",
                               f"rank 0: {_describe(layouts[0])}\nrank {r}: {_describe(layouts[r])}")
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
