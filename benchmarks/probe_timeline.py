"""Where an exchange inside the step's XLA call spends its time, point by point, on the GPU.

    PYTHONPATH=. python benchmarks/probe_timeline.py --gpus 0 1 [--hidden 4096 4096]
                                                    [--barrier side xla]

The GPU machine has no profiler, so the exchange marks its own points with CUDA events
(PYMPGU_XLA_TIMELINE=1, PeerGroup.xla_timeline). Each rank builds the training loop's
replica and Exchanger (with its shared shadow, as pympgu.train does) and runs these steps:
'exact' (the parameters averaged after the step; from 16 MiB the step is cut, so that the
last layers leave while the first layer's gradient is computed); 'overlap' (the parameters
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

and the plain step alone, back to back, for scale; then the plain step beside DMA copies of
the whole buffer from the peers (no barrier, no kernel of pympgu's), and those copies alone:
what the link's traffic alone costs XLA's compute. Last, each step back to back, and again
with the exchange's operations replaced by a pass of XLA's own over the same arrays (not
averaged): what the program's shape costs without the link; and --overlap --sync-every 4's
four steps ('momentum', 'overlap', then two plain steps), both ways. It runs once per --barrier value
(PYMPGU_PUSH_BARRIER: the first barrier on the side stream, or on XLA's). The distance from
start to side_begin is what the copies wait before they can run.
"""
import os
import time

from probe_common import parser, replica_config


# The steps timed: name, overlapped, whether XLA's update applies the correction
# (PYMPGU_FUSED_CORRECTION; pympgu.xla.correct_during's shadow) or pympgu's pass does, and
# what is averaged (pympgu.train.Replica.part): the parameters (--sync-every 1), the
# momentum (the due step of --overlap --sync-every K > 1), or the whole state (twice the
# bytes: what that due step sent until session 12).
STEPS = (("exact", False, "1", "params"), ("overlap", True, "1", "params"),
         ("pass", True, "0", "params"), ("momentum", True, "1", "momentum"),
         ("state", True, "1", "state"))


# --overlap --sync-every 4's four steps: the part each averages while it computes.
CYCLE = ("momentum", "params", None, None)
APART = ("momentum", None, "params", None)


def worker(ctx, hidden, batch, steps, hlo_dir=None):
    from pympgu.train import Replica, _setup_backend, make_exchanger
    _setup_backend(ctx, "jax")  # before PyTensor is imported
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pympgu import CudaError
    cfg = replica_config(hidden, batch)
    rep = Replica(ctx, cfg)
    ex = make_exchanger(ctx, rep, cfg)
    try:
        group = ex.backend.group
        idx = jax.device_put(np.arange(batch, dtype=np.int32))

        def back_to_back(step, beside=None):
            """ms a step, issued back to back after 5 to warm up; ``beside()`` is queued
            before each."""
            for _ in range(5):
                step(idx)
            rep.wait()
            ctx.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                if beside is not None:
                    beside()
                step(idx)
            rep.wait()
            group.stream.synchronize()
            return 1e3 * (time.perf_counter() - t0) / steps

        def dump(name, step):
            # The program XLA runs, to see how it fused the step (--hlo; rank 0's).
            if hlo_dir and ctx.rank == 0:
                with open(os.path.join(hlo_dir, name + ".hlo.txt"), "w") as f:
                    f.write(step.jitted.lower(*step.arguments(idx)).compile().as_text())

        plain = rep.jax_step()
        dump("plain", plain)
        out = {"plain_ms": back_to_back(plain)}
        # The same steps while every rank's copy engines pull the peers' whole buffers into
        # its shadow, with no barrier and no kernel of pympgu's on the GPU: what DMA traffic
        # alone costs XLA's compute. Then the copies alone.
        n = group.nbytes // 4

        def pull():
            group.gather(n, synchronize=False)

        out["dma_plain_ms"] = back_to_back(plain, pull)
        ctx.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            pull()
        group.stream.synchronize()
        out["dma_ms"] = 1e3 * (time.perf_counter() - t0) / steps
        out["dma_mb"] = group.nbytes / 1e6
        ctx.barrier()  # no rank's exchange below lands in a shadow a peer still copies into

        def build(overlap, fused, part):
            # PYMPGU_FUSED_CORRECTION is read when a step is built (Exchanger.xla_shadow).
            os.environ["PYMPGU_FUSED_CORRECTION"] = fused
            rep._steps.clear()
            return rep.jax_step(ex, part, overlap)

        def cycle(parts=CYCLE):
            # --overlap --sync-every 4's steps (pympgu.train.Sync): the due step averages the
            # momentum while it computes, the next the parameters, then two plain steps.
            # Timed as one call, ms a step. rep.step builds the steps anew, with the
            # correction in XLA's update.
            os.environ["PYMPGU_FUSED_CORRECTION"] = "1"
            rep._steps.clear()

            def run(idx):
                for part in parts:
                    rep.step(idx, *((ex, part, True) if part else ()))
            return run

        out["cycle_ms"] = back_to_back(cycle()) / 4
        # The same two exchanges a step apart: whether the second one pays for following
        # the first.
        out["apart_ms"] = back_to_back(cycle(APART)) / 4
        for name, *how in STEPS:
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
        # The same programs with the exchange's operations replaced by a pass of XLA's own
        # over the same arrays (no link, no side stream, no kernel of pympgu's; the results
        # are not averaged): what the program's shape alone costs, its optimization barriers
        # and the arrays kept alive until the done.
        from pympgu import xla
        xla._start = lambda arrays, attrs, phase, offsets=None, after=None: (
            jnp.zeros((), jnp.uint32) if after is None else after + 1)
        xla._done = lambda token, arrays, attrs, fresh=None, **kw: [
            (f if fresh is not None else a) + 0 * a
            for f, a in zip(fresh if fresh is not None else arrays, arrays)]
        xla._wait = lambda token, after, attrs, k: after[k]
        for name, *how in STEPS:
            step = build(*how)
            dump(name + "_dry", step)
            out[name + "_dry_ms"] = back_to_back(step)
        out["cycle_dry_ms"] = back_to_back(cycle()) / 4
        out["apart_dry_ms"] = back_to_back(cycle(APART)) / 4
        return out
    finally:
        ex.close()


def main():
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--barrier", nargs="+", choices=["side", "xla"], default=["side"],
                   help="where the barrier before the copies runs (PYMPGU_PUSH_BARRIER); "
                        "one run per value")
    p.add_argument("--hlo", metavar="DIR",
                   help="also write each step's compiled XLA program (rank 0's) into DIR")
    a = p.parse_args()
    if len(a.gpus) < 2:
        p.error("--gpus needs at least two GPUs (or the same GPU twice): there is no "
                "exchange to time on one")
    from pympgu._cuda import XLA_MARKS
    from pympgu.launch import launch
    os.environ["PYMPGU_XLA_TIMELINE"] = "1"  # the spawned workers inherit it
    for where in a.barrier:
        os.environ["PYMPGU_PUSH_BARRIER"] = where
        results = launch(worker, (a.hidden, a.batch_size, a.steps, a.hlo), gpus=a.gpus)
        print(f"first barrier on the {where} stream; ms after the start (median of {a.steps}):")
        print(f"{'rank':>4} {'step':>8} " + " ".join(f"{m:>12}" for m in XLA_MARKS[1:]))
        for rank, r in enumerate(results):
            for name, *_ in STEPS:
                if r[name] is None:
                    print(f"{rank:>4} {name:>8} not through the start/done pair (an exchange "
                          "under PYMPGU_SPLIT_MIN_BYTES)")
                    continue
                print(f"{rank:>4} {name:>8} " +
                      " ".join(f"{r[name][m]:>12.3f}" for m in XLA_MARKS[1:]))
            print(f"{rank:>4} {'plain':>8} {r['plain_ms']:>11.3f} ms a step, back to back; "
                  f"{r['dma_plain_ms']:.3f} beside a {r['dma_mb']:.1f} MB DMA pull from the "
                  f"peers, which alone takes {r['dma_ms']:.3f}")
            print(f"{rank:>4} {'':>8} back to back, ms a step (with XLA passes in place of "
                  "the exchange): " + ", ".join(
                      f"{name} {r.get(name + '_ms', float('nan')):.3f} "
                      f"({r[name + '_dry_ms']:.3f})" for name, *_ in STEPS))
            print(f"{rank:>4} {'':>8} --overlap --sync-every 4, back to back: "
                  f"{r['cycle_ms']:.3f} ms a step ({r['cycle_dry_ms']:.3f}); with the "
                  f"parameters a step later: {r['apart_ms']:.3f} ({r['apart_dry_ms']:.3f})")


if __name__ == "__main__":
    main()
