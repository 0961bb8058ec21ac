"""XLA's reductions, square roots and divisions on a GPU, against the bits a clipped update needs.

    python benchmarks/probe_reduce.py            # XLA's default, then with the flag

A clipped update (--clip-norm) on the gradients' road computes the norm of the mean
gradients on every rank, from the same bits: the replicas stay identical only if every
rank sums those squares in the same order. This sums the squares of arrays of the MLPs'
gradient shapes, and of all of them together, ``--calls`` times each in one jitted call,
and counts the distinct results; then the same in a process whose XLA_FLAGS has
``--xla_gpu_exclude_nondeterministic_ops=true`` (pympgu.xla.DETERMINISTIC_FLAG). It also
counts how many of a million random float32 operands XLA's square root and division
round otherwise than numpy (IEEE 754, correctly rounded).

On one H200 (session 37) every sum came out the same in 200 calls either way, so the
reductions alone are not what differed: in training on 2 ranks sharing that GPU, 3 of 7
clipped runs without the flag ended with replicas apart, and 9 of 9 with it kept them
identical. XLA's square root and division rounded 17% and 30% of the operands otherwise
than numpy, the same with the flag (docs/BENCHMARKS.md).
"""
import argparse
import os
import subprocess
import sys

SHAPES = {"MLP 784-256-128-10": [(784, 256), (256,), (256, 128), (128,), (128, 10), (10,)],
          "wide MLP 784-4096-4096-10": [(784, 4096), (4096,), (4096, 4096), (4096,),
                                       (4096, 10), (10,)]}


def probe(calls):
    import jax
    import jax.numpy as jnp
    import numpy as np
    flags = os.environ.get("XLA_FLAGS", "") or "XLA's default"
    print(f"XLA_FLAGS: {flags} ({jax.devices()[0].device_kind})")
    rng = np.random.default_rng(0)
    for name, shapes in SHAPES.items():
        gs = [jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
        each = jax.jit(lambda gs: [jnp.sum(g * g) for g in gs])
        total = jax.jit(lambda gs: jnp.sqrt(sum(jnp.sum(g * g) for g in gs)))
        seen_each = [set() for _ in shapes]
        seen_total = set()
        for _ in range(calls):
            for s, v in zip(seen_each, each(gs)):
                s.add(np.asarray(v).tobytes())
            seen_total.add(np.asarray(total(gs)).tobytes())
        counts = ", ".join(f"{'x'.join(map(str, s))}: {len(v)}"
                           for s, v in zip(shapes, seen_each))
        print(f"  {name}: distinct sums of squares in {calls} calls: {counts}; "
              f"the global norm: {len(seen_total)}")
    x = rng.uniform(1e-3, 1e6, 1 << 20).astype(np.float32)
    y = rng.uniform(1e-3, 1e3, 1 << 20).astype(np.float32)
    sq = np.asarray(jax.jit(jnp.sqrt)(x))
    dv = np.asarray(jax.jit(lambda a, b: a / b)(x, y))
    print(f"  rounded otherwise than numpy, of {x.size}: sqrt {int((sq != np.sqrt(x)).sum())}, "
          f"division {int((dv != x / y).sum())}")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return probe(args.calls)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pympgu.xla import DETERMINISTIC_FLAG
    for flags in ("", DETERMINISTIC_FLAG):
        env = dict(os.environ, XLA_FLAGS=flags)
        subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls)],
                       env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
