"""Benchmark of the exchange across nodes: pympgu's hierarchy (its kernels inside each node,
NCCL between nodes) against flat NCCL (every rank in one communicator) on the same ranks.

    python -m pympgu.bench --nnodes 2 --gpus 0 1        # 2 "nodes" of this host
    python -m pympgu.bench --nnodes 2 --node-rank K --coordinator HOST:PORT --gpus 0 1

Without --node-rank and --coordinator the nodes are processes of this host, each of which
NCCL takes for a host of its own (NCCL_HOSTID), meeting over loopback sockets: that shows
correctness and overhead, not a network's speed. On several machines, start one per node
(or under Slurm, Open MPI or torchrun, without the three flags) with PYMPGU_SECRET set.
Every exchange is checked: every rank of every node ends with the same bits.
"""
import hashlib
import json
import os
import secrets
import subprocess
import sys

from .timing import fmt_size, iters_for, time_device, time_host

ROADS = ("hierarchy", "flat")


def bench_rank(ctx, sizes, flat=True):
    """One rank: time both roads (the hierarchy alone without ``flat``) at every size; rank
    0 returns the rows."""
    import numpy as np

    from ..exchange import Exchanger
    n_max = max(sizes) // 4
    rows = []
    rng = np.random.default_rng(ctx.rank)
    exchangers = {"hierarchy": Exchanger(ctx, [("x", [n_max], "float32")], timeout=120)}
    try:
        if flat:
            exchangers["flat"] = Exchanger(ctx, [("x", [n_max], "float32")], method="nccl",
                                           timeout=120)
        for nbytes in sizes:
            n = nbytes // 4
            row = {"bytes": nbytes}
            for road, ex in exchangers.items():
                group = ex.backend.group
                group.data("float32", n).copy_from_host(
                    rng.integers(-64, 64, n).astype(np.float32))

                def run(group=group, n=n):
                    group.allreduce(n, "float32", synchronize=False)
                run()
                group.synchronize()
                # The check: one digest a rank, alike on every rank of every node.
                digest = hashlib.sha256(group.data("float32", n).copy_to_host().tobytes())
                digests = ctx.gather(digest.hexdigest())
                if len(set(digests)) != 1:
                    raise AssertionError(f"{road} at {fmt_size(nbytes)}: the ranks differ")
                ctx.barrier()
                row[road] = {"us": time_device(run, group.stream, iters_for(nbytes))}
                if nbytes <= (1 << 20):
                    row[road].update(time_host(run, group.synchronize, 100))
                ctx.barrier()
            rows.append(row)
    finally:
        for ex in exchangers.values():
            ex.close()
    return rows if ctx.rank == 0 else None


def table(rows):
    roads = [r for r in ROADS if r in rows[0]]
    lines = []
    head = f"{'size':>9} |" + "".join(f" {r + ' us':>13} {r + ' GB/s':>12} |" for r in roads)
    if "flat" in roads:
        head += f" {'flat/hierarchy':>15}"
    lines.append(head)
    lines.append("-" * len(head))
    for row in rows:
        line = f"{fmt_size(row['bytes']):>9} |"
        for r in roads:
            us = row[r]["us"]
            line += f" {us:13.1f} {row['bytes'] / us / 1e3:12.1f} |"
        if "flat" in roads:
            line += f" {row['flat']['us'] / row['hierarchy']['us']:15.2f}"
        lines.append(line)
    small = [r for r in rows if "e2e_us" in r["hierarchy"]]
    if small:
        lines.append("")
        lines.append("end to end from Python, one exchange waited for, median µs:")
        lines.append(f"{'size':>9} |" + "".join(f" {r:>10}" for r in roads))
        for row in small:
            lines.append(f"{fmt_size(row['bytes']):>9} |" +
                         "".join(f" {row[r]['e2e_us']:10.1f}" for r in roads))
    if "flat" not in roads:
        lines.append("")
        lines.append("flat NCCL not timed: ranks of a node share a GPU, which NCCL refuses")
    return "\n".join(lines)


def run_node(where, devices, sizes, json_path=None):
    """This node's part; node 0 prints the table."""
    from ..runtime import nodes
    from ..runtime import launch
    secret = nodes.read_secret()
    if secret is None:
        raise SystemExit(f"pympgu.bench: {nodes.SECRET_ENV} must hold the run's secret on "
                         "every node (openssl rand -hex 32)")
    # NCCL refuses two ranks of one host on one GPU: the flat road needs a GPU a rank.
    flat = len(set(devices)) == len(devices)
    results = launch(bench_rank, (sizes, flat), gpus=devices, nodes=where, secret=secret,
                     progress_timeout=1200)
    if where.node_rank == 0:
        rows = results[0]
        print(table(rows), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"nnodes": where.nnodes, "devices": devices, "results": rows}, f,
                          indent=1)
    return 0


def _free_port():
    """A loopback port free for node 0's coordinator: one kernel-chosen port."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_here(nnodes, devices, sizes, json_path=None, port=None):
    """Every node as a process of this host, NCCL_HOSTID apart."""
    port = port or _free_port()
    env = dict(os.environ, PYMPGU_SECRET=secrets.token_hex(32), NCCL_SOCKET_IFNAME="lo",
               NCCL_IB_DISABLE="1")
    procs = []
    try:
        for k in range(nnodes):
            argv = [sys.executable, "-m", "pympgu.bench", "--nnodes", str(nnodes),
                    "--node-rank", str(k), "--coordinator", f"127.0.0.1:{port}",
                    "--gpus", *map(str, dict.fromkeys(devices)), "--procs", str(len(devices)),
                    "--sizes", *map(str, sizes)]
            if json_path and k == 0:
                argv += ["--json", json_path]
            procs.append(subprocess.Popen(argv, env=dict(env, NCCL_HOSTID=f"pympgu-node-{k}"),
                                          stdout=None if k == 0 else subprocess.DEVNULL))
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [k for k, c in enumerate(codes) if c]
    if bad:
        print(f"pympgu.bench: node(s) {bad} failed (exit {[codes[k] for k in bad]})",
              file=sys.stderr)
        return 1
    return 0
