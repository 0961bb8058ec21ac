"""Test error of each exchange variant against plain per-step averaging, same data and seed.

    python benchmarks/accuracy_variants.py --data-dir fashion --gpus 0 1
    python benchmarks/accuracy_variants.py --data-dir fashion --gpus 0 0   # 2 workers, 1 GPU
    python benchmarks/accuracy_variants.py --data-dir fashion --cpu 2
    python benchmarks/accuracy_variants.py --data-dir fashion --gpus 0 1 --epochs 10 \
        --model examples/lenet.py:LeNet --hidden 500

By default the same runs as tests/test_train.py's CPU check (MLP 784-256-10, batch 128 per
worker, momentum 0.9, 2 epochs), on GPU workers through PyTensor's JAX backend; --model and
--hidden train a model of one's own instead. Speed is not the point here (ranks sharing a
GPU time-slice): accuracy is. Each variant's test error is given at the last epoch and at
the epoch of least validation error (the checkpoint --out keeps as best.npz).
"""
import argparse
import sys

from pympgu import models
from pympgu.training import RunConfig, run

VARIANTS = {"plain": {}, "overlap": dict(overlap=True),
            # On GPU workers the gradients in bfloat16 inside the step; on CPU workers, and
            # with the variants below, each sync's change from Python.
            "bf16 wire": dict(exchange_dtype="bfloat16"),
            "sync every 4": dict(sync_every=4),
            "overlap + bf16": dict(overlap=True, exchange_dtype="bfloat16"),
            "overlap + sync every 4": dict(overlap=True, sync_every=4),
            # Not an exchange variant: --compute-dtype bfloat16 (JAX's backend, CPU workers
            # too), against the same float32 reference.
            "bf16 products": dict(compute_dtype="bfloat16"),
            "bf16 products + overlap + sync every 4": dict(compute_dtype="bfloat16",
                                                           overlap=True, sync_every=4),
            # Nor --ema: the moving average's errors (0.99 spans some 100 of the 468 steps
            # of 2 epochs of Fashion-MNIST on 2 workers).
            "ema 0.99": dict(ema=0.99),
            "ema 0.99 + sync every 4": dict(ema=0.99, sync_every=4)}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="fashion")
    p.add_argument("--gpus", type=int, nargs="+")
    p.add_argument("--cpu", type=int)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--model", default=None, metavar="FILE.py:CLASS",
                   help="a model of one's own, as pympgu.train's --model (default: the MLP)")
    p.add_argument("--hidden", type=int, nargs="+", default=None, metavar="H",
                   help="--hidden, as pympgu.train's (default: 256 for the MLP, a --model's "
                        "default_hidden)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   metavar="NAME", help="the variants to train, quoted, of: " +
                   ", ".join(f"'{v}'" for v in VARIANTS) + " (default: all; 'plain' is "
                   "always trained, as the others' reference)")
    args = p.parse_args()
    devices = [None] * args.cpu if args.cpu else args.gpus
    if not devices:
        p.error("give --gpus or --cpu")
    hidden = args.hidden or (models.load(args.model).default_hidden if args.model else [256])
    base = RunConfig(data=args.data_dir, backend="c" if args.cpu else "jax", epochs=args.epochs,
                     batch_size=128, hidden=hidden, model=args.model, devices=devices)
    errors = {}  # variant: (last epoch's test error, the best validation epoch's, that epoch)
    for name in dict.fromkeys(["plain", *args.variants]):
        over = VARIANTS[name]
        if over.get("compute_dtype", "float32") != "float32":
            over = dict(over, backend="jax")  # PyTensor's own backend: no bfloat16 products
        hist = run(base.replace(**over), quiet=True)
        best = min(hist, key=lambda h: h["valid_error"])
        errors[name] = (hist[-1]["test_error"], best["test_error"], best["epoch"])
    width = max(map(len, errors))
    last0, best0, _ = errors["plain"]
    print(f"{'variant':<{width}} {'test error':>10} {'vs plain':>9}   at the best validation epoch")
    for name, (last, best, epoch) in errors.items():
        print(f"{name:<{width}} {100 * last:9.2f}% {100 * (last - last0):+8.2f}   "
              f"{100 * best:.2f}% {100 * (best - best0):+.2f} (epoch {epoch})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
