"""Timing for the benchmarks: sizes as flags, device time from CUDA events, host time."""
import argparse
import statistics
import time


def parse_size(text):
    """A buffer size such as 4K, 64MiB or 1g, in bytes: argparse's type for --sizes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        n = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4K, 64M or 1G") \
            from None
    if n < 4:  # one float32 at least
        raise argparse.ArgumentTypeError(f"{text!r}: a buffer of at least 4 bytes")
    return n


def fmt_size(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def iters_for(nbytes):
    return int(max(5, min(200, (2 << 30) // max(nbytes, 1))))


def time_device(run, stream, iters, repeats=5, new_event=None):
    """Median device µs of one call of run(), from events around iters back-to-back calls.

    Events are pympgu's by default; new_event() may make another framework's (torch's), for
    work queued on that framework's stream.
    """
    if new_event is None:
        from pympgu import cuda
        new_event = cuda.Event
    samples = []
    for _ in range(repeats):
        start, end = new_event(), new_event()
        start.record(stream)
        for _ in range(iters):
            run()
        end.record(stream)
        end.synchronize()
        ms = start.elapsed_ms(end) if hasattr(start, "elapsed_ms") else start.elapsed_time(end)
        samples.append(ms * 1000 / iters)
    return statistics.median(samples)


def time_host(run, sync, iters):
    """Median host µs of one call of run() waited for by sync() ("e2e_us"), and of the
    call alone ("queue_us": what the host spends before it can wait)."""
    e2e, queued = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
        sync()
        e2e.append((time.perf_counter() - t0) * 1e6)
        queued.append((t1 - t0) * 1e6)
    return {"e2e_us": statistics.median(e2e), "queue_us": statistics.median(queued)}
