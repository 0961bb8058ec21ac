"""Test error of each exchange variant against plain per-step averaging, same data and seed.

    python benchmarks/accuracy_variants.py --data-dir fashion --gpus 0 1
    python benchmarks/accuracy_variants.py --data-dir fashion --gpus 0 0   # 2 workers, 1 GPU
    python benchmarks/accuracy_variants.py --data-dir fashion --cpu 2

The same runs as tests/test_train.py's CPU check (MLP 784-256-10, batch 128 per worker,
momentum 0.9, 2 epochs), on GPU workers through PyTensor's JAX backend. Speed is not the
point here (ranks sharing a GPU time-slice): accuracy is.
"""
import argparse
import sys

from pympgu import train

VARIANTS = {"plain": {}, "overlap": dict(overlap=True),
            # GPU workers average inside the step's XLA call; this is the exchange queued
            # from Python instead (on CPU workers, the same as "overlap").
            "overlap, from Python": dict(overlap=True, xla_exchange=False),
            "bf16 wire": dict(exchange_dtype="bfloat16"),
            "sync every 4": dict(sync_every=4),
            "overlap + bf16": dict(overlap=True, exchange_dtype="bfloat16"),
            "overlap + sync every 4": dict(overlap=True, sync_every=4),
            "overlap + sync every 4, from Python": dict(overlap=True, sync_every=4,
                                                        xla_exchange=False)}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="fashion")
    p.add_argument("--gpus", type=int, nargs="+")
    p.add_argument("--cpu", type=int)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   metavar="NAME", help="the variants to train, quoted, of: " +
                   ", ".join(f"'{v}'" for v in VARIANTS) + " (default: all; 'plain' is "
                   "always trained, as the others' reference)")
    args = p.parse_args()
    devices = [None] * args.cpu if args.cpu else args.gpus
    if not devices:
        p.error("give --gpus or --cpu")
    base = dict(train.DEFAULTS, data=args.data_dir, backend="c" if args.cpu else "jax",
                method="auto", seed=0, out=None, resume=None, epochs=args.epochs,
                batch_size=128, hidden=[256], sync_every=1, overlap=False,
                exchange_dtype="float32", devices=devices)
    errors = {}
    for name in dict.fromkeys(["plain", *args.variants]):
        over = VARIANTS[name]
        hist = train.run(dict(base, **over), devices, quiet=True)
        errors[name] = hist[-1]["test_error"]
    width = max(map(len, errors))
    print(f"{'variant':<{width}} {'test error':>10} {'vs plain':>9}")
    for name, err in errors.items():
        print(f"{name:<{width}} {100 * err:9.2f}% {100 * (err - errors['plain']):+8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
