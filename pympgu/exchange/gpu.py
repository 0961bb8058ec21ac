"""GPU workers' exchange: a PeerGroup buffer shared through CUDA IPC, averaged by the kernels
(and, across nodes, summed between them by NCCL)."""
import os
import warnings

from .. import methods, settings
from .layout import ITEMSIZE


class CudaBackend:
    """GPU workers: a PeerGroup buffer shared through CUDA IPC, averaged by the fused kernel.

    Everything runs on the group's stream, in order: pack, average, and (wire dtype) the
    accumulation into ref; wait() synchronises it once.

    Reusing the buffer needs no host wait either: what a consumer imported from the last
    exchange is read before the arrays handed to the next start() are computed (they are
    made from it), and pack waits for those; peers write into this buffer only after this
    rank has packed (the kernel's GPU barrier).
    """

    # What every rank's group must share, beside its layout: ranks that queue different
    # barriers (other grids, algorithms, chunks or cuts of the step) would wait for partners
    # that never come, so a difference is refused before any exchange.
    ALIKE = {"exchange_blocks": "cap the exchange kernel alike (max_blocks)",
             "method": "use the same method",
             "shadow": "give the Exchanger a shadow alike",  # peers copy into each other's
             "stream_barriers": "make its Exchanger with stream_barriers alike",
             "settings": "run with the same PYMPGU_* settings (pympgu.settings)"}

    def __init__(self, ex, timeout, stream_barriers=True):
        from .. import cuda
        from ..runtime import shm
        self.cuda = cuda
        ctx = self.ctx = ex.ctx
        self.ex = ex
        way = ex.way
        # Nodes apart unless the exchange stays inside its node (Exchanger's nodes=False).
        nnodes = self.nnodes = ctx.nnodes if ex.nodes else 1
        _check_road(ex, nnodes)
        rank, nranks = ctx.local_rank, ctx.local_nranks
        self.keep = None
        self.across = None
        # The staging area of 'push' and 'ce', and of 'auto' when the buffer is large enough
        # that it would pick 'push'.
        staging = methods.staging(way.name)
        # The flags page is named after the run, so that the launcher removes what a failed
        # run left in /dev/shm (shm.unlink_run), and peers refuse any other name.
        self.group = cuda.PeerGroup(rank, nranks, ex.nbytes, device=ctx.device,
                                    timeout=timeout, staging=staging, shadow=ex.shadow,
                                    flags_prefix=shm.segment_name(ctx.run_id, rank) + "-flags",
                                    stream_barriers=stream_barriers)
        try:
            if way.kernel:
                # Refuse, before any exchange, a layout the method cannot take ('ll' beyond
                # its mailboxes): the largest exchange is the exact one, in ex.dtype.
                self.group.algorithm(ex.nbytes, ex.method)
            current = settings.get()
            facts = {"device": ctx.device, "sm_count": self.group.sm_count, "pid": os.getpid(),
                     "exchange_blocks": ex.max_blocks, "method": ex.method,
                     "shadow": ex.shadow, "stream_barriers": bool(stream_barriers),
                     "settings": current.fingerprint()}
            all_facts, blobs, max_blocks = ctx.register(ex.layout, facts, self.group.handle)
            _check_alike(self.ALIKE, all_facts)
            devices = [f["device"] for f in all_facts]
            self.peer_ok = self._peer_access(devices, current.no_p2p)
            self.group.connect(blobs, max_blocks=max_blocks, flags_prefixes=[
                shm.segment_name(ctx.run_id, r) + "-flags" for r in range(nranks)])
            ctx.barrier(local=True)  # every rank has mapped every flags page: no name need stay
            self.group.release_names()
            if way.nccl:
                self._join_nccl(timeout, flat=True)
            elif nnodes > 1:
                if not self.peer_ok:
                    raise ValueError(f"rank {ctx.rank}: pympgu's exchange across nodes needs "
                                     f"peer access between this node's GPUs ({devices}; "
                                     "or PYMPGU_NO_P2P is set); method='nccl' does without")
                self._join_nccl(timeout, flat=False)
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
            if self.across is not None:
                self.across.abort()
            raise

    def _peer_access(self, devices, no_p2p):
        """Whether this rank's GPU reaches every GPU of ``devices`` by peer access (False
        under PYMPGU_NO_P2P); inside one node, a warning where the copy method stands in."""
        ctx, way = self.ctx, self.ex.way
        ok = all(d == ctx.device or self.cuda.can_access_peer(ctx.device, d) for d in devices)
        fallback = not way.nccl and self.nnodes == 1  # else NCCL, or a refusal
        if not ok and fallback:
            warnings.warn(f"rank {ctx.rank}: GPU {ctx.device} has no peer access to every "
                          f"GPU of {devices}; falling back to the copy method with host "
                          "barriers", RuntimeWarning)
        elif no_p2p:
            # The fallback forced on GPUs that report peer access: for a broken P2P path,
            # and to test the fallback where peer access works.
            ok = False
            if fallback:
                warnings.warn(f"rank {ctx.rank}: PYMPGU_NO_P2P=1: using the copy method "
                              "with host barriers", RuntimeWarning)
        return ok

    def _join_nccl(self, timeout, flat):
        """One NCCL communicator of every node's rank of this local index (node 0's rank
        makes its id), or with ``flat`` one of every rank (rank 0 makes it); every rank
        learns its id from one run-wide gather (docs/DECISIONS.md, "NCCL between nodes")."""
        ctx, cuda = self.ctx, self.cuda
        cuda.set_device(ctx.device)
        maker = ctx.rank == 0 if flat else ctx.node == 0
        ids = ctx.gather(cuda.nccl_unique_id().hex() if maker else None)
        uid = bytes.fromhex(ids[0 if flat else ctx.local_rank])
        if flat:
            self.across = cuda.NcclComm(ctx.nranks, ctx.rank, uid, timeout)
        else:
            self.across = cuda.NcclComm(ctx.nnodes, ctx.node, uid, timeout)
        self.across.watch()
        self.group.join_nodes(self.across, ctx.nranks, flat=flat)

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
        if self.across is not None:
            g.allreduce(n, dtype, synchronize=False, max_blocks=self.ex.max_blocks)
        elif not self.peer_ok:
            g.synchronize()  # packed, before the host barrier tells peers to copy
            self.ctx.barrier(local=True)
            g.gather(n, dtype)
            self.ctx.barrier(local=True)
            g.shadow_average(n, dtype, synchronize=False)
        elif self.ex.way.peer_copies:
            g.copy_average(n, dtype, synchronize=False)
        else:
            g.allreduce(n, dtype, algo=self.ex.method, synchronize=False,
                        max_blocks=self.ex.max_blocks)

    def wait(self):
        try:
            self.group.synchronize()
            if self.across is not None and self.across.failure is not None:
                raise self.across.failure  # its watch aborted it: the sum may be partial
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
            if self.across is not None:
                self.across.close()


def _check_road(ex, nnodes):
    """Refuse an Exchanger its method cannot serve, before any GPU memory is taken."""
    way = ex.way
    if way.nccl and ex.shadow:
        raise ValueError(f"the {way.name} method takes no shadow")
    if way.nccl and not ex.nodes:
        raise ValueError("the nccl method's communicator spans every node: an exchange kept "
                         "inside its node (nodes=False) takes a kernel method")
    if nnodes > 1 and not way.crosses_nodes and (
            ex.dtype != "float32" or ex.wire_dtype or ex.shadow or way.peer_copies):
        raise ValueError("pympgu's exchange across nodes averages float32 parameters, "
                         "with no low-precision wire, no shadow and not by the copy "
                         "method (or take method='nccl')")


def _check_alike(alike, facts):
    """Refuse ranks that differ in what every rank's group must share (CudaBackend.ALIKE),
    naming each rank's value."""
    for key, what in alike.items():
        values = [f.get(key) for f in facts]
        if len(set(values)) != 1:
            raise ValueError(f"every rank must {what}; {key} by rank: " +
                             ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
