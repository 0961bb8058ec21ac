"""pympgu's benchmarks, which print tables (speed is measured here, never by tests).

    python -m pympgu.bench --gpus 0 1         # the exchange, 4 KiB to 1 GiB, against NCCL
    python -m pympgu.bench exchange --gpus 0 1  # the same
    python -m pympgu.bench train --gpus 0 1   # training samples/s and scaling against DDP
    python -m pympgu.bench kills --cpu 4      # training on through killed workers

Modules: exchange (the exchange benchmark), train (the training benchmark's rows and
table), steps (pympgu's timed workers), torch_ddp (the PyTorch twins and DDP's ranks),
timing and clocks (device and host time, and the SM clock a row ran at), kills (training
that goes on without lost workers).
"""
import sys


def main(argv=None):
    """``python -m pympgu.bench [exchange|train|kills] ...``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "exchange":
        argv = argv[1:]
    if argv and argv[0] == "train":
        from .train import main as train
        return train(argv[1:])
    if argv and argv[0] == "kills":
        from .kills import main as kills
        return kills(argv[1:])
    from .exchange import main as exchange
    return exchange(argv)
