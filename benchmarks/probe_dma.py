"""What the copy engines carry between two processes through CUDA IPC, as pympgu's ranks run.

    PYTHONPATH=. python benchmarks/probe_dma.py [--mib 1024] [--gpus 0 1]

benchmarks/link_probe.cu times copies with one process driving both GPUs (peer access);
pympgu's exchanges run one process per GPU, each with the other's buffer mapped through an
IPC handle. This times the same copies that way: each rank copies --mib MiB by DMA, pushing
(from its buffer into the peer's) or pulling (from the peer's into its own), one rank alone
or both at once, and prints the median ms and GB/s per direction (bytes / time).

--offsets SRC:DST ... places the source and the destination that many bytes past a 2 MiB
page's start; the allocation is whole pages (docs/DECISIONS.md, "Page-aligned buffers").
"""
import argparse
import multiprocessing as mp
import statistics
import time

PAGE = 2 << 20


def rank_main(rank, gpus, nbytes, offsets, repeats, handles, barrier, results):
    from pympgu import cuda
    cuda.set_device(gpus[rank])
    cuda.enable_peer_access(gpus[1 - rank])
    # The source, then the area the peer pushes into, each starting on a 2 MiB page (as
    # cudaMalloc's large allocations do) with room for the offsets.
    far = -(-(max(max(pair) for pair in offsets) + nbytes) // PAGE) * PAGE
    own = cuda.DeviceBuffer(2 * far)
    handles[rank] = cuda.ipc_get_handle(own)
    barrier.wait()
    peer = cuda.ipc_open_handle(handles[1 - rank])
    rows = {}
    for src, dst in offsets:
        for mode in ("push", "pull"):
            for who in ("one", "both"):
                times = []
                for _ in range(repeats):
                    barrier.wait()
                    if who == "both" or rank == 0:
                        t0 = time.perf_counter()
                        if mode == "push":
                            cuda._memcpy(peer.ptr + far + dst, own.ptr + src, nbytes)
                        else:
                            cuda._memcpy(own.ptr + far + dst, peer.ptr + src, nbytes)
                        times.append(time.perf_counter() - t0)
                if times:
                    rows[(src, dst, mode, who)] = statistics.median(times[1:])
    barrier.wait()
    peer.close()
    own.close()
    results[rank] = rows


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024, help="bytes per copy, MiB (default 1024)")
    p.add_argument("--gpus", type=int, nargs=2, default=[0, 1])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--offsets", nargs="+", default=["0:0"], metavar="SRC:DST",
                   help="bytes past a 2 MiB page's start of the copies' source and "
                        "destination (default 0:0)")
    a = p.parse_args()
    try:
        offsets = [tuple(int(x) for x in pair.split(":")) for pair in a.offsets]
        assert all(len(pair) == 2 and min(pair) >= 0 for pair in offsets)
    except (ValueError, AssertionError):
        p.error(f"--offsets takes SRC:DST pairs of bytes, got {a.offsets}")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        handles, results = m.dict(), m.dict()
        barrier = ctx.Barrier(2, timeout=120)
        procs = [ctx.Process(target=rank_main, args=(r, a.gpus, a.mib << 20, offsets,
                                                     a.repeats, handles, barrier, results))
                 for r in range(2)]
        for q in procs:
            q.start()
        for q in procs:
            q.join(300)
            if q.is_alive():
                q.kill()
        if any(q.exitcode != 0 for q in procs):
            raise SystemExit(f"a rank failed: exit codes {[q.exitcode for q in procs]}")
        results = dict(results)
    print(f"{'copy, across processes (IPC)':30} {'MiB':>5} {'src off':>8} {'dst off':>8} "
          f"{'ms':>7} {'GB/s':>6}")
    for key in results[0]:
        src, dst, mode, who = key
        worst = max(results[r][key] for r in results if key in results[r])
        name = f"{mode}, {'rank 0 alone' if who == 'one' else 'both ranks at once'}"
        print(f"{name:30} {a.mib:5d} {src:8d} {dst:8d} {1e3 * worst:7.3f} "
              f"{(a.mib << 20) / worst / 1e9:6.1f}")


if __name__ == "__main__":
    main()
