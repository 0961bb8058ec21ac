"""Where the host's time goes in a training step and an exchange, on one GPU.

    PYTHONPATH=. python benchmarks/profile_host.py [--hidden 4096 4096] [--steps 200]

(from the repository root after ./build.sh; or anywhere after pip install.)

One worker (R = 1) runs `--steps` training steps, each followed by a whole exchange of the
replica's state through an Exchanger queued from Python (the loop's path for --overlap and
the bf16 wire; plain exchanges now run inside the step's XLA call: benchmarks/probe_xla.py). It prints
the host time per step of the training call and of the exchange, then cProfile's top
functions by cumulative time. With R = 1 the kernel is a local copy: this measures the host
work, not the link.
"""
import argparse
import cProfile
import io
import pstats
import time


def worker(ctx, hidden, batch, steps):
    import numpy as np

    from pympgu.exchange import Exchanger
    from pympgu.training import RunConfig
    from pympgu.training.replica import Replica
    from pympgu.training.worker import setup_backend
    setup_backend(ctx, "jax")
    cfg = RunConfig(hidden=hidden, batch_size=batch, backend="jax", devices=[ctx.device])
    rep = Replica(ctx, cfg)
    rng = np.random.default_rng(0)
    ntrain = len(rep.dataset.train[1])
    batches = [rng.integers(0, ntrain, batch).astype(np.int32) for _ in range(steps)]
    with Exchanger(ctx, rep.layout) as ex:
        batches = rep.device_batches(batches)
        for idx in batches[:20]:  # compile and warm up
            rep.step(idx)
            rep.exchange(ex)
        rep.wait()
        t_step = t_ex = 0.0
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for idx in batches:
            t1 = time.perf_counter()
            rep.step(idx)
            t2 = time.perf_counter()
            rep.exchange(ex)
            t_step += t2 - t1
            t_ex += time.perf_counter() - t2
        prof.disable()
        rep.wait()
        wall = time.perf_counter() - t0
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    return {"ms_per_step": 1e3 * wall / steps, "train_host_ms": 1e3 * t_step / steps,
            "exchange_host_ms": 1e3 * t_ex / steps, "profile": out.getvalue()}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 4096])
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--gpu", type=int, default=0)
    a = p.parse_args()
    from pympgu.runtime import launch
    r = launch(worker, (a.hidden, a.batch_size, a.steps), gpus=[a.gpu])[0]
    print(f"per step (profiler on): {r['ms_per_step']:.3f} ms wall; host: training call "
          f"{r['train_host_ms']:.3f} ms, exchange {r['exchange_host_ms']:.3f} ms")
    print(r["profile"])


if __name__ == "__main__":
    main()
