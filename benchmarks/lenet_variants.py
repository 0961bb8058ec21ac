"""Test error of examples/lenet.py trained on 2 ranks by each exchange variant, on the same
data and seed, against plain per-step averaging: the accuracy half of issue #5 for a convnet.

    python3 benchmarks/lenet_variants.py [--gpus 0 1 | --cpu 2] [--data-dir fashion] [--epochs 10]

--gpus may repeat an index (ranks sharing one GPU: the same arithmetic, slower). Prints one
line per variant: the best validation epoch's test error and the last epoch's.
"""
import argparse

from pympgu import train

VARIANTS = {"sync1": {}, "overlap": dict(overlap=True), "sync4": dict(sync_every=4),
            "overlap4": dict(overlap=True, sync_every=4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--cpu", type=int, default=None, metavar="N", help="N CPU workers instead")
    ap.add_argument("--data-dir", default="fashion")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = ap.parse_args()
    base = dict(train.DEFAULTS, data=args.data_dir, backend="jax", method="auto", seed=0,
                sync_every=1, overlap=False, exchange_dtype="float32", out=None, resume=None,
                epochs=args.epochs, model="examples/lenet.py:LeNet", hidden=[500])
    for name in args.variants:
        devices = [None] * args.cpu if args.cpu else list(args.gpus)
        hist = train.run(dict(base, **VARIANTS[name]), devices, quiet=True)
        best = min(hist, key=lambda h: h["valid_error"])
        print(f"{name:<9} best epoch {best['epoch']:>2}: test {100 * best['test_error']:.2f}%  "
              f"last epoch: test {100 * hist[-1]['test_error']:.2f}%  "
              f"{hist[-1]['samples_per_s']:.0f} samples/s", flush=True)


if __name__ == "__main__":
    main()
