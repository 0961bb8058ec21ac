"""One GPU, no exchange: where pympgu's training step loses to the same step in plain JAX.

    PYTHONPATH=. python benchmarks/probe_step.py [--hidden 4096 4096] [--batch-size 1024]

One worker builds the training loop's replica and times, in rounds (each variant once a
round, so that a drift of the GPU touches each alike): the step as the training loop calls
it (pympgu.xla.step.JaxStep over PyTensor's JAX program; a worker alone donates its updated
state to XLA), the same step keeping its state (not donated), and the step written in plain
JAX with its state donated
(pympgu.bench.steps). For each: ms per step back to back, the host's loop alone (the calls
without waiting: where it is as long as the step, the host sets the pace), and the compiled
program's kernels (fusions, custom calls, copies) from its HLO.
"""
import re
import time

from probe_common import parser, replica_config


def _kernels(compiled):
    text = compiled.as_text()
    return {"fusions": len(re.findall(r"\bfusion\(", text)) + len(re.findall(r"= [^ ]+ fusion", text)),
            "custom_calls": len(re.findall(r"custom-call\(", text)),
            "copies": len(re.findall(r" copy\(", text)),
            "instructions": sum(1 for line in text.splitlines() if " = " in line)}


def _host_ms(call, batches, wait):
    """The loop of calls alone, not waited for (ms a call), then waited for."""
    wait()
    t0 = time.perf_counter()
    for idx in batches:
        call(idx)
    t = time.perf_counter() - t0
    wait()
    return 1e3 * t / len(batches)


def worker(ctx, hidden, batch, steps):
    import numpy as np

    from pympgu.bench.steps import _plain_jax_step, _time_rounds
    from pympgu.training.replica import Replica
    from pympgu.training.worker import setup_backend
    from pympgu.xla.step import JaxStep
    setup_backend(ctx, "jax")
    cfg = replica_config(hidden, batch, devices=[ctx.device])
    rep = Replica(ctx, cfg)
    rng = np.random.default_rng(0)
    ntrain = len(rep.dataset.train[1])
    batches = rep.device_batches([rng.integers(0, ntrain, batch).astype(np.int32)
                                  for _ in range(steps)])
    loop = rep.jax_step()
    kept = JaxStep(rep.train_fn, rep.model.state, donate=False)
    plain, plain_wait = _plain_jax_step(rep, cfg)
    calls = [(loop, rep.wait), (kept, rep.wait), (plain, plain_wait)]
    ms = _time_rounds(calls, batches)
    host = [_host_ms(call, batches, wait) for call, wait in calls]
    idx = batches[0]
    programs = [_kernels(f.jitted.lower(*f.arguments(idx)).compile()) for f in (loop, kept)]
    return {"ms": ms, "host_ms": host, "kernels": programs}


def main():
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    from pympgu.runtime import launch
    (r,) = launch(worker, (a.hidden, a.batch_size, a.steps), gpus=a.gpus[:1])
    names = ("pympgu (the loop's step, donated)", "pympgu, state kept", "plain JAX, donated")
    print("| step | ms a step | host loop alone, ms | kernels |")
    print("|---|---|---|---|")
    for k, name in enumerate(names):
        kern = r["kernels"][k] if k < 2 else {}
        print(f"| {name} | {r['ms'][k]:.4f} | {r['host_ms'][k]:.4f} | "
              f"{', '.join(f'{n} {v}' for n, v in kern.items()) or '-'} |")


if __name__ == "__main__":
    main()
