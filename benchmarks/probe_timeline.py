"""Where an exchange inside the step's XLA call spends its time, point by point, on the GPU.

    PYTHONPATH=. python benchmarks/probe_timeline.py --gpus 0 1 [--hidden 4096 4096]
                                                    [--barrier side xla]
                                                    [--cycles mp.. m.p. ...] [--only-cycles]

The GPU machine has no profiler, so the exchange marks its own points with CUDA events
(PYMPGU_XLA_TIMELINE=1, PeerGroup.xla_timeline). Each rank builds the training loop's
replica and Exchanger (with its shared shadow, as pympgu.train does) and runs these steps:
'exact' (the parameters averaged after the step; from 16 MiB the step is cut, so that the
last layers leave while the first layer's gradient is computed); 'gradients' (cut the same
way, the gradients cross and XLA's update reads their mean; done: the first part's wait,
averaged: the last part's); 'overlap' (the parameters
the step starts from averaged while it computes, and the correction applied inside XLA's
own update); 'pass' (the same, with pympgu's pass applying it); 'momentum' (as 'overlap',
for the momentum, as the due step of --overlap --sync-every K > 1 does; the next step sends
the parameters); 'state' (the whole state at once, twice the bytes). After each step it
reads the marks, which waits for that step, so steps do not overlap one another. It prints,
per rank, the median of each point in ms after the (first) start:

  side_begin   the copies may begin (after the first GPU barrier)
  first_sent   the first part's copies have ended
  last_start   XLA reached the last part (the end of phase 2 when cut)
  first_landed every rank's first part is in (a barrier after last_start), and XLA may
               average those arrays while the last part crosses
  last_sent    the last part's copies have ended
  landed       the last GPU barrier: every rank's copies are in
  done         XLA reached the (first) done operation (its work beside the exchange has
               ended); 'overlap': the wait before XLA's update
  averaged     the average (and the correction) is written: all of it; 'overlap': XLA's
               stream passed the wait

and the plain step alone, back to back, for scale; then the plain step beside DMA copies
from the peers (no barrier; --dma: the whole buffer before every step by default, or so
many MB, so many copies of them, before one step in so many; or, with no copy, a
one-element kernel of pympgu's on the same stream), and those copies alone: what the
link's traffic alone costs XLA's compute, per byte or per copy, or any work on a second
stream. Last, each step back to back, and again with the exchange's operations replaced by
a pass of XLA's own over the same arrays (not averaged): what the program's shape costs
without the link; and sequences of steps (--cycles; by default --overlap --sync-every 4's
four, 'mp..'), both ways, and twice more between: 'hollow' (every operation of the
exchange, its barriers and XLA's wait, but each start sends its smallest array alone)
and 'unwaited' (hollow, without XLA's wait; it timed as the dry program to the
microsecond, as if XLA dropped the start that nothing waits for). A cycle timed right
after 'mp..' ran about 0.01 ms a step slower than the same cycle timed first
(docs/BENCHMARKS.md, session 21): compare cycles timed in the same order. It runs once per
--barrier value (PYMPGU_PUSH_BARRIER: the first barrier on the side stream, or on XLA's).
The distance from start to side_begin is what the copies wait before they can run.

For each cycle with an exchange it also prints the marks of its last exchange, the median
over bursts of cycles queued back to back (not yet run on a GPU). Beside the cycles it
prints each GPU's mean SM clock (pympgu.clocks) while they ran. After a
few seconds of this probe the H200s spend most samples held below 1980 MHz for power, and
the plain step, timed first, ran at 1980: a sum of rows timed at different clocks does not
predict a cycle (docs/BENCHMARKS.md, session 13).
"""
import os
import time

from probe_common import parser, replica_config


# The steps timed: name, overlapped, whether XLA's update applies the correction
# (PYMPGU_FUSED_CORRECTION; pympgu.xla.correct_during's shadow) or pympgu's pass does, what
# is averaged (pympgu.train.Replica.part): the parameters (--sync-every 1), the momentum
# (the due step of --overlap --sync-every K > 1), or the whole state (twice the bytes: what
# that due step sent until session 12); and whether the update takes the mean gradients
# instead ('gradients', what --sync-every 1 does since session 18; xla.average_gradients).
STEPS = (("exact", False, "1", "params", False), ("gradients", False, "1", "params", True),
         ("overlap", True, "1", "params", False), ("pass", True, "0", "params", False),
         ("momentum", True, "1", "momentum", False), ("state", True, "1", "state", False))


# Sequences of steps timed back to back as one call (--cycles), a letter a step: the part
# it averages while it computes (m: momentum, p: parameters, s: the whole state; a, b: the
# first layer's momentum or parameters alone), or '.' for a plain step (not '-', which
# argparse would take for a flag). The first layer's letters send fewer bytes in as many
# exchanges: what the cycle pays per byte, against what it pays per exchange. 'mp..' is
# --overlap --sync-every 4 (pympgu.train.Sync); 'm.p.' has its two exchanges a step apart.
# Others isolate what the cycle pays over its steps timed alone: '....' and 'pppp' go
# through Replica.step as the cycle does; 'p.' and 'm.' change between an overlapped step
# and a plain one, each way, once per exchange.
PARTS = {"m": "momentum", "p": "params", "s": "state", "a": "first momentum",
         "b": "first params", ".": None}
CYCLES = ("mp..", "m.p.")
# Each cycle's marks: the median of BURSTS bursts of BURST cycles queued back to back.
BURSTS, BURST = 9, 30


def worker(ctx, hidden, batch, steps, hlo_dir=None, cycles=CYCLES, only_cycles=False,
           only=None, dma=((None, 1, 1),)):
    from pympgu.train import Replica, _setup_backend, make_exchanger
    _setup_backend(ctx, "jax")  # before PyTensor is imported
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pympgu import CudaError, cuda
    from pympgu.clocks import Clocks
    cfg = replica_config(hidden, batch)
    rep = Replica(ctx, cfg)
    whole = rep.part
    # A layer: its weight and bias. The Exchanger's layout starts with the parameters, whose
    # first layer has the shapes of the momentum's.
    k = len(rep.model.params)
    layers = {"first momentum": (k, k + 2), "first params": (0, 2)}
    rep.part = lambda name: layers[name] if name in layers else whole(name)
    ex = make_exchanger(ctx, rep, cfg)
    try:
        group = ex.backend.group
        idx = jax.device_put(np.arange(batch, dtype=np.int32))

        issued = {}  # the last back_to_back's host time and clock

        def back_to_back(step, beside=None):
            """ms a step, issued back to back after 5 to warm up; ``beside()`` is queued
            before each."""
            for _ in range(5):
                step(idx)
            rep.wait()
            ctx.barrier()
            with Clocks(ctx.device) as clocks:
                t0 = time.perf_counter()
                for _ in range(steps):
                    if beside is not None:
                        beside()
                    step(idx)
                # How long the host took to queue them: as long as the GPU only if the host
                # paced it (on the wide MLP it finished about 30 steps ahead of the GPU:
                # something holds it there, so this time says little about its own pace).
                issued["ms"] = 1e3 * (time.perf_counter() - t0) / steps
                rep.wait()
                group.stream.synchronize()
                ms = 1e3 * (time.perf_counter() - t0) / steps
            issued["mhz"], issued["capped"] = clocks.mhz, clocks.capped
            return ms

        def dump(name, step):
            # The program XLA runs, to see how it fused the step (--hlo; rank 0's).
            if hlo_dir and ctx.rank == 0:
                with open(os.path.join(hlo_dir, name + ".hlo.txt"), "w") as f:
                    f.write(step.jitted.lower(*step.arguments(idx)).compile().as_text())

        plain = rep.jax_step()
        dump("plain", plain)
        out = {"plain_ms": back_to_back(plain)}
        out["plain_clock"] = issued["mhz"], issued["capped"]
        # The same steps while every rank's copy engines pull from the peers into its shadow
        # (--dma: so many MB, or their whole buffers, so many times over, before one step in
        # every so many), with no barrier on the GPU: what DMA traffic alone costs XLA's
        # compute, and whether it is paid per byte or per copy (the same bytes in more
        # copies; or a copy of 4 bytes, which costs the host as much as any). 'kernel'
        # queues a one-element kernel of pympgu's on the same stream in place of the copies:
        # whether any work on a second stream costs the step, or DMA only. Then the pulls
        # alone, and the host's time to queue them.
        one = cuda.DeviceBuffer(8, ctx.device)
        a_one, b_one = one.view("float32", 1), one.view("float32", 1, offset=4)
        out["dma"] = []
        for mb, copies, every in dma:
            n = group.nbytes // 4 if mb in (None, "kernel") else \
                max(1, min(group.nbytes // 4, int(mb * 1e6) // 4))

            def queue_pull():
                for _ in range(copies):
                    if mb == "kernel":
                        cuda.average([a_one], out=b_one, stream=group.stream, synchronize=False)
                    else:
                        group.gather(n, synchronize=False)

            queued = [0]

            def pull():
                if queued[0] % every == 0:
                    queue_pull()
                queued[0] += 1

            beside = back_to_back(plain, pull)
            ctx.barrier()
            pulls = max(1, steps // every)
            t0 = time.perf_counter()
            for _ in range(pulls):
                queue_pull()
            t_queued = time.perf_counter()
            group.stream.synchronize()
            t_done = time.perf_counter()
            out["dma"].append(("kernel" if mb == "kernel" else 4 * n / 1e6, copies, every,
                               beside, 1e3 * (t_done - t0) / pulls,
                               1e3 * (t_queued - t0) / pulls))
            ctx.barrier()  # no rank's exchange below lands in a shadow a peer copies into

        def build(overlap, fused, part, gradients):
            # PYMPGU_FUSED_CORRECTION is read when a step is built (Exchanger.xla_shadow).
            os.environ["PYMPGU_FUSED_CORRECTION"] = fused
            rep._steps.clear()
            return rep.jax_step(ex, part, overlap, gradients)

        steps_timed = [s for s in STEPS if only is None or s[0] in only]

        def cycle(letters):
            # A sequence of CYCLES, timed as one call, ms a step. rep.step builds the steps
            # anew, with the correction in XLA's update.
            os.environ["PYMPGU_FUSED_CORRECTION"] = "1"
            rep._steps.clear()
            parts = [PARTS[c] for c in letters]

            def run(idx):
                for part in parts:
                    rep.step(idx, *((ex, part, True) if part else ()))
            return run

        for letters in cycles:
            run = cycle(letters)
            out["cycle " + letters] = back_to_back(run) / len(letters)
            out["host " + letters] = issued["ms"] / len(letters)
            out["clock " + letters] = issued["mhz"], issued["capped"]
            if set(letters) != {"."}:
                # The marks of the last exchange of BURST cycles queued back to back: the
                # ranks as the cycle leaves them, not as their hosts start them (session 13
                # read them after every cycle, and saw the hosts' skew). The early rank's
                # first barrier waits for the late one: their skew is its side_begin.
                seen = []
                for _ in range(BURSTS):
                    for _ in range(BURST):
                        run(idx)
                    seen.append(group.xla_timeline())
                out["marks " + letters] = {k: float(np.median([s[k] for s in seen]))
                                           for k in seen[0]}
        for name, *how in () if only_cycles else steps_timed:
            step = build(*how)
            dump(name, step)
            for _ in range(5):
                step(idx)
            rep.wait()
            ctx.barrier()
            seen = []
            try:
                for _ in range(steps):
                    step(idx)
                    seen.append(group.xla_timeline())
            except CudaError:
                # A mark never recorded: an exchange under PYMPGU_SPLIT_MIN_BYTES runs as one
                # operation, not through the start/done pair.
                out[name] = None
                continue
            out[name] = {k: float(np.median([s[k] for s in seen])) for k in seen[0]}
            out[name + "_ms"] = back_to_back(step)
        # The cycles again with each start sending its smallest array alone: every operation,
        # barrier and wait of the exchange, but almost no bytes (the averages are wrong).
        from pympgu import xla
        real_start = xla._start

        def hollow(arrays, attrs, phase, offsets=None, after=None):
            at = attrs["offsets"] if offsets is None else offsets
            k = min(range(len(arrays)), key=lambda i: arrays[i].size)
            return real_start([arrays[k]], dict(attrs, offsets=np.asarray([at[k]], np.int64)),
                              phase, after=after)

        xla._start = hollow
        for letters in cycles:
            out["hollow cycle " + letters] = back_to_back(cycle(letters)) / len(letters)
        # And without XLA's wait for the exchange's end. On H200s this timed as the dry
        # program to the microsecond (session 21): XLA seems to drop the start as well, whose
        # token nothing then waits for, so it does not time the wait alone.
        real_wait = xla._wait
        xla._wait = lambda token, after, attrs, k, **kw: after[k]
        for letters in cycles:
            out["unwaited cycle " + letters] = back_to_back(cycle(letters)) / len(letters)
        xla._start, xla._wait = real_start, real_wait
        # The same programs with the exchange's operations replaced by a pass of XLA's own
        # over the same arrays (no link, no side stream, no kernel of pympgu's; the results
        # are not averaged): what the program's shape alone costs, its optimization barriers
        # and the arrays kept alive until the done.
        xla._start = lambda arrays, attrs, phase, offsets=None, after=None: (
            jnp.zeros((), jnp.uint32) if after is None else after + 1)
        xla._done = lambda token, arrays, attrs, fresh=None, **kw: [
            (f if fresh is not None else a) + 0 * a
            for f, a in zip(fresh if fresh is not None else arrays, arrays)]
        xla._wait = lambda token, after, attrs, k, **kw: after[k]
        for name, *how in () if only_cycles else steps_timed:
            step = build(*how)
            dump(name + "_dry", step)
            out[name + "_dry_ms"] = back_to_back(step)
        for letters in cycles:
            out["dry cycle " + letters] = back_to_back(cycle(letters)) / len(letters)
        return out
    finally:
        ex.close()


def _dma_spec(spec):
    """--dma's WHAT[xCOUNT][:EVERY] as (MB, None for the whole buffer, or "kernel"; COUNT;
    EVERY)."""
    import argparse
    head, _, every = spec.partition(":")
    what, _, count = head.partition("x")
    try:
        size = what if what == "kernel" else None if what == "all" else float(what)
        copies, period = int(count or 1), int(every or 1)
    except ValueError:
        size, copies, period = 0, 0, 0
    if size not in (None, "kernel") and size <= 0 or copies < 1 or period < 1:
        raise argparse.ArgumentTypeError(
            f"{spec!r} is not WHAT[xCOUNT][:EVERY] (WHAT a positive number of MB, 'all' or "
            "'kernel'; COUNT and EVERY positive whole numbers)")
    return size, copies, period


def main():
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--barrier", nargs="+", choices=["side", "xla"], default=["side"],
                   help="where the barrier before the copies runs (PYMPGU_PUSH_BARRIER); "
                        "one run per value")
    p.add_argument("--cycles", nargs="+", default=list(CYCLES), metavar="LETTERS",
                   help="sequences of steps to time back to back, a letter a step: m, p or s "
                        "(an overlapped step averaging the momentum, the parameters or the "
                        "whole state), a or b (the first layer's momentum or parameters), "
                        "or . (a plain step); default: %(default)s")
    p.add_argument("--only-cycles", action="store_true",
                   help="time the plain step and the cycles only, not each step's timeline")
    p.add_argument("--only", nargs="+", choices=[s[0] for s in STEPS], metavar="STEP",
                   help="time these steps only (default: all of %(choices)s)")
    p.add_argument("--hlo", metavar="DIR",
                   help="also write each step's compiled XLA program (rank 0's) into DIR")
    p.add_argument("--dma", nargs="+", type=_dma_spec, default=[(None, 1, 1)],
                   metavar="WHAT[xCOUNT][:EVERY]",
                   help="time the plain step beside DMA pulls from the peers of WHAT megabytes "
                        "('all': their whole buffers; 'kernel': a one-element kernel on the "
                        "pulls' stream, no copy), COUNT of them (default 1), before one step "
                        "in EVERY (default 1); several to compare, e.g. 1:2 13:2 1x13:2 "
                        "0.000004:2 kernel:2 (default: all)")
    a = p.parse_args()
    bad = [c for c in a.cycles if not c or set(c) - set(PARTS)]
    if bad:
        p.error(f"--cycles: {bad[0]!r} is not a sequence of the letters {''.join(PARTS)}")
    if len(a.gpus) < 2:
        p.error("--gpus needs at least two GPUs (or the same GPU twice): there is no "
                "exchange to time on one")
    from pympgu._cuda import XLA_MARKS
    from pympgu.clocks import describe
    from pympgu.launch import launch

    def _clock(sample):  # one GPU's (mhz, capped)
        return describe([sample[0]], [sample[1]])

    os.environ["PYMPGU_XLA_TIMELINE"] = "1"  # the spawned workers inherit it
    for where in a.barrier:
        os.environ["PYMPGU_PUSH_BARRIER"] = where
        results = launch(worker, (a.hidden, a.batch_size, a.steps, a.hlo, a.cycles,
                                  a.only_cycles, a.only, a.dma), gpus=a.gpus)
        timed = [s for s in STEPS if a.only is None or s[0] in a.only]
        print(f"first barrier on the {where} stream; ms after the start (median of "
              f"{a.steps}):")
        print(f"{'rank':>4} {'step':>8} " + " ".join(f"{m:>12}" for m in XLA_MARKS[1:]))
        for rank, r in enumerate(results):
            for name, *_ in () if a.only_cycles else timed:
                if r[name] is None:
                    print(f"{rank:>4} {name:>8} not through the start/done pair (an exchange "
                          "under PYMPGU_SPLIT_MIN_BYTES)")
                    continue
                print(f"{rank:>4} {name:>8} " +
                      " ".join(f"{r[name][m]:>12.3f}" for m in XLA_MARKS[1:]))
            print(f"{rank:>4} {'plain':>8} {r['plain_ms']:>11.3f} ms a step, back to back")
            for mb, copies, every, beside, alone, host in r["dma"]:
                if mb == "kernel":
                    what = (f"{copies} one-element kernels" if copies > 1 else
                            "a one-element kernel") + " on the pulls' stream"
                else:
                    size = f"{mb:.1f} MB" if mb >= 0.1 else f"{mb * 1e6:.0f} B"
                    what = "a DMA pull from the peers (" + (
                        f"{copies} copies of {size}" if copies > 1 else f"a {size} copy") + ")"
                print(f"{rank:>4} {'':>8} {beside:.3f} beside {what} "
                      f"before one step in {every} ({(beside - r['plain_ms']) * every:+.3f} ms a "
                      f"pull), which alone takes {alone:.3f} ({host:.3f} to queue)")
            if not a.only_cycles:
                print(f"{rank:>4} {'':>8} back to back, ms a step (with XLA passes in place of "
                      "the exchange): " + ", ".join(
                          f"{name} {r.get(name + '_ms', float('nan')):.3f} "
                          f"({r[name + '_dry_ms']:.3f})" for name, *_ in timed))
            print(f"{rank:>4} {'':>8} cycles back to back, ms a step (hollow; hollow unwaited; "
                  "dry; the host's): " +
                  ", ".join(f"{c} {r['cycle ' + c]:.3f} ({r['hollow cycle ' + c]:.3f}; "
                            f"{r['unwaited cycle ' + c]:.3f}; {r['dry cycle ' + c]:.3f}; "
                            f"{r['host ' + c]:.3f})" for c in a.cycles))
            print(f"{rank:>4} {'':>8} mean SM clock, MHz (share of samples held down for "
                  f"power or heat): plain {_clock(r['plain_clock'])}, " +
                  ", ".join(f"{c} {_clock(r['clock ' + c])}" for c in a.cycles))
            for c in a.cycles:
                if "marks " + c in r:
                    print(f"{rank:>4} {c:>8} " +
                          " ".join(f"{r['marks ' + c][m]:>12.3f}" for m in XLA_MARKS[1:]))


if __name__ == "__main__":
    main()
