"""GPU workers on several "nodes" of one host: the node launcher (run as a script, one per
node) and the workers' functions. NCCL_HOSTID, set per node by the test, makes NCCL treat
the nodes as separate hosts, so that their ranks may share a GPU and meet over sockets.

    python tests/node_targets.py NNODES NODE PORT NLOCAL TARGET ARGS_JSON

prints the run's results (node 0: every rank's) as one JSON line.
"""
import hashlib
import json
import os
import sys

import numpy as np

from runtime_targets import check_bits

LAYOUT = [("w1", [31, 17], "float32"), ("b1", [17], "float32"), ("w2", [17, 5], "float32"),
          ("b2", [5], "float32"), ("big", [(1 << 20) + 3], "float32")]


def ints(rank, k, layout=LAYOUT):
    """Integer-valued inputs: every sum is exact, so every correct average has one value."""
    rng = np.random.default_rng([rank, k])
    return [rng.integers(-64, 64, shape).astype(np.float32) for _, shape, _ in layout]


def mean(k, world, layout=LAYOUT):
    """One node's exchange of every rank's ints: the exact sum, divided once."""
    sums = [np.zeros(shape, np.float32) for _, shape, _ in layout]
    for r in range(world):
        for s, a in zip(sums, ints(r, k, layout)):
            s += a
    return [s / np.float32(world) for s in sums]


def node_rounds(ctx, rounds, method="auto"):
    """Exchange ``rounds`` times across the nodes, by the Python road (even rounds:
    start/finish) and inside XLA (odd rounds: StepExchange.average in a jitted function);
    every result checked bit for bit against one node's exchange; the last digested."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from pympgu import xla
    from pympgu.exchange import Exchanger
    from pympgu.xla import StepExchange
    dev = jax.devices("gpu")[ctx.device]
    digest, roads = None, []
    with Exchanger(ctx, LAYOUT, method=method) as ex:
        step = StepExchange(ex)
        inside = jax.jit(lambda xs: step.average(xs)) if xla.available()[0] else None
        split = jax.jit(lambda flat: [flat[o:o + n].reshape(s) for o, n, (_, s, _) in
                                      zip(ex.offsets, ex.sizes, LAYOUT)])
        for k in range(rounds):
            xs = [jax.device_put(a, dev) for a in ints(ctx.rank, k)]
            if k % 2 == 1 and inside is not None:
                out, road = inside(xs), "xla"
            else:
                ex.start(xs)
                out, road = split(jax.dlpack.from_dlpack(ex.finish(flat=True, wait=False))), \
                    "python"
            roads.append(road)
            check_bits(out, mean(k, ctx.nranks), LAYOUT, f"rank {ctx.rank} round {k} ({road})")
            digest = hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in out)).hexdigest()
    return {"digest": digest, "roads": roads, "node": ctx.node}


def node_forever(ctx, method="auto"):
    """Exchange until stopped (the failure tests kill a rank or a node meanwhile)."""
    import time
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from pympgu.exchange import Exchanger
    dev = jax.devices("gpu")[ctx.device]
    with Exchanger(ctx, LAYOUT, method=method) as ex:
        xs = [jax.device_put(a, dev) for a in ints(ctx.rank, 0)]
        ctx.barrier()
        open(os.path.join(os.environ["PYMPGU_TEST_DIR"], f"{ctx.rank}.pid"), "w").write(
            str(os.getpid()))
        while True:
            ex.start(xs)
            ex.finish()
            time.sleep(0.01)


def main(argv):
    import node_targets  # the workers find the target by this module's name
    nnodes, node, port, nlocal = (int(a) for a in argv[:4])
    target, args = getattr(node_targets, argv[4]), json.loads(argv[5])
    from pympgu.runtime import nodes
    from pympgu.runtime import launch
    where = nodes.resolve(nnodes, node, f"127.0.0.1:{port}")
    results = launch(target, args, gpus=[0] * nlocal, nodes=where,
                     secret=nodes.read_secret(), heartbeat_timeout=60, progress_timeout=60)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
