"""XLA's reductions, square roots and divisions on a GPU, against the bits a clipped update needs.

    python benchmarks/probe_reduce.py            # the sums alone: XLA's default, then the flag
    python benchmarks/probe_reduce.py --training 3 --gpus 0 0   # clipped runs, XLA dumped

A clipped update (--clip-norm) on the gradients' road computes the norm of the mean
gradients on every rank, from the same bits: the replicas stay identical only if every
rank sums those squares in the same order. This sums the squares of arrays of the MLPs'
gradient shapes, and of all of them together, ``--calls`` times each in one jitted call,
and counts the distinct results; then the same in a process whose XLA_FLAGS has
``--xla_gpu_exclude_nondeterministic_ops=true`` (pympgu.xla.DETERMINISTIC_FLAG). It also
counts how many of a million random float32 operands XLA's square root and division
round otherwise than numpy (IEEE 754, correctly rounded).

``--training RUNS`` trains the clipped MLP of test_gpu_training_clipped (SGD, one epoch,
the gradients' road) RUNS times on the ranks of ``--gpus`` with XLA's defaults, then RUNS
times as pympgu compiles the step (pympgu.xla.alike_options), or with each of ``--flags``
in turn. Each rank's XLA dumps its programs and its autotuning's choices; the probe says
whether the replicas ended identical, which dumped files differ between the ranks (the
thunk sequence lists every kernel with its grid) and what each rank's autotuning chose.

On one H200 (sessions 37 and 38), summed alone, every sum came out the same in 200 calls.
In training on 2 ranks sharing the GPU, with XLA's defaults, 6 of 16 clipped runs ended
with the replicas apart. XLA's fusion autotuner, which times each fusion's candidate
kernels on the rank that compiles it, had chosen other kernels on the two ranks for the
update's reductions (its native emitter's against Triton's block-level emitter's, other
grids). With that autotuner off, the ranks' reductions were the same kernels, and the
replicas identical, in each of 9 runs. XLA's square root and division rounded 17% and 30%
of the operands otherwise than numpy, the same with the flag (docs/BENCHMARKS.md).
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


PATH = re.compile(rb'"/[^"\s]*"')


def clipped_worker(ctx, cfg, dump, flag):
    """pympgu.train.worker with this rank's XLA dumping into ``dump``/rank<r>. With ``flag``
    'pympgu', the step is compiled as pympgu compiles it (pympgu.xla.alike_options);
    otherwise with XLA's defaults and ``flag`` (XLA flags, or none) in XLA_FLAGS."""
    from pympgu import train, xla
    here = os.path.join(dump, f"rank{ctx.rank}")
    if flag != "pympgu":
        xla.alike_options = lambda: {}
    os.environ["XLA_FLAGS"] = " ".join([f"--xla_dump_to={here}", "--xla_dump_hlo_as_text",
                                        f"--xla_gpu_dump_autotune_results_to={here}/"
                                        f"autotune.textproto",
                                        "" if flag == "pympgu" else flag])
    return train.worker(ctx, cfg)


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


def training(runs, gpus, flags):
    from pympgu import train
    from pympgu.launch import launch
    cfg = dict(train.DEFAULTS, data=None, backend="jax", method="auto", sync_every=1,
               seed=0, overlap=False, exchange_dtype="float32", out=None, resume=None,
               epochs=1, hidden=[256, 128], clip_norm=0.5)
    for flag in flags:
        said = ("as pympgu compiles it" if flag == "pympgu" else
                f"with {flag}" if flag else "with XLA's defaults")
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
                   help="train the clipped MLP RUNS times with each of --flags, comparing "
                        "the ranks' XLA dumps (default: 0, the sums alone)")
    p.add_argument("--gpus", type=int, nargs="+", default=[0, 1],
                   help="--training's ranks, one a GPU index each; repeat one to put "
                        "several ranks on it (default: 0 1)")
    p.add_argument("--flags", nargs="+", metavar="FLAGS",
                   help="--training's XLA_FLAGS to try in turn, each a string: '' for XLA's "
                        "defaults, 'pympgu' for pympgu's own compile of the step "
                        "(pympgu.xla.alike_options) (default: '' then 'pympgu')")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return probe(args.calls)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.training:
        return training(args.training, args.gpus, args.flags or ["", "pympgu"])
    from pympgu.xla import DETERMINISTIC_FLAG
    for flags in ("", DETERMINISTIC_FLAG):
        env = dict(os.environ, XLA_FLAGS=flags)
        subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls)],
                       env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
