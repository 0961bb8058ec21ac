"""Training workers that kill themselves at a chosen moment (spawned children import them
from here), for the tests of training that goes on without a lost worker."""
import os
import signal


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _after(k, fn, when=lambda *a, **kw: True):
    """``fn`` that kills the process instead of its k-th call for which ``when`` holds (a
    negative k: after that call)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        if when(*args, **kwargs):
            calls[0] += 1
            if calls[0] == abs(k) and k > 0:
                _die()
        result = fn(*args, **kwargs)
        if when(*args, **kwargs) and calls[0] == abs(k) and k < 0:
            _die()
        return result
    return wrapped


def _hang_at(k, fn, time):
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            time.sleep(3600)
        return fn(*args, **kwargs)
    return wrapped


def dying_worker(ctx, cfg, faults, pid_dir, pace=0.0):
    """pympgu's training worker, whose rank (as numbered at the start) in ``faults`` kills
    itself: {rank: (phase, k)}. Phases: 'step' (computing its k-th step), 'exchange' (its
    k-th exchange, half done: its slice written into its peers, the second barrier not
    reached), 'epoch' (at the k-th epoch's barrier), 'checkpoint' (rank 0, its k-th
    checkpoint written but not yet in place), 'setup' (before its first exchange), 'build'
    (before the replicas' first barrier), 'welcome' (as a restarted worker joins); or
    'hang' (alive, at its k-th step for an hour). Each
    process leaves its pid in ``pid_dir``; the result carries the run's id. ``pace``:
    seconds of sleep before each step (a run long enough for a restarted worker to join)."""
    from pympgu.runtime.context import WorkerContext
    from pympgu.training import worker as worker_module
    from pympgu.training.outdir import OutDir
    from pympgu.training.replica import Replica
    with open(os.path.join(pid_dir, f"{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if pace:
        import time
        step = Replica.step

        def paced(*args, **kwargs):
            time.sleep(pace)
            return step(*args, **kwargs)
        Replica.step = paced
    fault = None if ctx.joining else faults.get(ctx.rank)  # a restarted one lives
    if fault is not None:
        phase, k = fault
        if phase == "step":
            Replica.step = _after(k, Replica.step)
        elif phase == "hang":  # alive, its heartbeats on, never at the next exchange
            import time
            Replica.step = _hang_at(k, Replica.step, time)
        elif phase == "exchange":
            # The second meet of an exchange: after this rank wrote its slice everywhere.
            WorkerContext.meet = _after(2 * k + 2, WorkerContext.meet)
        elif phase == "epoch":
            WorkerContext.barrier = _after(
                k, WorkerContext.barrier, lambda self, what=None, *a, **kw:
                bool(what) and what.startswith("replica"))
        elif phase == "checkpoint":
            from pympgu.training.checkpoint import CHECKPOINT
            written = [0]

            def write(self, name, data, _write=OutDir.write):
                if name == CHECKPOINT:
                    written[0] += 1
                    if written[0] == k:  # the whole file written, not yet in its place
                        return _write(self, name, lambda f: (data(f), f.flush(), _die()))
                return _write(self, name, data)
            OutDir.write = write
        elif phase == "setup":
            worker_module.make_exchanger = _after(1, worker_module.make_exchanger)
        elif phase == "welcome":  # while a restarted worker takes its state from the others
            from pympgu.training.loop import Training
            Training._welcome = _after(k, Training._welcome)
        elif phase == "build":  # its model built, before the replicas are compared
            Replica.digest = _after(1, Replica.digest)
    return {**worker_module.worker(ctx, cfg), "run_id": ctx.run_id}
