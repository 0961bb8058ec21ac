"""The launcher: one worker process per GPU (or CPU slot), run to completion or stopped cleanly.

``launch(target, args, gpus=[0, 1])`` starts one spawned process per rank, each calling
``target(ctx, *args)`` with a :class:`WorkerContext`, and coordinates them over ZMQ
(pympgu.runtime.control) through a socket in the run's private directory. It returns
every rank's return value. If any rank raises, dies (even by SIGKILL), stops sending
heartbeats, or leaves its peers waiting at a barrier for ``progress_timeout`` seconds, the
others are told to stop, killed after a grace period if they do not, every shared-memory
segment of the run is unlinked, and :class:`WorkerFailed` names the rank and carries its
traceback. Ctrl-C and SIGTERM do the same and raise KeyboardInterrupt (:class:`Terminated`
for SIGTERM). No worker outlives the launcher: each one exits if its parent disappears,
removing the shared memory it created and the run's directory.

With ``nodes`` (pympgu.runtime.nodes.Nodes) of several nodes, one launch runs on each node
and starts that node's workers; node 0's also listens for the others' at
``nodes.address``, authenticated by the run's shared ``secret``. Run-wide barriers wait for
every rank of every node; a failure anywhere stops every node within ``node_timeout``
seconds or so. Ranks are numbered node after node; node 0's launch returns every rank's
value, another node's its own ranks'.
"""
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback

from ..errors import SaidWhole
from . import control, protocol, rundir, shm
from .context import WorkerContext
from .coordinator import Alone, NodeCoordinator
from .failures import Terminated

# The most of a traceback a worker sends: the end, where the error is.
TRACEBACK_CHARS = 200_000


def _worker_main(place, device, address, secret, run_id, data_address, private, pipes,
                 target, args, joining=False, progress_timeout=600.0):
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group; the launcher alone
    # decides how to stop, and tells the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for fd, pipe in zip((1, 2), pipes):  # the launcher reads what this process writes
        os.dup2(pipe.fileno(), fd)
        pipe.close()
    sys.stdout.reconfigure(line_buffering=True)
    rundir.use_for_temporary_files(os.path.join(private, "tmp"))
    local_rank, local_nranks = place[2], place[3]

    def orphaned():  # the launcher is gone, killed outright: what it would remove, goes
        shm.unlink_created()
        rundir.remove(private)
    link = control.Link(address, secret, local_rank, local_nranks, on_orphaned=orphaned)
    code = 0
    try:
        if device is not None:
            from .. import cuda
            cuda.set_device(device)
        link.send("HELLO", {"version": protocol.PROTOCOL_VERSION, "pid": os.getpid(),
                            "device": device})
        run, _ = link.receive("RUN")
        # (joining a run under way: restarted in a lost worker's place, or on a node that
        # joins late)
        ctx = WorkerContext(place, device, run_id, link, data_address,
                            joining or run["joining"], progress_timeout,
                            os.path.join(private, "kept") if run["carry"] else None)
        result = target(ctx, *args)
        link.send("DONE", {"result": result})
    except control.Stopped:
        code = 0
    except control.Shrunk:
        # A peer was lost before the target could go back anywhere (before its training
        # loop): this rank says it holds nothing, and the launcher stops the run, saying so.
        try:
            link.send("RECOVER", {"kept": [], "at": None})
            link.receive("REFORM")
        except (control.Stopped, control.Shrunk):
            pass
        code = 0
    except BaseException as e:
        said = isinstance(e, SaidWhole)
        link.send("ERROR", {"message": str(e) if said else None,
                            "traceback": "" if said else
                            traceback.format_exc()[-TRACEBACK_CHARS:]})
        code = 1
    finally:
        link.close()
        shm.unlink_created()  # what a failure left open (closed segments are gone already)
    sys.stdout.flush()
    os._exit(code)


def launch(target, args=(), *, gpus=None, cpu=None, on_metric=None, heartbeat_timeout=120.0,
           progress_timeout=600.0, grace=3.0, log=None, nodes=None, secret=None,
           node_timeout=5.0, join_timeout=120.0, min_workers=None, restarts=0) -> list:
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
    nnodes = nodes.nnodes if nodes is not None else 1
    if min_workers is not None and min_workers < nlocal * nnodes and devices[0] is not None \
            and nnodes == 1:
        # (docs/DECISIONS.md, "A lost GPU worker takes its node with it")
        raise ValueError("min_workers below the workers goes on without a lost GPU worker "
                         "only across nodes (its node leaves the run, or with restarts "
                         "starts its workers again)")
    log = log or _logger().warning
    multi = nodes is not None and nodes.nnodes > 1
    if multi and not secret:
        raise ValueError("a run of several nodes needs their shared secret (secret=; "
                         "pympgu.runtime.nodes.read_secret)")
    ctx = mp.get_context("spawn")
    # The coordinator replaces a restarted worker's process and outputs in these lists,
    # and keeps the outputs it replaced in ``retired``.
    procs, outputs, retired, above, run_id = [], [], [], None, protocol.new_run_id()
    private = rundir.RunDir()
    listener = None
    # The secret reaches each worker through its spawn pipe: never argv, env or a file.
    with _sigterm_raises():
        try:
            listener = control.Listener(nlocal, private.control, log=log)
            above = _above(nodes, secret, nlocal, log, node_timeout, join_timeout,
                           progress_timeout, min_workers) if multi else Alone()
            nnodes, node = (nodes.nnodes, nodes.node_rank) if multi else (1, 0)
            # Node 0's host: host exchanges' data links listen on the interface toward it.
            data_address = nodes.host if multi else None

            def start(r, joining=False):
                """Start the worker of local rank ``r`` (again, for a restart)."""
                place = (node * nlocal + r, nnodes * nlocal, r, nlocal, node, nnodes)
                streams = [ctx.Pipe(duplex=False) for _ in range(2)]
                p = ctx.Process(target=_worker_main, name=f"pympgu-rank{place[0]}",
                                daemon=True,
                                args=(place, devices[r], listener.address, listener.secret,
                                      run_id, data_address, private.path,
                                      [w for _, w in streams], target, args, joining,
                                      progress_timeout))
                p.start()
                return p, _outputs(place[0], streams)

            for r in range(nlocal):
                p, outs = start(r)
                procs.append(p)
                outputs.append(outs)
            return NodeCoordinator(listener, procs, outputs, node, nnodes, above, on_metric,
                                   log, heartbeat_timeout, progress_timeout,
                                   min_workers,
                                   (start, restarts, retired, devices[0] is not None)).run()
        except BaseException as e:
            if listener is not None:
                listener.broadcast("STOP", {"reason": "the run is stopping"})
            if above is not None:
                above.stop(e)
            raise
        finally:
            _reap(procs, grace)
            for outs in outputs + [retired]:
                for out in outs:
                    out.read()
                    out.close()
            shm.unlink_run(run_id, log)
            for end in (listener, above):
                if end is not None:
                    end.close()
            private.remove()


def _logger():
    from ..log import log
    return log


def _outputs(rank, streams):
    """The launcher's ends of a worker's stdout and stderr (their other ends are the
    worker's now, and closed here)."""
    from .output import Output
    outs = []
    for name, (reader, writer) in zip(("stdout", "stderr"), streams):
        writer.close()
        outs.append(Output(rank, name, os.dup(reader.fileno())))
        reader.close()
    return outs


def _above(nodes, secret, nlocal, log, node_timeout, join_timeout, progress_timeout,
           min_workers):
    """The level above this node's coordinator in a run of several nodes."""
    if nodes.node_rank == 0:
        from .hub import Hub
        return Hub(nodes.nnodes, f"tcp://{_bind_host(nodes)}:{nodes.port}", secret, log,
                   node_timeout, join_timeout, progress_timeout, min_workers)
    from .uplink import Uplink
    return Uplink(nodes.address, secret, nodes.node_rank, nodes.nnodes, nlocal,
                  node_timeout, join_timeout)


def _bind_host(nodes):
    """Node 0 listens on loopback when every node is on this host, else on every interface."""
    return "127.0.0.1" if nodes.loopback else "*"


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


def _reap(procs, grace):
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
