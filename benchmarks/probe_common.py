"""What the probe scripts share: their common flags, and the replica configuration they
time (the training loop's, with fixed hyperparameters)."""
import argparse


def parser(doc):
    """An argument parser with --gpus, --hidden and --batch-size (the wide MLP by default)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[0, 1])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 4096])
    p.add_argument("--batch-size", type=int, default=1024)
    return p


def replica_config(hidden, batch):
    """pympgu.train's configuration of a JAX replica with the default exchange."""
    return dict(data=None, hidden=hidden, lr=0.05, momentum=0.9, batch_size=batch, l1=0.0,
                l2=1e-4, backend="jax", method="auto", exchange_dtype="float32",
                exchange_blocks=None, overlap=False)
