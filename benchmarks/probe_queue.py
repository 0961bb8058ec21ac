"""What the host spends to queue and wait for one small exchange, piece by piece, on one GPU.

    PYTHONPATH=. python benchmarks/probe_queue.py [--device 0] [--calls 2000]

The exchange benchmark (python -m pympgu.bench) showed a 4 KiB 'll' exchange taking 5.6 µs
of device time but 14 µs end to end from Python, 6 µs of it before the call returns. This
times, with a group of one rank (so no peer is waited for: the kernel runs alone), the
median host µs of each piece: the Python call that queues the exchange (argument checks,
the algorithm's choice, making the device current, the launch), the choice alone, making
the device current from Python, waiting for an idle stream, and the call waited for.

Then the same exchange through the resident kernel (PeerGroup.resident: no launch, the host
rings a doorbell and polls for the end), and, with torch, what that kernel costs work beside
it while it idles: a bf16 matrix product timed with CUDA events with and without it.
"""
import argparse
import statistics
import time


def median_us(fn, calls, after=None):
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if after is not None:
            after()
    return 1e6 * statistics.median(samples)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    p.add_argument("--calls", type=int, default=2000, help="calls per median (default 2000)")
    p.add_argument("--blocks", type=int, nargs="+", default=None,
                   help="resident kernels' block counts to time (default: RESIDENT_BLOCKS)")
    a = p.parse_args()

    from pympgu import cuda
    group = cuda.PeerGroup(0, 1, 1 << 20, device=a.device)
    try:
        group.connect([group.handle])
        n = 1024  # 4 KiB of float32
        sync = group.synchronize
        rows = [
            ("allreduce(4 KiB, 'll'), queued", lambda: group.allreduce(n, algo="ll",
                                                                       synchronize=False), sync),
            ("allreduce(4 KiB, 'auto'), queued", lambda: group.allreduce(n, synchronize=False),
             sync),
            ("the same, waited for", lambda: group.allreduce(n, algo="ll"), None),
            ("group.algorithm(4 KiB)", lambda: group.algorithm(4096), None),
            ("cuda.set_device", lambda: cuda.set_device(a.device), None),
            ("synchronize an idle stream", sync, None),
        ]
        for _, fn, after in rows:  # warm up
            for _ in range(50):
                fn()
                if after is not None:
                    after()
        print(f"host µs, median of {a.calls} calls, GPU {a.device}, one rank:")
        for name, fn, after in rows:
            print(f"  {name:36s} {median_us(fn, a.calls, after):7.2f}")
        blocks = a.blocks or [cuda.RESIDENT_BLOCKS]
        for b in blocks:
            with group.resident(b) as fast:
                for _ in range(50):
                    fast.allreduce(n)
                us = median_us(lambda: fast.allreduce(n), a.calls)
            print(f"  {f'resident @{b}, allreduce(4 KiB)':36s} {us:7.2f}")
        matmul_beside(group, a.device, blocks)
    finally:
        group.close()


def matmul_beside(group, device, blocks):
    """ms of an 8192^3 bf16 matrix product, median of 20, beside an idle resident kernel of
    each block count, and alone."""
    try:
        import torch
    except ImportError:
        print("  (no torch: the resident kernel's cost to other work is not measured)")
        return
    torch.cuda.set_device(device)
    x = torch.randn(8192, 8192, device=f"cuda:{device}", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def median_ms():
        samples = []
        for _ in range(20):
            start.record()
            x @ x
            end.record()
            end.synchronize()  # not torch.cuda.synchronize(): that waits for the kernel too
            samples.append(start.elapsed_time(end))
        return statistics.median(samples)
    median_ms()  # warm-up: cuBLAS's workspace and the output's memory come from here
    # A long run of products holds the GPU's clock down for power, so each kernel's row is
    # timed between two of the product alone, and compared with their mean.
    print("ms of an 8192^3 bf16 matmul, median of 20, beside an idle resident kernel, and "
          "alone just before and after:")
    for b in blocks:
        before = median_ms()
        with group.resident(b):
            ms = median_ms()
        after = median_ms()
        print(f"  {f'@{b}':6s} {ms:7.3f}  alone {before:.3f} / {after:.3f}"
              f"  ({ms / ((before + after) / 2) - 1:+.1%})")


if __name__ == "__main__":
    main()
