"""What an exchange inside XLA costs on the device, and what XLA compiled around it.

    PYTHONPATH=. python benchmarks/probe_xla.py --gpus 0 1 [--hidden 4096 4096]

Each rank builds the training loop's replica and Exchanger, then times back-to-back calls
of: the training step alone, the step with its exchange fused in (whole state, parameters
alone), the XLA exchange alone, and the bare kernel on the same bytes. For the plain and the
parameters-only step it also gives the host's loop alone (JAX returns before the GPU is
done, so a loop as long as the whole means the host sets the pace) and the GPU's time (8
steps unrolled in one call), and so for the overlapped step (--overlap: the average of the
state it starts from runs while it computes). It counts the copy instructions in the
compiled fused and overlapped steps (copies XLA added around the operations would each cost
a pass over the state). With
--no-exchanger, or where the exchange cannot run inside XLA (PYMPGU_NO_P2P=1), it times the
steps alone, every rank at once and then one at a time, and says where JAX put each rank's
model. --only-params runs the parameters-only step alone, for a profiler.
"""
import os
import re
import time

from probe_common import parser, replica_config


def _where(rep, ctx):
    """Which devices this rank's JAX sees and holds its state on, and (rank 0) which
    processes hold a context on which GPU: a stray context shares that GPU's time."""
    import subprocess

    import jax
    held = sorted({str(d) for v in rep.values() for d in v.devices()})
    text = f"jax sees {jax.devices()}, state on {held}"
    if ctx.nranks > 1:
        ctx.barrier()
    if ctx.rank == 0:
        try:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory",
                                   "--format=csv,noheader"], capture_output=True, text=True)
            text += "; contexts: " + "; ".join(apps.stdout.strip().splitlines())
        except OSError as e:
            text += f"; contexts: nvidia-smi failed ({e})"
    if ctx.nranks > 1:
        ctx.barrier()
    return text


def worker(ctx, hidden, batch, calls, exchanger=True, only_params=False):
    from pympgu.training.replica import Replica
    from pympgu.training.worker import make_exchanger, setup_backend
    setup_backend(ctx, "jax")  # before PyTensor is imported
    import jax
    import numpy as np

    from pympgu.bench.steps import _bare_kernel_ms
    from pympgu.exchange import Exchanger
    from pympgu.xla import StepExchange
    cfg = replica_config(hidden, batch, [None] * ctx.nranks if ctx.is_cpu else [ctx.device])
    rep = Replica(ctx, cfg)
    # One rank alone (--gpus 0) still gets an Exchanger: its exchange is the pack, a local
    # kernel and the unpack, which prices the copies around the link.
    ex = inside = None
    if exchanger:
        ex, inside = make_exchanger(ctx, rep, cfg)
        if ex is None:
            ex = Exchanger(ctx, rep.layout)
            inside = StepExchange(ex)
    try:
        idx = jax.device_put(np.arange(batch, dtype=np.int32))
        plain = rep.jax_step()

        dispatch = {}

        def run(call):
            for _ in range(5):
                call()
            rep.wait()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            # JAX returns before the GPU is done: if the loop alone takes as long as the
            # whole, the host (not the GPU) sets the pace.
            dispatch[call] = 1e3 * (time.perf_counter() - t0) / calls
            rep.wait()
            return 1e3 * (time.perf_counter() - t0) / calls

        def device_ms(step, k=8):
            # k steps unrolled in one jitted call: no host between them, so this is GPU time
            # (unrolled, as a loop would add copies of the carried state).
            args = step.arguments(idx)
            where = {id(c): i for i, c in step.shared}
            feed = [(out, where[id(c)]) for out, c in step.updates]

            def body(_, args):
                outs = step.jitted(*args)
                args = list(args)
                for out, i in feed:
                    args[i] = outs[out]
                return tuple(args)
            loop = jax.jit(lambda args: jax.lax.fori_loop(0, k, body, args, unroll=True))
            jax.block_until_ready(loop(tuple(args)))
            if ctx.nranks > 1:
                ctx.barrier()
            t0 = time.perf_counter()
            jax.block_until_ready(loop(tuple(args)))
            return 1e3 * (time.perf_counter() - t0) / k

        def timed(call):
            if ctx.nranks > 1:
                ctx.barrier()
            return run(call)

        def in_turn(call):
            # Each rank alone while the others wait at the barrier: a rank slower here than
            # alone on its GPU is slowed by its own setup, not by the other's work.
            ms = None
            for turn in range(ctx.nranks):
                ctx.barrier()
                if turn == ctx.rank:
                    ms = run(call)
            return ms

        if ex is None or inside.unavailable():
            # The steps alone: every rank at once, then one rank at a time.
            step = lambda: plain(idx)  # noqa: E731
            out = {"step_ms": timed(step)}
            out["dispatch_ms"] = dispatch[step]
            out["device_ms"] = device_ms(plain)
            if ctx.nranks > 1:
                out["in_turn_ms"] = in_turn(lambda: plain(idx))
            out["where"] = _where(rep, ctx)
            out["pid"] = os.getpid()
            return out
        fused, params_only = rep.jax_step(inside), rep.jax_step(inside, "params")
        if only_params:
            # Nothing else on the GPU: what a profiler shows is sync1's step as training runs it.
            return {"step_ms": 0.0, "params_only_ms": timed(lambda: params_only(idx))}
        alone = jax.jit(inside.average)

        def exchange_only():
            rep.set_values(alone(rep.values()))

        overlapped = rep.jax_step(inside, "params", overlap=True)
        step, step_po = (lambda: plain(idx)), (lambda: params_only(idx))
        step_ov = lambda: overlapped(idx)  # noqa: E731
        out = {"step_ms": timed(step), "fused_ms": timed(lambda: fused(idx)),
               "params_only_ms": timed(step_po), "overlap_ms": timed(step_ov),
               "dispatch_ms": dispatch[step], "po_dispatch_ms": dispatch[step_po],
               "ov_dispatch_ms": dispatch[step_ov],
               "device_ms": device_ms(plain), "po_device_ms": device_ms(params_only),
               "ov_device_ms": device_ms(overlapped),
               "xla_exchange_ms": timed(exchange_only), "kernel_ms": _bare_kernel_ms(ex)}

        def copies_in(hlo):
            return re.findall(r"= (f32\[[0-9,]*\])[^ ]* copy\(", hlo)
        hlo = fused.jitted.lower(*fused.arguments(idx)).compile().as_text()
        out["copies"] = copies_in(hlo)
        out["custom_calls"] = len(re.findall(r"custom-call\(", hlo))
        out["overlap_copies"] = copies_in(
            overlapped.jitted.lower(*overlapped.arguments(idx)).compile().as_text())
        hlo_x = alone.lower(rep.values()).compile().as_text()
        out["exchange_only_copies"] = re.findall(r"= (f32\[[0-9,]*\])[^ ]* copy\(", hlo_x)
        return out
    finally:
        if ex is not None:
            ex.close()


def main():
    p = parser(__doc__)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--no-exchanger", action="store_true",
                   help="no Exchanger (no IPC mapping, no peer access): time the steps alone")
    p.add_argument("--only-params", action="store_true",
                   help="time the step that averages the parameters alone, and nothing else "
                        "(for a profiler)")
    a = p.parse_args()
    from pympgu.runtime import launch
    args = (a.hidden, a.batch_size, a.calls, not a.no_exchanger, a.only_params)
    for rank, r in enumerate(launch(worker, args, gpus=a.gpus)):
        if a.only_params:
            print(f"rank {rank}: step with the parameters averaged {r['params_only_ms']:.3f} ms")
            continue
        if "fused_ms" not in r:
            turn = f", alone in turn {r['in_turn_ms']:.3f} ms" if "in_turn_ms" in r else ""
            print(f"rank {rank} (GPU {a.gpus[rank]}, pid {r['pid']}): step {r['step_ms']:.3f} ms"
                  f" (loop alone {r['dispatch_ms']:.3f}, GPU {r['device_ms']:.3f}){turn}; "
                  f"{r['where']}")
            continue
        print(f"rank {rank}: step {r['step_ms']:.3f} ms (loop alone {r['dispatch_ms']:.3f}, GPU "
              f"{r['device_ms']:.3f}); with the parameters averaged {r['params_only_ms']:.3f} "
              f"ms (loop alone {r['po_dispatch_ms']:.3f}, GPU {r['po_device_ms']:.3f})")
        print(f"rank {rank}: overlapped step {r['overlap_ms']:.3f} ms (loop alone "
              f"{r['ov_dispatch_ms']:.3f}, GPU {r['ov_device_ms']:.3f}); copies in it: "
              f"{r['overlap_copies'] or 'none'}")
        print(f"rank {rank}: step {r['step_ms']:.3f} ms, step with exchange {r['fused_ms']:.3f} "
              f"ms (parameters alone {r['params_only_ms']:.3f} ms), XLA exchange alone "
              f"{r['xla_exchange_ms']:.3f} ms, bare kernel {r['kernel_ms']:.3f} ms; {r['custom_calls']} custom call(s), copies in the "
              f"fused step: {r['copies'] or 'none'}; in the exchange alone: "
              f"{r['exchange_only_copies'] or 'none'}")


if __name__ == "__main__":
    main()
