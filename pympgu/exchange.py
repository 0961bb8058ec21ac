"""The Exchanger: averages a worker's parameter arrays with every other worker's.

Each worker owns one shared staging buffer holding all its parameters back to back (each
starting on a 256-byte boundary). An exchange is three steps, each one pass over the
parameters:

1. ``pack``: copy the parameters into the staging buffer (GPU: one multi-tensor launch);
2. ``average``: average every rank's staging buffer in place (GPU: the fused kernel with its
   GPU barrier; CPU: each rank averages its 1/R slice with the host kernel and writes it into
   every rank's buffer, between two host barriers);
3. ``unpack``: hand the result back. On the CPU these are new numpy arrays. On the GPU they
   are DeviceArray views of the staging buffer, valid until the next ``pack``; the caller
   imports them into its framework and copies them there (``jax.dlpack`` then a copy), so
   results only ever reach a framework through DLPack and never by writing into memory the
   framework owns.

Layouts (names, shapes, dtypes) must be identical on every rank; the launcher compares them
before any training and names both layouts if they differ.
"""
import math
import os
import time
import warnings

import numpy as np

from . import _host, shm

ALIGN_BYTES = 256
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
METHODS = ("auto", "oneshot", "twoshot", "copy")


def plan_layout(layout):
    """Element offsets of each entry (256-byte aligned) and the total element count."""
    dtypes = {d for _, _, d in layout}
    if len(dtypes) != 1:
        raise ValueError(f"an Exchanger averages one dtype; the layout has {sorted(dtypes)}")
    dtype = dtypes.pop()
    if dtype not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype!r}: float32, float16 or bfloat16")
    step = ALIGN_BYTES // ITEMSIZE[dtype]
    offsets, total = [], 0
    for _, shape, _ in layout:
        offsets.append(total)
        size = math.prod(shape)
        total += -(-size // step) * step
    return offsets, total, dtype


class Exchanger:
    """Averages a fixed list of parameter arrays across every worker of a run.

    ``layout`` is a list of (name, shape, dtype); ``method`` is 'auto', 'oneshot', 'twoshot'
    or 'copy' (the seed's peer-copy method) and only matters on GPUs. The counters in
    ``stats`` add up the seconds spent in each step and the number of exchanges.
    """

    def __init__(self, ctx, layout, method="auto", timeout=60.0):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.ctx = ctx
        self.layout = [(str(n), [int(s) for s in shape], str(d)) for n, shape, d in layout]
        self.offsets, self.total, self.dtype = plan_layout(self.layout)
        self.sizes = [math.prod(shape) for _, shape, _ in self.layout]
        self.method = method
        self.stats = {"pack_s": 0.0, "average_s": 0.0, "unpack_s": 0.0, "exchanges": 0}
        # Passes over the parameters per exchange besides the average itself.
        self.extra_passes = {"pack": 1, "unpack": 1}
        backend = _HostBackend if ctx.is_cpu else _CudaBackend
        self.backend = backend(self, timeout)

    @property
    def nbytes(self):
        return self.total * ITEMSIZE[self.dtype]

    def pack(self, arrays):
        """Copy this rank's current parameter arrays into the staging buffer."""
        if len(arrays) != len(self.layout):
            raise ValueError(f"pack got {len(arrays)} arrays for a layout of {len(self.layout)}")
        t0 = time.perf_counter()
        self.backend.pack(arrays)
        self.stats["pack_s"] += time.perf_counter() - t0

    def average(self):
        """Average the staging buffers of all ranks in place; every rank must call it."""
        t0 = time.perf_counter()
        self.backend.average()
        self.stats["average_s"] += time.perf_counter() - t0
        self.stats["exchanges"] += 1

    def unpack(self):
        """The averaged parameters: numpy arrays (CPU) or DeviceArray views (GPU)."""
        t0 = time.perf_counter()
        out = self.backend.unpack()
        self.stats["unpack_s"] += time.perf_counter() - t0
        return out

    def average_arrays(self, arrays):
        """pack, average and unpack in one call."""
        self.pack(arrays)
        self.average()
        return self.unpack()

    def close(self):
        """Release the staging buffer and every peer mapping; calling it again does nothing."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _HostBackend:
    """CPU workers: staging buffers in POSIX shared memory, averaged by the host kernel."""

    def __init__(self, ex, timeout):
        ctx = self.ctx = ex.ctx
        self.ex = ex
        nbytes = ex.nbytes
        self.storage = np.uint16 if ex.dtype == "bfloat16" else np.dtype(ex.dtype)
        name = shm.segment_name(ctx.token, ctx.rank)
        self.segments = []
        self.own = shm.Segment(name, nbytes, create=True)
        try:
            _, blobs, _ = ctx.register(ex.layout, {"pid": os.getpid()}, name.encode())
            for r, blob in enumerate(blobs):
                seg = self.own if r == ctx.rank else shm.Segment(blob.decode(), nbytes, create=False)
                self.segments.append(seg)
        except BaseException:
            self.close()
            raise
        self.arrays = [np.frombuffer(s.buffer, dtype=self.storage, count=ex.total)
                       for s in self.segments]
        chunk = -(-ex.total // ctx.nranks)
        self.lo = min(ex.total, ctx.rank * chunk)
        self.hi = min(ex.total, self.lo + chunk)

    def pack(self, arrays):
        own = self.arrays[self.ctx.rank]
        for (name, shape, _), off, size, a in zip(self.ex.layout, self.ex.offsets, self.ex.sizes, arrays):
            a = np.asarray(a)
            if a.size != size:
                raise ValueError(f"parameter {name!r} has {a.size} elements, layout says {size}")
            own[off:off + size] = a.reshape(-1)

    def average(self):
        rank, lo, hi = self.ctx.rank, self.lo, self.hi
        self.ctx.barrier()  # every rank has packed
        mine = self.arrays[rank][lo:hi]
        _host.host_average([a[lo:hi] for a in self.arrays], mine, dtype=self.ex.dtype)
        for r, a in enumerate(self.arrays):
            if r != rank:
                a[lo:hi] = mine
        self.ctx.barrier()  # every slice has reached every rank

    def unpack(self):
        own = self.arrays[self.ctx.rank]
        return [own[off:off + size].reshape(shape).copy()
                for (_, shape, _), off, size in zip(self.ex.layout, self.ex.offsets, self.ex.sizes)]

    def close(self):
        self.arrays = []  # drop the numpy views first, or the mappings cannot close
        for seg in self.segments:
            if seg is not self.own:
                seg.close()
        self.segments = []
        self.own.close()


class _CudaBackend:
    """GPU workers: a PeerGroup buffer shared through CUDA IPC, averaged by the fused kernel."""

    def __init__(self, ex, timeout):
        from . import cuda
        self.cuda = cuda
        ctx = self.ctx = ex.ctx
        self.ex = ex
        self.group = cuda.PeerGroup(ctx.rank, ctx.nranks, ex.nbytes, device=ctx.device,
                                    timeout=timeout)
        try:
            facts = {"device": ctx.device, "sm_count": self.group.sm_count, "pid": os.getpid()}
            all_facts, blobs, max_blocks = ctx.register(ex.layout, facts, self.group.handle)
            devices = [f["device"] for f in all_facts]
            self.peer_ok = all(d == ctx.device or cuda.can_access_peer(ctx.device, d)
                               for d in devices)
            if not self.peer_ok:
                warnings.warn(f"rank {ctx.rank}: GPU {ctx.device} has no peer access to every "
                              f"GPU of {devices}; falling back to the copy method with host "
                              "barriers", RuntimeWarning)
            self.group.connect(blobs, max_blocks=max_blocks)
            # Padding between parameters is averaged too: give it defined contents.
            self.group.data("uint8").fill_bytes(0)
            self.table = cuda.TensorTable(len(ex.layout), 1, ex.dtype)
        except BaseException:
            self.group.close()
            raise

    def pack(self, arrays):
        itemsize = ITEMSIZE[self.ex.dtype]
        base = self.group.data_ptr
        entries, keep = [], []
        for (name, _, dtype), off, size, a in zip(self.ex.layout, self.ex.offsets, self.ex.sizes, arrays):
            if hasattr(a, "block_until_ready"):
                a.block_until_ready()  # JAX computes asynchronously on its own streams
            info = self.cuda.array_info(a, f"parameter {name!r}")
            if info.size != size or info.dtype != dtype:
                raise ValueError(f"parameter {name!r} is {info.size} {info.dtype} elements, "
                                 f"the layout says {size} {dtype}")
            keep.append(info)
            entries.append(((info.ptr,), base + off * itemsize, size))
        self.table.set(entries)
        self.table.launch(self.group.stream)
        self.group.synchronize()  # the arrays may be freed by their owner once we return

    def average(self):
        n, dtype, g = self.ex.total, self.ex.dtype, self.group
        if not self.peer_ok:
            self.ctx.barrier()
            g.gather(n, dtype)
            self.ctx.barrier()
            g.shadow_average(n, dtype)
        elif self.ex.method == "copy":
            g.copy_average(n, dtype)
        else:
            g.allreduce(n, dtype, algo=self.ex.method)

    def unpack(self):
        itemsize = ITEMSIZE[self.ex.dtype]
        return [self.group.data(dtype, shape, off * itemsize)
                for (_, shape, dtype), off in zip(self.ex.layout, self.ex.offsets)]

    def close(self):
        self.group.close()
