"""Worker functions for the runtime tests (spawned children import them from here)."""
import glob
import hashlib
import os
import signal
import time

import numpy as np

from reference import model_average, model_wire_exchanges

LAYOUT = [("w1", [31, 17], "float32"), ("b1", [17], "float32"), ("w2", [17, 5], "float32"),
          ("b2", [5], "float32")]


def shm_left(run_id):
    """What run ``run_id`` has in /dev/shm."""
    return glob.glob(f"/dev/shm/pympgu-{run_id}-*")


def check_bits(got, wanted, layout, where):
    """Raise, naming ``where`` and the first wrong elements, unless every array of ``got``
    equals its model in ``wanted`` bit for bit."""
    for t, (a, want) in enumerate(zip(got, wanted)):
        a = np.asarray(a)
        if not np.array_equal(a, want):
            wrong = np.flatnonzero(a.ravel() != want.ravel())
            raise AssertionError(
                f"{where} tensor {layout[t][0]} is wrong at {wrong.size} of {want.size} "
                f"elements, from {wrong[0]}: got {a.ravel()[wrong[:3]]}, want "
                f"{want.ravel()[wrong[:3]]}")


def rank_params(rank, round_, layout=LAYOUT):
    rng = np.random.default_rng([rank, round_])
    return [rng.standard_normal(shape).astype(dtype) for _, shape, dtype in layout]


def average_rounds(ctx, rounds, pid_dir=None, fail=None, layout=None, flat=False, pace=0.0):
    """Exchange `rounds` times; check each result against the exact model; digest the last.

    fail = (rank, round, how) makes that rank 'raise', 'kill' itself or 'hang' at that round.
    flat=True hands the Exchanger one packed array (start(flat=True)), as JAX workers do.
    pace: seconds of sleep before each round (a run that lasts).
    """
    if pid_dir:
        open(os.path.join(pid_dir, f"{ctx.rank}.pid"), "w").write(str(os.getpid()))
        open(os.path.join(pid_dir, "run_id"), "w").write(ctx.run_id)
    try:
        return _rounds(ctx, rounds, fail, layout, flat, pace)
    except BaseException as e:
        from pympgu.runtime import control
        if pid_dir and isinstance(e, control.Stopped):  # told to stop, not killed
            open(os.path.join(pid_dir, f"{ctx.rank}.stopped"), "w").close()
        raise


def _rounds(ctx, rounds, fail, layout, flat, pace):
    from pympgu.exchange import Exchanger
    layout = layout or LAYOUT
    if layout == "mismatch":
        layout = LAYOUT[:-1] + [("b2", [6] if ctx.rank == 1 else [5], "float32")]
    with Exchanger(ctx, layout) as ex:
        if ctx.nranks > 1:  # every rank has mapped this rank's segment: its name is gone
            from pympgu.runtime import shm
            assert not glob.glob(f"/dev/shm/{shm.segment_name(ctx.run_id, ctx.rank)}-*")
        digest = None
        for k in range(rounds):
            if fail and fail[0] == ctx.rank and fail[1] == k:
                if fail[2] == "raise":
                    raise ValueError(f"boom at round {k}")
                if fail[2] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fail[2] == "hang":
                    time.sleep(3600)
            time.sleep(pace)
            mine = rank_params(ctx.rank, k, layout)
            if flat:
                packed = np.zeros(ex.total, np.float32)
                for a, off in zip(mine, ex.offsets):
                    packed[off:off + a.size] = a.ravel()
                ex.start(packed, flat=True)
                out = ex.finish()
            else:
                out = ex.average_arrays(mine)
            for t, got in enumerate(out):
                expected = model_average(
                    [rank_params(r, k, layout)[t].ravel() for r in range(ctx.nranks)], "float32")
                if not np.array_equal(got.ravel(), expected):
                    raise AssertionError(f"rank {ctx.rank} round {k} tensor {t} is wrong")
            digest = hashlib.sha256(b"".join(a.tobytes() for a in out)).hexdigest()
            ctx.metric(round=k)
        return {"digest": digest, "stats": ex.stats, "run_id": ctx.run_id}


def attack_then_average(ctx, rounds):
    """Rank 0 first throws junk at the coordinator's socket: raw bytes, a forged HELLO, a
    truncated message and a payload that is not JSON; then everyone exchanges as usual."""
    import socket
    import time

    import zmq
    if ctx.rank == 0:
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(ctx.link.address.removeprefix("ipc://"))
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(256))
        zctx = zmq.Context()
        d = zctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 1000)
        d.connect(ctx.link.address)
        d.send_multipart([b"HELLO 1 1", b"{}", b"x" * 32])  # no secret: a wrong MAC
        d.send_multipart([b"x"])
        d.send_multipart([b"METRIC 0 5", b"{not json", b"", b"y" * 32])
        time.sleep(0.2)
        d.close()
        zctx.term()
    return average_rounds(ctx, rounds)


def average_rounds_gpu(ctx, rounds):
    """GPU workers: parameters as torch CUDA tensors, exchanged through the runtime."""
    import torch

    from pympgu.exchange import Exchanger
    torch.cuda.set_device(ctx.device)
    with Exchanger(ctx, LAYOUT) as ex:
        # Every rank has mapped this rank's stream barrier flags: their name is gone.
        assert not glob.glob(f"/dev/shm/pympgu-{ctx.run_id}-{ctx.rank}-*")
        digest = None
        for k in range(rounds):
            mine = [torch.from_numpy(a).cuda() for a in rank_params(ctx.rank, k)]
            out = [v.copy_to_host() for v in ex.average_arrays(mine)]
            for t, got in enumerate(out):
                expected = model_average(
                    [rank_params(r, k)[t].ravel() for r in range(ctx.nranks)], "float32")
                if not np.array_equal(got.ravel(), expected):
                    raise AssertionError(f"rank {ctx.rank} round {k} tensor {t} is wrong")
            digest = hashlib.sha256(b"".join(a.tobytes() for a in out)).hexdigest()
        return {"digest": digest, "stats": ex.stats}


def wire_rounds(ctx, rounds, wire, overlap=False):
    """Exchange over a low-precision wire (CPU arrays, or torch CUDA tensors on GPU workers);
    check every result bit for bit against the reference model. With overlap the caller
    computes between start() and finish(), as the training loop's --overlap does."""
    from pympgu.exchange import Exchanger
    torch = None
    if not ctx.is_cpu:
        import torch
        torch.cuda.set_device(ctx.device)

    def inputs(rank, k):  # drifting parameters: round k is round 0 plus small steps
        base = rank_params(0, 0)
        return [b + np.float32(0.01 * (k + 1)) * d
                for b, d in zip(base, rank_params(rank, k + 1))]

    with Exchanger(ctx, LAYOUT, wire_dtype=wire) as ex:
        for k in range(rounds):
            mine = inputs(ctx.rank, k)
            if torch is not None:
                mine = [torch.from_numpy(a).cuda() for a in mine]
            ex.start(mine)
            if overlap:
                busy = float(np.sum(np.arange(10000.0)))  # host work while the average runs
                assert busy > 0
            out = ex.finish()
            if torch is not None:
                out = [v.copy_to_host() for v in out]
            for t, got in enumerate(out):
                model = model_wire_exchanges(
                    [[inputs(r, j)[t].ravel() for r in range(ctx.nranks)] for j in range(k + 1)],
                    wire)[-1]
                if not np.array_equal(got.ravel(), model):
                    raise AssertionError(f"rank {ctx.rank} round {k} tensor {t} differs from "
                                         f"the wire model")
                exact = model_average([inputs(r, k)[t].ravel() for r in range(ctx.nranks)],
                                      "float32")
                err = np.max(np.abs(got.ravel() - exact)) if k else 0.0
                if err > 0.01 * 2 ** -7 * 10:  # a wire rounding of a ~0.01 change, with margin
                    raise AssertionError(f"rank {ctx.rank} round {k}: {err} from the exact mean")
        return {"stats": ex.stats, "digest": hashlib.sha256(
            b"".join(np.asarray(a).tobytes() for a in out)).hexdigest()}


def part_rounds(ctx, rounds, wire=None, flat=False):
    """Exchanges of parts of a layout (Exchanger.start's ``entries``), as --overlap
    --sync-every K sends a model's momentum and its parameters at successive steps: the
    layout is parameters, then momentum of the same shapes. Round 0 sends everything, then
    the momentum, the parameters and everything in turn. Every result is checked bit for
    bit against the model: over a low-precision wire each entry keeps its own reference,
    moved only by the exchanges that send it. flat=True packs each part into one array
    (the part's count of elements), as JAX workers do. CPU arrays, or torch CUDA tensors on
    GPU workers."""
    from pympgu.exchange import Exchanger
    torch = None
    if not ctx.is_cpu:
        import torch
        torch.cuda.set_device(ctx.device)
    layout = LAYOUT + [("v_" + name, shape, dtype) for name, shape, dtype in LAYOUT]
    n, k = len(layout), len(LAYOUT)
    parts = [(0, n), (k, n), (0, k)]

    def inputs(rank, j):  # drifting values, as in wire_rounds
        base = rank_params(0, 0, layout)
        return [b + np.float32(0.01 * (j + 1)) * d
                for b, d in zip(base, rank_params(rank, j + 1, layout))]

    sent = {t: [] for t in range(n)}  # per entry: every rank's values at each exchange of it
    with Exchanger(ctx, layout, wire_dtype=wire) as ex:
        for j in range(rounds):
            lo, hi = parts[j % 3] if j else (0, n)
            mine = inputs(ctx.rank, j)[lo:hi]
            for t in range(lo, hi):
                sent[t].append([inputs(r, j)[t].ravel() for r in range(ctx.nranks)])
            if flat:
                packed = np.zeros(ex.part(lo, hi), np.float32)
                for a, off in zip(mine, ex.offsets):
                    packed[off:off + a.size] = a.ravel()
                mine = packed
            if torch is not None:
                mine = (torch.from_numpy(mine).cuda() if flat else
                        [torch.from_numpy(a).cuda() for a in mine])
            ex.start(mine, flat=flat, entries=(lo, hi))
            out = ex.finish(flat=flat)
            if flat:
                out = [out]
            out = [np.asarray(v.copy_to_host() if torch is not None else v) for v in out]
            if flat:
                out = [out[0][off:off + size] for off, size in zip(ex.offsets, ex.sizes[lo:hi])]
            assert len(out) == hi - lo
            for t, got in zip(range(lo, hi), out):
                if wire:
                    model = model_wire_exchanges(sent[t], wire)[-1]
                else:
                    model = model_average(sent[t][-1], "float32")
                if not np.array_equal(got.ravel(), model):
                    raise AssertionError(f"rank {ctx.rank} round {j} entries {lo}-{hi}: "
                                         f"{layout[t][0]} differs from the model")
        return {"stats": ex.stats, "digest": hashlib.sha256(
            b"".join(np.asarray(a).tobytes() for a in out)).hexdigest()}


def jax_rounds(ctx, rounds, big=1 << 23):
    """GPU workers with JAX arrays, as the training loop runs them: every round computes new
    arrays from the last result, starts the exchange, and imports the result through
    DLPack without any host wait (finish(wait=False)). A large tensor keeps the kernel busy
    long enough that a missing stream handshake would let JAX read a stale buffer; every
    round is checked bit for bit against the model."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from pympgu.exchange import Exchanger
    dev = jax.devices("gpu")[ctx.device]
    layout = LAYOUT + [("big", [big], "float32")]
    start = [jax.device_put(a, dev) for a in rank_params(0, 0, layout)]  # one start for all

    def shift(rank, k):  # exactly representable: x + c rounds alike in JAX and numpy
        return np.float32(0.25 * rank + 0.125 * k)

    step = jax.jit(lambda xs, c: [x + c for x in xs])
    with Exchanger(ctx, layout) as ex:
        offsets = list(zip(ex.offsets, ex.sizes, [s for _, s, _ in layout]))
        split = jax.jit(lambda flat: [flat[o:o + n].reshape(s) for o, n, s in offsets])
        xs, model = start, [np.asarray(a) for a in start]
        for k in range(rounds):
            xs = step(xs, shift(ctx.rank, k))
            ex.start(xs)
            xs = split(jax.dlpack.from_dlpack(ex.finish(flat=True, wait=False)))
            model = [model_average([(m + shift(r, k)).ravel() for r in range(ctx.nranks)],
                                   "float32").reshape(m.shape) for m in model]
            for t, (got, want) in enumerate(zip(xs, model)):
                if not np.array_equal(np.asarray(got), want):
                    raise AssertionError(f"rank {ctx.rank} round {k} tensor {layout[t][0]} "
                                         "is not the average: read before the kernel ended?")
        digest = hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in xs)).hexdigest()
        return {"digest": digest, "stats": ex.stats}


def late_peer(ctx, timeout=2.0):
    """Rank 1 never exchanges. Rank 0's exchange inside XLA waits at its stream barrier
    until the group's watchdog lets it go on, after ``timeout`` seconds (the exchange ends
    without rank 1's values), and rank 0's next exchange fails, naming rank 1. Both ranks
    keep their groups open until rank 0 is done: rank 0 still writes into rank 1's. Each
    rank also says whether its flags page's name was in /dev/shm while the group was open
    (every rank has mapped it by then), and after close."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from pympgu.exchange import Exchanger
    from pympgu.xla import StepExchange
    ex = Exchanger(ctx, [("w", [4096], "float32")], timeout=timeout, shadow=True)
    inside = StepExchange(ex)
    try:
        page = os.path.join("/dev/shm", ex.backend.group.flags_name)
        result = {"page_while_open": os.path.exists(page)}
        if ctx.rank == 0:
            x = [jax.device_put(np.ones(4096, np.float32), jax.devices("gpu")[ctx.device])]
            step = jax.jit(lambda xs: inside.average_during(xs, lambda y: y * 2, xs[0]))
            t0 = time.monotonic()
            jax.block_until_ready(step(x))
            result["held_s"] = time.monotonic() - t0
            try:
                jax.block_until_ready(step(x))
            except Exception as e:  # JAX's own error type, carrying pympgu's message
                result["error"] = str(e)
        ctx.barrier()
    finally:
        ex.close()
    result["page_after_close"] = os.path.exists(page)  # its creator unlinks it
    return result


def shared_rounds(ctx, rounds):
    """Barriers at which every rank offers its own value: each returns rank 0's."""
    return [ctx.barrier(shared={"rank": ctx.rank, "round": k}) for k in range(rounds)]


def hold_segment(ctx, pid_dir, hold_s, unlink=False):
    """Make this rank's shared-memory segment as the host exchange does, unlink its name
    (with ``unlink``), write <rank>.pid and <rank>.ready in pid_dir, and hold the segment
    hold_s seconds; returns its name, mode and owner."""
    from pympgu.runtime import shm
    open(os.path.join(pid_dir, f"{ctx.rank}.pid"), "w").write(str(os.getpid()))
    open(os.path.join(pid_dir, "run_id"), "w").write(ctx.run_id)
    seg = shm.Segment(shm.new_name(shm.segment_name(ctx.run_id, ctx.rank)), 4096, create=True)
    st = os.stat(seg.path)
    if unlink:
        seg.unlink()
    open(os.path.join(pid_dir, f"{ctx.rank}.ready"), "w").close()
    time.sleep(hold_s)
    seg.close()
    return {"rank": ctx.rank, "name": seg.name, "mode": st.st_mode, "uid": st.st_uid}


def squat(paths):
    """Another user's entries at ``paths``: a directory, a file, a fifo, a link, in turn."""
    for k, path in enumerate(paths):
        [os.mkdir, lambda p: open(p, "w").close(), os.mkfifo,
         lambda p: os.symlink("/etc/passwd", p)][k % 4](path)


def average_then_squat(ctx, rounds):
    """Every rank exchanges, then rank 0 has another user squat names of the run in
    /dev/shm before the launcher cleans up; returns the squatted paths."""
    from processes import as_nobody
    average_rounds(ctx, rounds)
    paths = [f"/dev/shm/pympgu-{ctx.run_id}-{r}-squat{k}" for r in range(ctx.nranks)
             for k in range(4)]
    if ctx.rank == 0:
        as_nobody(squat, paths)
    return paths


def results_outlive(ctx, rounds):
    """Each round's result checked again after the next round, and the last one after the
    Exchanger closed: results are views of the rank's buffers, taken in turn."""
    from pympgu.exchange import Exchanger

    def model(k):
        return [model_average([rank_params(r, k)[t].ravel() for r in range(ctx.nranks)],
                              "float32") for t in range(len(LAYOUT))]

    previous = None
    with Exchanger(ctx, LAYOUT) as ex:
        for k in range(rounds):
            out = ex.average_arrays(rank_params(ctx.rank, k))
            check_bits([a.ravel() for a in out], model(k), LAYOUT, f"rank {ctx.rank} round {k}")
            if previous is not None:
                check_bits([a.ravel() for a in previous], model(k - 1), LAYOUT,
                           f"rank {ctx.rank} round {k - 1}, after round {k}")
            previous = out
    check_bits([a.ravel() for a in previous], model(rounds - 1), LAYOUT,
               f"rank {ctx.rank} the last round, after close")
    return ctx.run_id
