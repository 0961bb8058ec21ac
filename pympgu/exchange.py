"""The Exchanger: averages a worker's parameter arrays with every other worker's.

Each worker owns one shared staging buffer holding all its parameters back to back (each
starting on a 256-byte boundary). An exchange is three steps, each one pass over the
parameters:

1. pack: copy the parameters into the staging buffer (GPU: one multi-tensor launch);
2. average: average every rank's staging buffer in place (GPU: the fused kernel with its
   GPU barrier; CPU: each rank averages its 1/R slice with the host kernel and writes it into
   every rank's buffer, between two host barriers);
3. unpack: hand the result back. On the CPU these are new numpy arrays. On the GPU they
   are DeviceArray views of pympgu memory, valid until the next exchange starts; the caller
   imports them into its framework and copies them there (``jax.dlpack`` then a copy), so
   results only ever reach a framework through DLPack and never by writing into memory the
   framework owns.

``start(arrays)`` does steps 1 and 2 and, on the GPU, returns while the average still runs on
pympgu's own stream; ``finish()`` waits and does step 3. Between the two the caller may
compute (the training loop's ``--overlap``). ``average_arrays`` is both at once.

On the GPU the host need never wait. ``start`` takes the arrays through DLPack naming
pympgu's stream, so their producer (JAX's compute stream, say) orders its pending work before
the pack instead of the host blocking on it; ``finish(wait=False)`` returns views whose DLPack
export orders the consumer's stream after the average in the same way. The training loop
runs like this, so the host queues step after step while the GPU works.

A low-precision wire (``wire_dtype='bfloat16'`` or ``'float16'``) halves the bytes that cross
the link. The parameters stay float32: every rank keeps ``ref``, the float32 result of the
last exchange (identical on every rank), sends round(x - ref) in the wire dtype, and adds
the averaged wire back to ref in float32. Rounding then costs a fraction of the change since
the last exchange, not of the parameter, and replicas stay bit-identical. The first exchange
is exact (float32 on the wire) to set ref. Inside XLA the wire takes one road alone, where
no ``ref`` is needed: ``xla_average_gradients``, whose gradients cross rounded to it (DDP's
bf16_compress_hook), summed in float32.

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
METHODS = ("auto", "ll", "oneshot", "twoshot", "push", "ce", "copy")
WIRE_DTYPES = ("float32", "bfloat16", "float16")


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

    ``layout`` is a list of (name, shape, dtype); ``method`` is 'auto', one of the PeerGroup
    algorithms ('ll', 'oneshot', 'twoshot', 'push', 'ce') or 'copy' (the seed's peer-copy method)
    and only matters on GPUs. ``wire_dtype`` is None (the layout's dtype), or 'bfloat16' /
    'float16' for float32 layouts (see the module docstring). ``max_blocks`` caps the GPU averaging kernel's grid (every rank must give the
    same; None: twice the SM count), leaving SMs free for compute that overlaps it.
    ``shadow`` (GPUs; every rank the same) gives the peer group a shared shadow, nranks - 1
    more copies of the buffer, that peers copy their arrays into by DMA: the XLA exchanges
    that overlap computation (``xla_average_results``, ``xla_correct_during``) then need no
    pack, and ``xla_average_results`` can cut the step in two (pympgu.PeerGroup).
    ``stats`` adds up the host seconds spent in each step and counts exchanges.
    """

    def __init__(self, ctx, layout, method="auto", wire_dtype=None, timeout=60.0,
                 max_blocks=None, shadow=False):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.ctx = ctx
        self.layout = [(str(n), [int(s) for s in shape], str(d)) for n, shape, d in layout]
        self.offsets, self.total, self.dtype = plan_layout(self.layout)
        self.sizes = [math.prod(shape) for _, shape, _ in self.layout]
        self.method = method
        self.shadow = bool(shadow)
        if max_blocks is not None and not 1 <= int(max_blocks) <= 512:
            raise ValueError(f"max_blocks must be 1 to 512, got {max_blocks}")
        self.max_blocks = None if max_blocks is None else int(max_blocks)
        if wire_dtype in (None, self.dtype):
            self.wire_dtype = None
        elif wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype must be one of {WIRE_DTYPES}, got {wire_dtype!r}")
        elif self.dtype != "float32":
            raise ValueError(f"a {wire_dtype} wire needs float32 parameters, the layout is "
                             f"{self.dtype}")
        else:
            self.wire_dtype = wire_dtype
        self.primed = self.wire_dtype is None  # ref is set by the first (exact) exchange
        self.pending = None  # the kind of exchange started and not finished
        self._started = None  # its entries (lo, hi) and their count of elements
        self.stats = {"pack_s": 0.0, "average_s": 0.0, "unpack_s": 0.0, "exchanges": 0}
        self.xla_road = None  # what xla_average_gradients last traced, in words
        backend = _HostBackend if ctx.is_cpu else _CudaBackend
        self.backend = backend(self, timeout)

    @property
    def nbytes(self):
        """Bytes of the staging buffer (enough for an exact exchange)."""
        return self.total * ITEMSIZE[self.dtype]

    @property
    def wire_nbytes(self):
        """Bytes each rank's buffer holds on the wire in a regular exchange."""
        return self.total * ITEMSIZE[self.wire_dtype or self.dtype]

    def start(self, arrays, flat=False, entries=None):
        """Pack this rank's arrays and start averaging them; every rank must call it.

        flat=True takes one 1-D array of ``total`` elements instead, laid out as finish's
        flat result (each entry at its offset; the padding between entries zero): a
        framework that packs its arrays itself then hands over a single array.
        ``entries=(lo, hi)`` averages the layout's entries lo to hi - 1 alone (their flat
        array has ``part(lo, hi)`` elements): they must have the shapes of the first
        hi - lo entries, in whose place they cross (a model's momentum, after its
        parameters), and only their bytes are sent. A low-precision wire keeps each
        entry's own reference.
        On the GPU the average may still be running when this returns: the arrays must stay
        unchanged until finish(), and are kept alive until then.
        """
        if self.pending is not None:
            raise RuntimeError("Exchanger.start called twice without finish()")
        lo, hi = (0, len(self.layout)) if entries is None else entries
        count = self.part(lo, hi)
        if flat:
            pairs = [("flat", self.dtype, 0, count, arrays)]
        elif len(arrays) != hi - lo:
            raise ValueError(f"start got {len(arrays)} arrays for {hi - lo} entries of the "
                             "layout")
        else:
            pairs = [(self.layout[lo + i][0], self.dtype, self.offsets[i], self.sizes[lo + i], a)
                     for i, a in enumerate(arrays)]
        kind = "delta" if self.primed and self.wire_dtype else "exact"
        t0 = time.perf_counter()
        self.backend.pack(pairs, kind, self.offsets[lo])
        t1 = time.perf_counter()
        self.backend.average(self.wire_dtype if kind == "delta" else self.dtype, count)
        self.stats["pack_s"] += t1 - t0
        self.stats["average_s"] += time.perf_counter() - t1
        self.pending = kind
        self._started = (lo, hi, count)

    def part(self, lo, hi):
        """The elements that averaging the layout's entries lo to hi - 1 on their own
        (start's ``entries``) takes in the buffer: they go where the first hi - lo entries
        go, so they must have their shapes."""
        n = len(self.layout)
        if not 0 <= lo < hi <= n:
            raise ValueError(f"entries ({lo}, {hi}) are not a part of a layout of {n}")
        shapes = [shape for _, shape, _ in self.layout[lo:hi]]
        if shapes != [shape for _, shape, _ in self.layout[:hi - lo]]:
            raise ValueError(f"entries {lo} to {hi - 1} ({shapes}) must have the shapes of the "
                             f"layout's first {hi - lo}, in whose place they are averaged")
        return self.offsets[hi - lo] if hi - lo < n else self.total

    def finish(self, flat=False, wait=True):
        """Complete the started exchange; the averaged arrays (numpy, or DeviceArray views).

        flat=True returns one 1-D array instead, each entry at its offset in ``offsets``
        (``total`` elements; after ``start(entries=...)``, the part's count, laid out as the
        first entries): a framework then imports the result once, not per array.
        wait=False (GPU) does not wait for the average: the views are then for consumers
        that import them through DLPack naming their stream, which orders them after it.
        Either way they hold the result until the next start().
        """
        if self.pending is None:
            raise RuntimeError("Exchanger.finish called with no exchange started")
        kind, self.pending = self.pending, None
        lo, hi, count = self._started
        t0 = time.perf_counter()
        # May queue more work (the wire's accumulate).
        out = self.backend.unpack(kind, flat, hi - lo, count, self.offsets[lo])
        t1 = time.perf_counter()
        if wait:
            self.backend.wait()
        if kind == "exact" and self.wire_dtype and hi - lo == len(self.layout):
            self.primed = True  # every entry's reference is set
        self.stats["unpack_s"] += t1 - t0
        self.stats["average_s"] += time.perf_counter() - t1
        self.stats["exchanges"] += 1
        return out

    def average_arrays(self, arrays):
        """start and finish in one call."""
        self.start(arrays)
        return self.finish()

    def xla_unavailable(self, gradients=False):
        """None when ``xla_average`` can run here, else why it cannot; ``gradients``: when
        ``xla_average_gradients`` can, the one XLA road a low-precision wire takes (its
        gradients cross rounded, and need no ``ref``)."""
        if self.ctx.is_cpu:
            return "CPU workers exchange through shared memory"
        if self.wire_dtype and not gradients:
            return (f"the {self.wire_dtype} wire keeps state outside XLA (inside it, only "
                    "--sync-every 1's gradients cross in it)")
        if self.method == "copy" or not self.backend.peer_ok:
            return "the copy method with host barriers runs outside XLA"
        from . import xla
        return xla.available()[1]

    def xla_average(self, arrays):
        """The exchange as an XLA operation, for use inside a jitted JAX function: returns the
        averages of ``arrays`` (the layout's shapes, in its order) as JAX arrays.

        It averages the same bytes with the same kernel as start()/finish(), so ranks may
        mix the two from one exchange to the next, but every rank must take the same path
        in the same exchange. ``arrays`` may also be the layout's first k entries only: then
        only those are averaged (every rank must pass the same k). Exchanges made this way
        are not counted in ``stats``.
        """
        from . import xla
        return xla.average(arrays, self._xla_group(arrays), algo=self.method,
                           max_blocks=self.max_blocks)

    def xla_average_results(self, fn, which, *args):
        """``fn(*args)`` (a flat list of arrays) with its results at positions ``which``
        averaged, each sent as soon as it is computed (``pympgu.xla.average_results``); the
        results at ``which`` are the layout's first entries, in its order."""
        import jax

        from . import xla
        shapes = jax.eval_shape(lambda *a: list(fn(*a)), *args)
        group = self._xla_group([shapes[i] for i in which])
        return xla.average_results(fn, which, group, *args, algo=self.method,
                                   max_blocks=self.max_blocks)

    def xla_average_gradients(self, fn, updated, which, *args, shadow=None, local=(),
                              exact=True, alike=False):
        """``pympgu.xla.average_gradients`` over this exchanger's group: ``fn``'s results at
        ``updated`` computed from every rank's mean gradient, or, where that does not apply,
        its results at ``which`` (the layout's first entries, in its order) averaged.
        ``shadow`` is ``xla_shadow(correction=False)``'s array, or None; ``exact`` and
        ``alike`` as average_gradients takes them. A low-precision wire is the gradients'
        (``wire``); where they do not cross, the results are averaged in float32.
        ``xla_road`` then says which was traced."""
        import jax

        from . import xla
        shapes = jax.eval_shape(lambda *a: list(fn(*a)), *args)
        group = self._xla_group([shapes[i] for i in which], gradients=True)
        plan = xla.gradient_plan(fn, updated, group, args, local, shadow, self.method, exact,
                                 self.wire_dtype, alike)
        wire = f", sent in {self.wire_dtype}" if self.wire_dtype else ""
        if plan[1] is not None:
            self.xla_road = ("the new values averaged after the update"
                             f"{', in float32' if wire else ''}: {plan[1]}")
        elif xla.gradients_by_copies(group, shadow, self.method):
            self.xla_road = f"the update of the mean gradients{wire}"
        else:
            self.xla_road = (f"the update of the mean gradients{wire}, averaged by the "
                             f"kernel ({group.nranks} ranks)")
        return xla.average_gradients(fn, updated, which, group, *args, shadow=shadow,
                                     local=local, algo=self.method, max_blocks=self.max_blocks,
                                     plan=plan, exact=exact, wire=self.wire_dtype,
                                     alike=alike)

    def xla_average_during(self, arrays, fn, *args):
        """``xla_average(arrays)`` taken while ``fn(*args)`` computes; returns both
        (``pympgu.xla.average_during``)."""
        from . import xla
        return xla.average_during(arrays, self._xla_group(arrays), fn, *args,
                                  algo=self.method, max_blocks=self.max_blocks)

    def xla_correct_during(self, arrays, fn, *args, shadow=None, ready=()):
        """``pympgu.xla.correct_during`` over this exchanger's group; ``shadow`` is
        ``xla_shadow()``'s array, or None."""
        from . import xla
        return xla.correct_during(arrays, self._xla_group(arrays), fn, *args,
                                  algo=self.method, max_blocks=self.max_blocks, shadow=shadow,
                                  ready=ready)

    def xla_shadow(self, correction=True):
        """The shared shadow as a JAX array, for ``xla_correct_during``'s ``shadow`` (or
        with ``correction=False``, ``xla_average_gradients``'), or None where it cannot
        serve: no shared shadow (``shadow=True``), a number of ranks that is not a power of
        two or is above PYMPGU_SPLIT_MAX_RANKS (pympgu.xla.shadow_array), a method other
        than 'auto', or other arrays than float32. For the correction,
        PYMPGU_FUSED_CORRECTION=0 also says None, which leaves it to pympgu's own pass (to
        compare the two). For the gradients it is of the wire's dtype."""
        from . import xla
        if ((correction and os.environ.get("PYMPGU_FUSED_CORRECTION", "1") == "0")
                or self.method != "auto" or self.xla_unavailable(gradients=not correction)
                or any(d != "float32" for _, _, d in self.layout)):
            return None
        wire = "float32" if correction else self.wire_dtype or "float32"
        return xla.shadow_array(self.backend.group, wire)

    def _xla_group(self, arrays, gradients=False):
        """The PeerGroup for an XLA exchange of ``arrays``, after checking both
        (``gradients``: for xla_average_gradients)."""
        why = self.xla_unavailable(gradients)
        if why:
            raise RuntimeError(f"rank {self.ctx.rank}: cannot average inside XLA: {why}")
        shapes = [tuple(a.shape) for a in arrays]
        if not shapes or shapes != [tuple(shape) for _, shape, _ in self.layout[:len(shapes)]]:
            raise ValueError(f"xla_average got shapes {shapes} for the layout "
                             f"{[(n, tuple(s)) for n, s, _ in self.layout]}")
        return self.backend.group

    def close(self):
        """Release the staging buffer and every peer mapping; calling it again does nothing."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _entries(self):
        return zip(self.layout, self.offsets, self.sizes)


class _HostBackend:
    """CPU workers: staging buffers in POSIX shared memory, averaged by the host kernel."""

    def __init__(self, ex, timeout):
        ctx = self.ctx = ex.ctx
        self.ex = ex
        nbytes = ex.nbytes
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
        self.views = {}
        for dtype in {ex.dtype, ex.wire_dtype or ex.dtype}:
            storage = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
            self.views[dtype] = [np.frombuffer(s.buffer, dtype=storage, count=ex.total)
                                 for s in self.segments]
        self.ref = np.zeros(ex.total, np.float32) if ex.wire_dtype else None

    def pack(self, pairs, kind, shift):
        """pairs: (name, dtype, offset, size, array) for each array to pack; shift: how far
        past its offset in the buffer each array's reference is (a part, Exchanger.start)."""
        ex, rank = self.ex, self.ctx.rank
        own = self.views[ex.wire_dtype if kind == "delta" else ex.dtype][rank]
        for name, _, off, size, a in pairs:
            a = np.asarray(a)
            if a.size != size:
                raise ValueError(f"parameter {name!r} has {a.size} elements, layout says {size}")
            if kind == "delta":
                ref = self.ref[shift + off:shift + off + size]
                _host.host_delta(np.ascontiguousarray(a, np.float32).reshape(-1), ref,
                                 own[off:off + size], ex.wire_dtype)
            else:
                own[off:off + size] = a.reshape(-1)

    def average(self, dtype, count):
        """Average the buffers' first count elements: this rank's 1/R slice of them."""
        rank = self.ctx.rank
        chunk = -(-count // self.ctx.nranks)
        lo = min(count, rank * chunk)
        hi = min(count, lo + chunk)
        arrays = self.views[dtype]
        self.ctx.barrier()  # every rank has packed
        mine = arrays[rank][lo:hi]
        _host.host_average([a[lo:hi] for a in arrays], mine, dtype=dtype)
        for r, a in enumerate(arrays):
            if r != rank:
                a[lo:hi] = mine
        self.ctx.barrier()  # every slice has reached every rank

    def wait(self):
        pass  # the host average is complete when average() returns

    def unpack(self, kind, flat, k, count, shift):
        """The first k entries' averages (count elements of the buffer), whose references
        lie shift elements further in ref."""
        ex, rank = self.ex, self.ctx.rank
        result = self.views[ex.dtype][rank][:count]
        if ex.wire_dtype:
            ref = self.ref[shift:shift + count]
            if kind == "delta":
                _host.host_accumulate(ref, self.views[ex.wire_dtype][rank][:count],
                                      ex.wire_dtype)
            else:
                ref[:] = result
            result = ref
        if flat:
            return result.copy()
        return [result[off:off + size].reshape(shape).copy()
                for (_, shape, _), off, size in zip(ex.layout[:k], ex.offsets, ex.sizes)]

    def close(self):
        self.views = {}  # drop the numpy views first, or the mappings cannot close
        for seg in self.segments:
            if seg is not self.own:
                seg.close()
        self.segments = []
        self.own.close()


class _CudaBackend:
    """GPU workers: a PeerGroup buffer shared through CUDA IPC, averaged by the fused kernel.

    Everything runs on the group's stream, in order: pack, average, and (wire dtype) the
    accumulation into ref; wait() synchronises it once.

    Reusing the buffer needs no host wait either: what a consumer imported from the last
    exchange is read before the arrays handed to the next start() are computed (they are
    made from it), and pack waits for those; peers write into this buffer only after this
    rank has packed (the kernel's GPU barrier).
    """

    def __init__(self, ex, timeout):
        from . import cuda, xla
        self.cuda = cuda
        ctx = self.ctx = ex.ctx
        self.ex = ex
        self.keep = None
        # The staging area of 'push' and 'ce', and of 'auto' when the buffer is large enough
        # that it would pick 'push'.
        staging = {"push": True, "ce": True, "auto": None}.get(ex.method, False)
        # The flags page is named after the run, so that the launcher removes what a failed
        # run left in /dev/shm (shm.unlink_run).
        self.group = cuda.PeerGroup(ctx.rank, ctx.nranks, ex.nbytes, device=ctx.device,
                                    timeout=timeout, staging=staging, shadow=ex.shadow,
                                    flags_prefix=shm.segment_name(ctx.token, ctx.rank) + "-flags")
        try:
            if ex.method in cuda.ALGORITHMS:
                # Refuse, before any exchange, a layout the method cannot take ('ll' beyond
                # its mailboxes): the largest exchange is the exact one, in ex.dtype.
                self.group.algorithm(ex.nbytes, ex.method)
            facts = {"device": ctx.device, "sm_count": self.group.sm_count, "pid": os.getpid(),
                     "exchange_blocks": ex.max_blocks, "method": ex.method,
                     "ce_chunk_bytes": cuda.ce_chunk_bytes(), "shadow": ex.shadow,
                     # As text: the facts cross the coordinator as JSON, which makes a
                     # tuple a list, and the check below compares them in a set.
                     "auto_bytes": " ".join(map(str, self.group.auto_bytes)),
                     "xla_roads": xla.roads()}
            all_facts, blobs, max_blocks = ctx.register(ex.layout, facts, self.group.handle)
            for key, what in (("exchange_blocks", "cap the exchange kernel alike (max_blocks)"),
                              ("method", "use the same method"),
                              # Peers copy into each other's shadow: all have one, or none.
                              ("shadow", "give the Exchanger a shadow alike"),
                              ("ce_chunk_bytes", "use the same PYMPGU_CE_CHUNK_BYTES"),
                              # 'auto' must pick the same algorithm on every rank.
                              ("auto_bytes", "use the same PYMPGU_LL_MAX_BYTES, "
                                             "PYMPGU_ONESHOT_MAX_BYTES, PYMPGU_PUSH_MIN_BYTES "
                                             "and PYMPGU_CE_MIN_BYTES"),
                              # Steps laid into XLA alike (pympgu.xla.roads).
                              ("xla_roads", "use the same PYMPGU_SPLIT_MIN_BYTES, "
                                            "PYMPGU_SPLIT_MAX_RANKS, PYMPGU_BESIDE_BLOCKS, "
                                            "PYMPGU_GRADIENTS, PYMPGU_FUSED_CORRECTION and "
                                            "PYMPGU_OVERLAP_WHOLE")):
                values = [f.get(key) for f in all_facts]
                if len(set(values)) != 1:
                    # Ranks that queue different barriers (other grids, algorithms or
                    # chunks) would wait for partners that never come: refuse before any
                    # exchange.
                    raise ValueError(f"every rank must {what}; {key} by rank: " +
                                     ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
            devices = [f["device"] for f in all_facts]
            self.peer_ok = all(d == ctx.device or cuda.can_access_peer(ctx.device, d)
                               for d in devices)
            if not self.peer_ok:
                warnings.warn(f"rank {ctx.rank}: GPU {ctx.device} has no peer access to every "
                              f"GPU of {devices}; falling back to the copy method with host "
                              "barriers", RuntimeWarning)
            elif os.environ.get("PYMPGU_NO_P2P") == "1":
                # The fallback's logic, forced on GPUs that do have peer access: machines
                # without P2P are rare, and the path must still be testable.
                self.peer_ok = False
                warnings.warn(f"rank {ctx.rank}: PYMPGU_NO_P2P=1: using the copy method with "
                              "host barriers", RuntimeWarning)
            self.group.connect(blobs, max_blocks=max_blocks)
            # Padding between parameters is averaged too: give it defined contents.
            self.group.data("uint8").fill_bytes(0)
            self.copy_table = cuda.TensorTable(len(ex.layout), 1, ex.dtype)
            self.packed = cuda.Event()  # the last pack has read its inputs
            self.ref = self.delta_table = None
            if ex.wire_dtype:
                self.ref = cuda.DeviceBuffer(ex.nbytes, ctx.device)
                self.delta_table = cuda.TensorTable(len(ex.layout), 2, ex.wire_dtype, op="delta")
        except BaseException:
            self.group.close()
            raise

    def pack(self, pairs, kind, shift):
        ex = self.ex
        out_dtype = ex.wire_dtype if kind == "delta" else ex.dtype
        out_size, in_size = ITEMSIZE[out_dtype], ITEMSIZE[ex.dtype]
        base, stream = self.group.data_ptr, self.group.stream
        if self.keep is not None:
            # The last exchange was finished without waiting: its inputs may be released
            # once its pack has read them (long done, unless the host ran far ahead).
            self.packed.synchronize()
            self.keep = None
        entries, keep = [], []
        for name, dtype, off, size, a in pairs:
            # Ordered after the array's producer on our stream, with no host wait.
            info = self.cuda.array_info(a, f"parameter {name!r}", stream)
            if info.size != size or info.dtype != dtype:
                raise ValueError(f"parameter {name!r} is {info.size} {info.dtype} elements, "
                                 f"the layout says {size} {dtype}")
            keep.append(info)
            ins = ((info.ptr, self.ref.ptr + (shift + off) * in_size) if kind == "delta"
                   else (info.ptr,))
            entries.append((ins, base + off * out_size, size))
        table = self.delta_table if kind == "delta" else self.copy_table
        table.set(entries)
        table.launch(stream)
        self.packed.record(stream)
        # The kernel reads the arrays until `packed`: their owner must not free them before.
        self.keep = keep

    def average(self, dtype, n):
        g = self.group
        if not self.peer_ok:
            g.synchronize()  # packed, before the host barrier tells peers to copy
            self.ctx.barrier()
            g.gather(n, dtype)
            self.ctx.barrier()
            g.shadow_average(n, dtype, synchronize=False)
        elif self.ex.method == "copy":
            g.copy_average(n, dtype, synchronize=False)
        else:
            g.allreduce(n, dtype, algo=self.ex.method, synchronize=False,
                        max_blocks=self.ex.max_blocks)

    def wait(self):
        try:
            self.group.synchronize()
        finally:
            self.keep = None

    def unpack(self, kind, flat, k, count, shift):
        ex, g = self.ex, self.group
        itemsize = ITEMSIZE[ex.dtype]
        source, base = g, 0
        if ex.wire_dtype:
            ref = self.ref.view("float32", (count,), shift * itemsize)
            if kind == "delta":
                self.cuda.accumulate(ref, g.data(ex.wire_dtype, (count,)), stream=g.stream,
                                     synchronize=False)
            else:
                # The exact exchange sets ref; later regular exchanges only write the wire
                # slots of their entries, so clear the float32 bytes that padding would read.
                ref.copy_from(g.data("float32", (count,)))
                g.data("uint8").fill_bytes(0)
            source, base = self.ref, shift * itemsize

        def view(dtype, shape, offset):
            if source is g:
                return g.data(dtype, shape, offset)
            return source.view(dtype, shape, base + offset, g.stream)

        if flat:
            return view(ex.dtype, (count,), 0)
        return [view(dtype, shape, off * itemsize)
                for (_, shape, dtype), off in zip(ex.layout[:k], ex.offsets)]

    def close(self):
        try:
            # Nothing queued may outlive the memory it uses: neither our kernels nor a
            # consumer still reading the last result (JAX's streams too: device-wide).
            self.cuda.set_device(self.group.device)
            self.cuda.synchronize()
        except self.cuda.CudaError:
            pass  # a broken context: the error that broke it has been raised already
        finally:
            self.keep = None
            if self.ref is not None:
                self.ref.close()
            self.group.close()
