"""Benchmark of the exchange: pympgu's algorithms against the seed's copy method and NCCL.

    python -m pympgu.bench --gpus 0 1                 # 4 KiB .. 1 GiB, every method
    python -m pympgu.bench --gpus 0 --procs 4         # 4 ranks sharing one GPU (logic, not speed)
    python -m pympgu.bench --nnodes 2 --gpus 0 1      # across nodes: pympgu.bench.nodes

One process per rank. For each size every method averages an fp32 buffer in place; device
time per exchange comes from CUDA events around back-to-back exchanges (median of several
repeats), so it includes the GPU barrier but not Python. "e2e" is the host's wall time of one
exchange called from Python and waited for, which is what a training step pays. GB/s is
buffer bytes over device time. NCCL is all_reduce(op=AVG) through torch.distributed, run when
torch is importable and every rank has its own GPU. 'resident' (PeerGroup.resident: a kernel
left running, rung from the host) queues nothing on a stream, so its first time is the host's,
per call of back-to-back calls; it takes the sizes 'll' takes.
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

from .. import methods as registry
from .timing import fmt_size, iters_for, parse_size, time_device, time_host

RESIDENT = "resident"  # the resident kernel: LL without a launch a call, a column of its own
METHODS = tuple(n for n, m in registry.REGISTRY.items() if m.selectable and not m.nccl) + (
    RESIDENT,)
DEFAULT_SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20,
                 256 << 20, 1 << 30]


def _time_resident(group, n, blocks, iters=200):
    """The resident exchange, which waits on the host in every call: µs per call over iters
    calls back to back ("us", median of 5 runs), and per call alone ("e2e_us")."""
    with group.resident(blocks) as fast:
        for _ in range(20):
            fast.allreduce(n)
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters):
                fast.allreduce(n)
            runs.append((time.perf_counter() - t0) * 1e6 / iters)
        out = {"us": statistics.median(runs)}
        out.update(time_host(lambda: fast.allreduce(n), lambda: None, iters))
    return out


def columns(methods, blocks):
    """(column name, method, block cap) for every timed combination."""
    return [(m if b is None else f"{m}@{b}", m, b) for b in blocks for m in methods
            if b is None or not _copies(m)]


def _copies(name):
    return name in registry.REGISTRY and registry.REGISTRY[name].peer_copies


def rank_main(rank, nranks, device, sizes, methods, conn, init_file, use_nccl, blocks=(None,)):
    """One rank of the benchmark; rank 0 returns the measurements."""
    import numpy as np

    from pympgu import cuda
    results = []
    group = cuda.PeerGroup(rank, nranks, max(sizes), device=device, timeout=120,
                           staging=True if any(registry.staging(m) for m in methods
                                               if m in registry.REGISTRY) else None)
    try:
        conn.send(("handle", (group.handle, group.sm_count)))
        handles, sms = conn.recv()
        group.connect(handles, max_blocks=min(2 * min(sms), 512))
        rng = np.random.default_rng(rank)
        for nbytes in sizes:
            n = nbytes // 4
            x = rng.standard_normal(n, dtype=np.float32)
            group.data("float32", n).copy_from_host(x)  # random data: never time zeros
            row = {"bytes": nbytes}
            for name, method, cap in columns(methods, blocks):
                limited = method == RESIDENT or registry.REGISTRY[method].limited
                if limited and nbytes > cuda.LL_MAX_BYTES:
                    continue  # beyond its mailboxes: the table shows nan
                if method == RESIDENT:
                    if cap is None or cap <= group.sm_count:
                        row[name] = _time_resident(group, n, cap)
                    continue
                if _copies(method):
                    def run(n=n):
                        group.copy_average(n, "float32", synchronize=False)
                else:
                    def run(n=n, m=method, cap=cap):
                        group.allreduce(n, "float32", algo=m, synchronize=False, max_blocks=cap)
                iters = iters_for(nbytes)
                for _ in range(3):
                    run()
                group.synchronize()
                row[name] = {"us": time_device(run, group.stream, iters)}
                if nbytes <= (1 << 20):
                    row[name].update(time_host(run, group.synchronize, 200))
                if registry.chooses(name):
                    row[name]["algo"] = group.algorithm(nbytes)
            results.append(row)
    finally:
        group.close()
    if use_nccl:
        _nccl(rank, nranks, device, sizes, results, init_file)
    return results if rank == 0 else None


def _nccl(rank, nranks, device, sizes, results, init_file):
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=nranks)
    try:
        stream = torch.cuda.current_stream()
        for row, nbytes in zip(results, sizes):
            t = torch.randn(nbytes // 4, device=f"cuda:{device}")

            def run():
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            row["nccl"] = {"us": time_device(
                run, stream, iters_for(nbytes),
                new_event=lambda: torch.cuda.Event(enable_timing=True))}
            if nbytes <= (1 << 20):
                row["nccl"].update(time_host(run, torch.cuda.synchronize, 200))
    finally:
        dist.destroy_process_group()


def run_ranks(devices, sizes, methods, use_nccl, timeout=1200, blocks=(None,)):
    """Start one process per rank on devices; return rank 0's measurements."""
    import multiprocessing as mp
    import tempfile
    ctx = mp.get_context("spawn")
    nranks = len(devices)
    tmp = tempfile.mkdtemp(prefix="pympgu-bench-")
    init_file = os.path.join(tmp, "nccl-init")
    pipes, procs = [], []
    for rank in range(nranks):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_rank_entry,
                        args=(rank, nranks, devices[rank], sizes, methods, b, init_file, use_nccl,
                              blocks),
                        daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    try:
        first = [_recv(pipe, rank, timeout) for rank, pipe in enumerate(pipes)]
        handles = [h for h, _ in first]
        sms = [s for _, s in first]
        for pipe in pipes:
            pipe.send((handles, sms))
        out = [_recv(pipe, rank, timeout) for rank, pipe in enumerate(pipes)]
        for rank, p in enumerate(procs):
            p.join(60)
            if p.exitcode != 0:
                raise RuntimeError(f"benchmark rank {rank} exited with {p.exitcode}")
        return out[0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        try:
            os.unlink(init_file)
        except FileNotFoundError:
            pass
        os.rmdir(tmp)


def _rank_entry(rank, nranks, device, sizes, methods, conn, init_file, use_nccl, blocks):
    try:
        res = rank_main(rank, nranks, device, sizes, methods, conn, init_file, use_nccl, blocks)
        conn.send(("result", res))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1)


def _recv(pipe, rank, timeout):
    if not pipe.poll(timeout):
        raise RuntimeError(f"benchmark rank {rank} said nothing for {timeout} s")
    kind, value = pipe.recv()
    if kind == "error":
        raise RuntimeError(f"benchmark rank {rank} failed:\n{value}")
    return value


def table(results, methods, blocks=(None,)):
    """The printed table: µs, GB/s and ratio to NCCL's throughput per method and size."""
    methods = [name for name, _, _ in columns(methods, blocks)]
    cols = list(methods) + (["nccl"] if "nccl" in results[0] else [])
    lines = []
    head = f"{'size':>9} |" + "".join(f" {c + ' us':>11} {c + ' GB/s':>10} |" for c in cols)
    if "nccl" in cols:
        head += "".join(f" {c + '/nccl':>12}" for c in methods)
    lines.append(head)
    lines.append("-" * len(head))
    nan = {"us": float("nan")}  # a method that does not take the size ('ll' beyond its own)
    for row in results:
        line = f"{fmt_size(row['bytes']):>9} |"
        for c in cols:
            us = row.get(c, nan)["us"]
            line += f" {us:11.1f} {row['bytes'] / us / 1e3:10.1f} |"
        if "nccl" in cols:
            line += "".join(f" {row['nccl']['us'] / row.get(c, nan)['us']:12.2f}"
                            for c in methods)
        lines.append(line)
    small = [r for r in results if any("e2e_us" in r.get(c, nan) for c in cols)]
    if small:
        lines.append("")
        lines.append("end to end from Python, one exchange waited for, median µs (of which "
                     "the call that queues it):")
        lines.append(f"{'size':>9} |" + "".join(f" {c:>15}" for c in cols))
        for row in small:
            lines.append(f"{fmt_size(row['bytes']):>9} |" + "".join(
                f" {row.get(c, nan).get('e2e_us', nan['us']):7.1f}"
                f" ({row.get(c, nan).get('queue_us', nan['us']):5.1f})" for c in cols))
    auto = [f"{fmt_size(r['bytes'])}:{r['auto']['algo']}" for r in results if "auto" in r]
    if auto:
        lines.append("")
        lines.append("auto chose: " + ", ".join(auto))
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m pympgu.bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=None,
                        help="GPU indexes, one rank each (default: every visible GPU)")
    parser.add_argument("--procs", type=int, default=None,
                        help="number of ranks, spread round-robin over --gpus (default: one "
                             "per GPU); more ranks than GPUs checks logic, not link speed")
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=None,
                        help="buffer sizes such as 4K 64M 1G (default: 4 KiB to 1 GiB)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="pympgu methods to time (default: all)")
    parser.add_argument("--blocks", nargs="+", type=int, default=None, metavar="B",
                        help="also time the kernels with their grid capped at B blocks (column "
                             "'twoshot@B'): what an exchange that leaves SMs to overlapping "
                             "compute costs; 'resident@B' runs B blocks (default: the full "
                             "grid only, and RESIDENT_BLOCKS for 'resident')")
    parser.add_argument("--no-nccl", action="store_true", help="skip the NCCL baseline")
    parser.add_argument("--nnodes", type=int, metavar="N",
                        help="time the exchange across N nodes against flat NCCL instead "
                             "(alone: N nodes as processes of this host; with --node-rank and "
                             "--coordinator, or under Slurm, Open MPI or torchrun: this node)")
    parser.add_argument("--node-rank", type=int, metavar="K", help="this node's rank (0 to N-1)")
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="node 0's address, as every node reaches it")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.blocks and not all(1 <= b <= 512 for b in args.blocks):
        parser.error("--blocks: 1 to 512")

    from pympgu import cuda
    ok, info = cuda.availability()
    if not ok:
        parser.error(f"no usable GPU: {info}")
    gpus = args.gpus if args.gpus is not None else list(range(info))
    for g in gpus:
        if not 0 <= g < info:
            parser.error(f"--gpus: GPU {g} does not exist ({info} visible)")
    if len(set(gpus)) != len(gpus):
        parser.error("--gpus: indexes must be distinct")
    nranks = args.procs or len(gpus)
    across = args.nnodes is not None or args.node_rank is not None or args.coordinator
    if not (1 if across else 2) <= nranks <= 8:
        parser.error(f"the benchmark needs 2 to 8 ranks, got {nranks} (give --procs)")
    devices = [gpus[r % len(gpus)] for r in range(nranks)]
    sizes = args.sizes or DEFAULT_SIZES
    if across:
        from ..runtime import nodes
        from . import nodes as bench_nodes
        where = None  # every node a process of this host
        if (args.node_rank is not None or args.coordinator is not None
                or nodes.from_environment() is not None):
            try:
                where = nodes.resolve(args.nnodes, args.node_rank, args.coordinator)
            except nodes.NodesError as e:
                parser.error(str(e))
        if (where.nnodes if where else args.nnodes or 0) < 2:
            parser.error("--nnodes: 2 or more")
        if where is None:
            return bench_nodes.run_here(args.nnodes, devices, sizes, args.json)
        return bench_nodes.run_node(where, devices, sizes, args.json)
    use_nccl = not args.no_nccl and len(set(devices)) == nranks
    if use_nccl:
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            use_nccl = False
    names = ", ".join(cuda.device_name(d) for d in sorted(set(devices)))
    print(f"pympgu.bench: {nranks} ranks on GPUs {devices} ({names}); fp32; "
          f"NCCL {'on' if use_nccl else 'off'}", flush=True)
    blocks = [None] + (args.blocks or [])
    results = run_ranks(devices, sizes, args.methods, use_nccl, blocks=blocks)
    print(table(results, args.methods, blocks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": devices, "names": names, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
