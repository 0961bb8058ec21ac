"""Two nodes of CPU workers on this host, every way of meeting between them: the final test
error and the bytes each node sends between nodes a epoch, in a table.

    python benchmarks/across_nodes.py --data-dir /usr/share/datasets/fashion-mnist

Each row is one run of two launchers on loopback (--nnodes 2), ``--cpu 2`` each (``--gpu``:
two GPU workers a node sharing GPU 0, NCCL taking the nodes for two hosts): exact
every step, and every H steps plain (local SGD), by DiLoCo's outer step or by EASGD's
elastic pull. Loopback is no slow link: the table shows what crosses and what it costs in
accuracy; its time is a slow link's only with ``--link-rate`` (root: loopback's bandwidth
held to that rate by tc's token bucket for the benchmark's length; no added latency)."""
import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile

import pympgu
from pympgu.runtime import cores


def _port():
    with socket.socket() as a:
        a.bind(("127.0.0.1", 0))
        return a.getsockname()[1]


@contextlib.contextmanager
def shaped(rate):
    """Loopback held to ``rate`` (tc's units: 1gbit, 100mbit) while inside; None: as it is."""
    if rate is None:
        yield
        return
    now = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    if now.returncode or "noqueue" not in now.stdout.split("\n")[0]:
        raise SystemExit(f"--link-rate: loopback's queue is not tc's default "
                         f"({now.stdout.strip() or now.stderr.strip()}); left as it is")
    # A burst of at least a loopback packet (64 KiB) and a tick's worth at the rate.
    add = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                          "burst", "1mb", "latency", "200ms"], capture_output=True, text=True)
    if add.returncode:
        raise SystemExit(f"--link-rate needs tc and the right to change loopback's queue "
                         f"(root): {add.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)


def run(args, out, flags):
    """One run of two nodes; node 0's metrics.jsonl records."""
    port = _port()
    # The shared-GPU script imports pympgu from where this benchmark found it.
    home = os.path.dirname(os.path.dirname(pympgu.__file__))
    env = dict(os.environ, PYMPGU_SECRET=os.urandom(16).hex(),
               PYTHONPATH=os.pathsep.join([home, os.environ.get("PYTHONPATH", "")]))
    shared = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_on_one_gpu.py")
    workers = [shared, "--gpus", "0"] if args.gpu else ["-m", "pympgu.train", "--cpu", "2"]
    base = [sys.executable, *workers, "--nnodes", "2",
            "--coordinator", f"127.0.0.1:{port}", "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--quiet", *args.more, *flags]
    if args.data_dir:
        base += ["--data-dir", args.data_dir]
    procs = [subprocess.Popen(base + ["--node-rank", str(k)] + (["--out", out] if k == 0
                                                                 else []),
                              env=dict(env, **_node_env(k)) if args.gpu else env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=None if args.gpu else cores.on_one_host(2, k))
             for k in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=3600)
        if p.returncode:
            raise RuntimeError(f"{flags}: status {p.returncode}\n{err[-2000:]}")
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def _node_env(k):
    """Node k's NCCL: a host of its own (the every-step row), met over loopback."""
    return {"NCCL_HOSTID": f"pympgu-bench-node-{k}", "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_IB_DISABLE": "1"}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--every", type=int, nargs="+", default=[10, 50, 200], metavar="H")
    p.add_argument("--ways", nargs="+", default=["average", "diloco", "easgd"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"],
                   help="what DiLoCo and EASGD send, at each H")
    p.add_argument("--overlaps", type=int, nargs="+", default=[0], metavar="T",
                   help="DiLoCo's and EASGD's --outer-overlap, each a row (0: blocking)")
    p.add_argument("--link-rate", metavar="RATE",
                   help="hold loopback to RATE (tc's units: 1gbit, 100mbit) while the runs "
                        "last (root); default: as fast as loopback goes")
    p.add_argument("--no-baseline", action="store_true",
                   help="leave out the every-step row (the fewer-bytes column then has none)")
    p.add_argument("--gpu", action="store_true",
                   help="two GPU workers a node, both on GPU 0 (the logic's bits, not NVLink's "
                        "time); NCCL's bytes every step are not counted")
    p.add_argument("--more", nargs=argparse.REMAINDER, default=[],
                   help="more flags for pympgu.train (a --model, say)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pympgu-across-") as tmp, shaped(args.link_rate):
        plans = [] if args.no_baseline else [("every-step", None, "float32", 0)]
        plans += [(w, h, d, t) for h in args.every for w in args.ways
                  for d in (["float32"] if w == "average" else args.dtypes)
                  for t in ([0] if w == "average" else args.overlaps)]
        for k, (way, h, dtype, overlap) in enumerate(plans):
            flags = [] if h is None else ["--across-nodes", way, "--outer-every", str(h)]
            if dtype != "float32":
                flags += ["--outer-dtype", dtype]
            if overlap:
                flags += ["--outer-overlap", str(overlap)]
            records = run(args, os.path.join(tmp, str(k)), flags)
            last = records[-1]
            # (None: NCCL's, every step on GPUs, which no record counts)
            sent = [r.get("between_nodes_bytes") for r in records]
            per_epoch = None if None in sent else sum(sent) / len(sent)
            # The epochs after the first (which compiles).
            seconds = sum(r["time_s"] for r in records[1:]) / max(1, len(records) - 1)
            rows.append((way, h, dtype, overlap, last["test_error"], per_epoch,
                         records[-1]["loss"], seconds))
            print(f"{way} H={h} {dtype} overlap {overlap}: test error "
                  f"{100 * last['test_error']:.2f}%, {_mib(per_epoch)} MiB a node a "
                  f"epoch, {seconds:.2f} s an epoch", flush=True)
    base = None if args.no_baseline else rows[0][5]
    print("\n| between nodes | H | on the wire | overlap | test error | MiB a node an epoch "
          "| fewer bytes | last loss | s an epoch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for way, h, dtype, overlap, err, b, loss, seconds in rows:
        print(f"| {way} | {h or 1} | {dtype} | {overlap} | {100 * err:.2f}% | "
              f"{_mib(b)} | {f'{base / b:.0f}x' if base and b else '-'} | {loss:.4f} | "
              f"{seconds:.2f} |")


def _mib(b):
    return "-" if b is None else f"{b / 2 ** 20:.2f}"


if __name__ == "__main__":
    main()
