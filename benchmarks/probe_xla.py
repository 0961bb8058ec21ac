"""What an exchange inside XLA costs on the device, and what XLA compiled around it.

    PYTHONPATH=. python benchmarks/probe_xla.py --gpus 0 1 [--hidden 4096 4096]

Each rank builds the training loop's replica and Exchanger, then times back-to-back calls
(device-bound, so wall time per call is device time) of: the training step alone, the step
with its exchange fused in, the XLA exchange alone, and the bare kernel on the same bytes. It
also counts the copy instructions in the compiled fused step (copies XLA added around the
operation would each cost a pass over the state). With --no-exchanger, or where the exchange
cannot run inside XLA (PYMPGU_NO_P2P=1), it times the steps alone, every rank at once.
"""
import argparse
import re
import time


def worker(ctx, hidden, batch, calls, exchanger=True):
    import jax
    import numpy as np

    from pympgu.bench_train import _bare_kernel_ms
    from pympgu.exchange import Exchanger
    from pympgu.train import Replica, _setup_backend, make_exchanger, state_layout
    _setup_backend(ctx, "jax")
    cfg = dict(data=None, hidden=hidden, lr=0.05, momentum=0.9, batch_size=batch, l1=0.0,
               l2=1e-4, backend="jax", method="auto", exchange_dtype="float32",
               exchange_blocks=None, overlap=False)
    rep = Replica(ctx, cfg)
    # One rank alone (--gpus 0) still gets an Exchanger: its exchange is the pack, a local
    # kernel and the unpack, which prices the copies around the link.
    ex = (make_exchanger(ctx, rep, cfg) or Exchanger(ctx, state_layout(rep))) if exchanger \
        else None
    try:
        idx = jax.device_put(np.arange(batch, dtype=np.int32))
        plain = rep.jax_step()

        def timed(call):
            for _ in range(5):
                call()
            rep.wait()
            if ctx.nranks > 1:
                ctx.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            rep.wait()
            return 1e3 * (time.perf_counter() - t0) / calls

        if ex is None or ex.xla_unavailable():
            # The steps alone, every rank at once: is one rank slowed by the other's?
            return {"step_ms": timed(lambda: plain(idx))}
        fused, params_only = rep.jax_step(ex), rep.jax_step(ex, params_only=True)
        alone = jax.jit(ex.xla_average)

        def exchange_only():
            rep.set_values(alone(rep.values()))

        out = {"step_ms": timed(lambda: plain(idx)), "fused_ms": timed(lambda: fused(idx)),
               "params_only_ms": timed(lambda: params_only(idx)),
               "xla_exchange_ms": timed(exchange_only), "kernel_ms": _bare_kernel_ms(ex)}
        hlo = fused.jitted.lower(*fused.arguments(idx)).compile().as_text()
        copies = re.findall(r"= (f32\[[0-9,]*\])[^ ]* copy\(", hlo)
        out["copies"] = copies
        out["custom_calls"] = len(re.findall(r"custom-call\(", hlo))
        hlo_x = alone.lower(rep.values()).compile().as_text()
        out["exchange_only_copies"] = re.findall(r"= (f32\[[0-9,]*\])[^ ]* copy\(", hlo_x)
        return out
    finally:
        if ex is not None:
            ex.close()


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[0, 1])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 4096])
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--no-exchanger", action="store_true",
                   help="no Exchanger (no IPC mapping, no peer access): time the steps alone")
    a = p.parse_args()
    from pympgu.launch import launch
    args = (a.hidden, a.batch_size, a.calls, not a.no_exchanger)
    for rank, r in enumerate(launch(worker, args, gpus=a.gpus)):
        if len(r) == 1:
            print(f"rank {rank} (GPU {a.gpus[rank]}): step {r['step_ms']:.3f} ms")
            continue
        print(f"rank {rank}: step {r['step_ms']:.3f} ms, step with exchange {r['fused_ms']:.3f} "
              f"ms (parameters alone {r['params_only_ms']:.3f} ms), XLA exchange alone "
              f"{r['xla_exchange_ms']:.3f} ms, bare kernel {r['kernel_ms']:.3f} ms; {r['custom_calls']} custom call(s), copies in the "
              f"fused step: {r['copies'] or 'none'}; in the exchange alone: "
              f"{r['exchange_only_copies'] or 'none'}")


if __name__ == "__main__":
    main()
