"""``python -m pympgu.train`` with two workers on each GPU of --gpus (the command itself
refuses a GPU named twice). Where one GPU is lent this stands for a node of two GPUs:
it checks the logic of several GPU workers a node, bit for bit, and times nothing.

    python benchmarks/two_on_one_gpu.py --gpus 0 --epochs 1
"""
import sys

from pympgu.training import cli

_devices = cli._devices


def _twice(args, parser):
    devices, note = _devices(args, parser)
    return [d for d in devices for _ in range(2)], note


if __name__ == "__main__":
    cli._devices = _twice
    sys.exit(cli.main())
