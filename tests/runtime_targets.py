"""Worker functions for the runtime tests (spawned children import them from here)."""
import hashlib
import os
import signal
import time

import numpy as np

from reference import model_average

LAYOUT = [("w1", [31, 17], "float32"), ("b1", [17], "float32"), ("w2", [17, 5], "float32"),
          ("b2", [5], "float32")]


def rank_params(rank, round_, layout=LAYOUT):
    rng = np.random.default_rng([rank, round_])
    return [rng.standard_normal(shape).astype(dtype) for _, shape, dtype in layout]


def average_rounds(ctx, rounds, pid_dir=None, fail=None, layout=None):
    """Exchange `rounds` times; check each result against the exact model; digest the last.

    fail = (rank, round, how) makes that rank 'raise', 'kill' itself or 'hang' at that round.
    """
    from pympgu.exchange import Exchanger
    if pid_dir:
        open(os.path.join(pid_dir, f"{ctx.rank}.pid"), "w").write(str(os.getpid()))
    layout = layout or LAYOUT
    if layout == "mismatch":
        layout = LAYOUT[:-1] + [("b2", [6] if ctx.rank == 1 else [5], "float32")]
    with Exchanger(ctx, layout) as ex:
        digest = None
        for k in range(rounds):
            if fail and fail[0] == ctx.rank and fail[1] == k:
                if fail[2] == "raise":
                    raise ValueError(f"boom at round {k}")
                if fail[2] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fail[2] == "hang":
                    time.sleep(3600)
            mine = rank_params(ctx.rank, k, layout)
            out = ex.average_arrays(mine)
            for t, got in enumerate(out):
                expected = model_average(
                    [rank_params(r, k, layout)[t].ravel() for r in range(ctx.nranks)], "float32")
                if not np.array_equal(got.ravel(), expected):
                    raise AssertionError(f"rank {ctx.rank} round {k} tensor {t} is wrong")
            digest = hashlib.sha256(b"".join(a.tobytes() for a in out)).hexdigest()
            ctx.metric(round=k)
        return {"digest": digest, "stats": ex.stats}


def attack_then_average(ctx, rounds):
    """Rank 0 first throws junk at the coordinator's port: raw bytes, a wrong token, a
    truncated message and a payload that is not JSON; then everyone exchanges as usual."""
    import socket
    import time

    import zmq
    if ctx.rank == 0:
        host, port = ctx.link.address.rsplit("/", 1)[-1].split(":")
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(256))
        zctx = zmq.Context()
        d = zctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 1000)
        d.connect(ctx.link.address)
        d.send_multipart([b"wrong-token", b"HELLO", b"{}", b"x"])
        d.send_multipart([b"x"])
        d.send_multipart([ctx.token.encode(), b"METRIC", b"{not json", b""])
        time.sleep(0.2)
        d.close()
        zctx.term()
    return average_rounds(ctx, rounds)


def average_rounds_gpu(ctx, rounds):
    """GPU workers: parameters as torch CUDA tensors, exchanged through the runtime."""
    import torch

    from pympgu.exchange import Exchanger
    torch.cuda.set_device(ctx.device)
    with Exchanger(ctx, LAYOUT) as ex:
        digest = None
        for k in range(rounds):
            mine = [torch.from_numpy(a).cuda() for a in rank_params(ctx.rank, k)]
            out = [v.copy_to_host() for v in ex.average_arrays(mine)]
            for t, got in enumerate(out):
                expected = model_average(
                    [rank_params(r, k)[t].ravel() for r in range(ctx.nranks)], "float32")
                if not np.array_equal(got.ravel(), expected):
                    raise AssertionError(f"rank {ctx.rank} round {k} tensor {t} is wrong")
            digest = hashlib.sha256(b"".join(a.tobytes() for a in out)).hexdigest()
        return {"digest": digest, "stats": ex.stats}
