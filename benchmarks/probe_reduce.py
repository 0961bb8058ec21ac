"""XLA's reductions, square roots and divisions on a GPU, against the bits a clipped update needs.

    python benchmarks/probe_reduce.py            # XLA's default, then with the flag
    python benchmarks/probe_reduce.py --training 4 --gpus 0 0   # clipped runs, XLA dumped

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

``--training RUNS`` asks why: it trains the clipped MLP of test_gpu_training_clipped (SGD,
one epoch, the gradients' road) RUNS times on the ranks of ``--gpus`` without the flag,
which pympgu refuses and this patches past, then RUNS times with it (or with each of
``--flags`` in turn). Each rank's XLA
dumps its optimized programs, their PTX and its autotuning results; the probe says
whether the replicas ended identical, which of those files differ between the ranks, and
how many atomic instructions (PTX atom. and red.) each program has: programs that differ
between the ranks, or autotuning that chose otherwise, point at the compilation; the same
programs with atomics in them, at the order in which the atomics land.
"""
import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile

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


# A PTX instruction that adds into memory atomically: its sum's order is the order in which
# the threads' additions land.
ATOMIC = re.compile(r"^\s*(@!?%p\d+\s+)?(atom|red)\.", re.M)


PATH = re.compile(rb'"/[^"\s]*"')


def clipped_worker(ctx, cfg, dump, flag):
    """pympgu.train.worker with this rank's XLA dumping into ``dump``/rank<r>, and ``flag``
    (XLA flags, or none) in XLA_FLAGS in place of pympgu's: past the check that refuses a
    reducing update on GPUs without DETERMINISTIC_FLAG."""
    from pympgu import train, xla
    here = os.path.join(dump, f"rank{ctx.rank}")
    xla.deterministic_reductions = lambda: True
    xla.use_deterministic_reductions = lambda: None
    os.environ["XLA_FLAGS"] = " ".join([f"--xla_dump_to={here}", "--xla_dump_hlo_as_text",
                                        f"--xla_gpu_dump_autotune_results_to={here}/"
                                        f"autotune.textproto", flag])
    return train.worker(ctx, cfg)


def atomics(path):
    with open(path, errors="replace") as f:
        return len(ATOMIC.findall(f.read()))


def dumped(d):
    """A rank's dumped files by (module name, its how-manieth compile of that name, the
    file's suffix): the ranks number their modules in the order they compile them, and
    rank 0 compiles some that the others do not."""
    files, nth = {}, {}
    for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        if not os.path.isfile(path) or name.endswith(".debug_options"):  # the rank's paths
            continue
        m = re.match(r"module_(\d+)\.([^.]+)(.*)", name)
        if not m:
            files[(name, 0, "")] = path
            continue
        number, module, rest = m.groups()
        if (module, number) not in nth:
            nth[module, number] = sum(1 for k in nth if k[0] == module)
        files[(module, nth[module, number], rest)] = path
    return files


def compare(dump, nranks):
    """What differs between rank 0's dumped files and every other rank's."""
    ranks = [dumped(os.path.join(dump, f"rank{r}")) for r in range(nranks)]
    common = sorted(set.intersection(*(set(r) for r in ranks)))
    print(f"    {len(common)} files dumped by every rank, "
          f"{len(set.union(*(set(r) for r in ranks))) - len(common)} by some")
    for key in common:
        texts = []
        for r in ranks:
            with open(r[key], "rb") as f:  # the source files' paths are each rank's own
                texts.append(PATH.sub(b'"<path>"', f.read()))
        if any(t != texts[0] for t in texts[1:]):
            other = next(t for t in texts[1:] if t != texts[0])
            diff = list(difflib.unified_diff(
                texts[0].decode(errors="replace").splitlines(),
                other.decode(errors="replace").splitlines(), "rank 0", "another rank",
                n=0, lineterm=""))
            print(f"    differs between ranks: {key} ({len(diff)} diff lines)")
            # The thunk sequence lists each kernel with its grid: the most telling diff.
            for line in diff[2:32 if "thunk_sequence." in key[2] else 10]:
                print(f"      {line[:160]}")
    tuned = [r.get(("autotune.textproto", 0, "")) for r in ranks]
    if all(tuned):
        for rank, path in enumerate(tuned):
            with open(path) as f:
                chosen = re.findall(r"^\s*backend: (\w+)", f.read(), re.M)
            print(f"    rank {rank}'s autotuning chose: "
                  f"{ {b: chosen.count(b) for b in sorted(set(chosen))} }")
    for key in common:
        if key[2].endswith(".ptx"):
            n = atomics(ranks[0][key])
            if n:
                print(f"    {n} atomic instructions in {key}")


def training(runs, gpus, flags):
    from pympgu import train
    from pympgu.launch import launch
    cfg = dict(train.DEFAULTS, data=None, backend="jax", method="auto", sync_every=1,
               seed=0, overlap=False, exchange_dtype="float32", out=None, resume=None,
               epochs=1, hidden=[256, 128], clip_norm=0.5)
    for flag in flags:
        said = f"with {flag}" if flag else "without a flag"
        apart = 0
        for run in range(runs):
            with tempfile.TemporaryDirectory() as dump:
                results = launch(clipped_worker, (cfg, dump, flag), gpus=gpus)
                digests = {r["digest"] for r in results}
                apart += len(digests) > 1
                print(f"{said}, run {run + 1}: "
                      f"replicas {'apart' if len(digests) > 1 else 'identical'}; "
                      f"{results[0]['history'][-1].get('road')}", flush=True)
                compare(dump, len(gpus))
        print(f"{said}: {apart} of {runs} runs ended with the replicas apart", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--training", type=int, metavar="RUNS", default=0,
                   help="train the clipped MLP RUNS times without the flag and RUNS with it, "
                        "comparing the ranks' XLA dumps (default: 0, the sums alone)")
    p.add_argument("--gpus", type=int, nargs="+", default=[0, 1],
                   help="--training's ranks, one a GPU index each; repeat one to put "
                        "several ranks on it (default: 0 1)")
    p.add_argument("--flags", nargs="+", metavar="FLAGS",
                   help="--training's XLA flags to try, each a string ('' for none) "
                        "(default: none, then pympgu.xla.DETERMINISTIC_FLAG)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return probe(args.calls)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.training:
        from pympgu.xla import DETERMINISTIC_FLAG
        return training(args.training, args.gpus, args.flags or ["", DETERMINISTIC_FLAG])
    from pympgu.xla import DETERMINISTIC_FLAG
    for flags in ("", DETERMINISTIC_FLAG):
        env = dict(os.environ, XLA_FLAGS=flags)
        subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls)],
                       env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
