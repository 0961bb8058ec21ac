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


def replica_config(hidden, batch, devices=(0, 1)):
    """The RunConfig of a JAX replica with the default exchange: the training benchmark's
    wide MLP (pympgu.bench.train.MODELS), with these layers and batch."""
    from pympgu.bench.train import MODELS
    from pympgu.training import RunConfig
    return RunConfig(**dict(MODELS["wide"], hidden=hidden, batch_size=batch, backend="jax",
                            devices=devices))
