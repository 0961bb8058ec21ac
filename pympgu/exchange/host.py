"""CPU workers' exchange: staging buffers in POSIX shared memory, averaged by the host kernel
inside a node, and summed across nodes by pympgu.exchange.across. GPU workers take it too
for their meetings between nodes under an outer optimizer (Exchanger(host=True))."""
import os
import threading

import numpy as np

from .. import _host
from ..runtime import cores, shm


ALIGN = 64  # bytes: XLA's CPU client aliases host arrays aligned so


def aligned_empty(n, dtype):
    """An uninitialised 1-D array of n ``dtype`` elements starting on an ALIGN boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(n * itemsize + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + n * itemsize].view(dtype)


MAX_THREADS = 8  # (docs/DECISIONS.md, "CPU workers' copies on every core of theirs")


class HostBackend:
    """CPU workers: staging buffers in POSIX shared memory, averaged by the host kernel.

    Each of a node's ranks averages its 1/L slice of the buffers (L ranks a node) and
    writes it into every buffer of the node. On several nodes the slice is first the sum
    of the node's ranks', summed again across the nodes, then divided by the world size
    once: every rank of every node gets the same bits."""

    def __init__(self, ex, timeout):
        ctx = self.ctx = ex.ctx
        self.ex = ex
        self.rank, self.nranks = ctx.local_rank, ctx.local_nranks
        self.across = self.barrier = self.outer = None
        # --outer-overlap: a fragment's sum across the nodes on a thread (Beside), settled
        # after this many of the node's exchanges (docs/DECISIONS.md, "Streams overlapped").
        self.overlap, self.beside = 0, None
        self.across_bytes = 0  # what this rank has sent between nodes
        if ctx.nnodes > 1:
            if ex.wire_dtype or ex.dtype != "float32":
                raise ValueError("across nodes the exchange is float32 (a half-precision "
                                 "wire's error across nodes is not measured yet): give "
                                 "--exchange-dtype float32")
            from .across import NodeSum
            self.across = NodeSum(ctx)
            # This rank's slice, padded to one length on every rank of its local index.
            self.part = np.zeros(-(-ex.total // self.nranks), np.float32)
        # Two buffers a rank, exchanges taking them in turn: a result is handed out as a view
        # of one, and the next exchange writes the other (docs/DECISIONS.md, "CPU workers'
        # copies on every core of theirs"). Local rank 0's segment holds the node's barrier
        # after them ("CPU workers meet in shared memory"); a new segment is zeroed, as the
        # barrier needs.
        self.side_bytes = -(-ex.nbytes // 4096) * 4096
        self.barrier_at = 2 * self.side_bytes
        nbytes = self.barrier_at + _host.BARRIER_BYTES
        self.segments = []
        self.own = shm.Segment(shm.new_name(shm.segment_name(ctx.run_id, ctx.local_rank)),
                               nbytes, create=True)
        try:
            _, blobs, _ = ctx.register(ex.layout, {"pid": os.getpid()}, self.own.name.encode())
            for r, blob in enumerate(blobs):
                seg = self.own if r == self.rank else shm.Segment(
                    blob.decode("ascii", "replace"), nbytes, create=False,
                    prefix=shm.segment_name(ctx.run_id, r))
                self.segments.append(seg)
            ctx.barrier(local=True)  # every rank has mapped every segment: no name need stay
            self.own.unlink()
            self.barrier = _host.Barrier(self.segments[0].buffer[self.barrier_at:],
                                         self.nranks, self.rank)
        except BaseException:
            self.close()
            raise
        self.side = 0  # the buffer the next exchange takes
        self.sides = ({}, {})
        for dtype in {ex.dtype, ex.wire_dtype or ex.dtype}:
            storage = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
            for side, views in enumerate(self.sides):
                views[dtype] = [np.frombuffer(s.buffer, dtype=storage, count=ex.total,
                                              offset=side * self.side_bytes)
                                for s in self.segments]
        self.ref = np.zeros(ex.total, np.float32) if ex.wire_dtype else None
        # The copies and the average on the cores this worker may use, which its XLA pool
        # leaves idle meanwhile (docs/DECISIONS.md, "CPU workers' copies on every core of
        # theirs").
        _host.set_threads(min(MAX_THREADS, cores.own_cpus(self.nranks)))

    @property
    def views(self):
        """Each dtype's arrays over every rank's buffer of the next exchange, in rank order."""
        return self.sides[self.side]

    def pack(self, pairs, kind, shift):
        """pairs: (name, dtype, offset, size, array) for each array to pack; shift: how far
        past its offset in the buffer each array's reference is (a part, Exchanger.start)."""
        ex, rank = self.ex, self.rank
        own = self.views[ex.wire_dtype if kind == "delta" else ex.dtype][rank]
        copies = []
        for name, _, off, size, a in pairs:
            a = np.asarray(a)
            if a.size != size:
                raise ValueError(f"parameter {name!r} has {a.size} elements, layout says {size}")
            into = own[off:off + size]
            if kind == "delta":
                ref = self.ref[shift + off:shift + off + size]
                _host.host_delta(np.ascontiguousarray(a, np.float32).reshape(-1), ref, into,
                                 ex.wire_dtype)
            elif a.dtype == into.dtype and a.flags.c_contiguous:
                if a.ctypes.data != into.ctypes.data:  # (a result of two exchanges ago)
                    copies.append((a.reshape(-1), into))
            else:
                into[:] = a.reshape(-1)  # (converted)
        _host.host_copy(copies)  # in one call, on this worker's cores

    def average(self, dtype, count, reach="world"):
        """Average the buffers' first count elements: this rank's 1/R slice of them.
        ``reach``: 'world' (every rank of every node), 'node' (this node's ranks alone),
        'outer' (the node's ranks, then across the nodes the outer step (self.outer) on the
        parameters, the rest the node's average) or 'outer-all' (the same, the rest averaged
        across the nodes too)."""
        chunk, lo, hi = self._bounds(count)
        arrays = self.views[dtype]
        self.ctx.meet(self.barrier)  # every rank of the node has packed
        mine = arrays[self.rank][lo:hi]
        whole = self.outer is not None and count == self.outer.total
        if reach.startswith("outer") and not whole:
            raise ValueError("the outer step takes the whole state")
        if self.beside is not None and reach != "node":
            # Before anything else crosses: at the epoch's end every parameter then takes
            # the state the nodes share, this fragment's too.
            self._settle()
        slices = [a[lo:hi] for a in arrays]
        if self.across is None or reach == "node":
            settling = self.beside is not None and whole
            if settling:
                self.beside.countdown -= 1
            if settling and self.beside.countdown <= 0:
                _host.host_average(slices, mine, dtype=dtype)
                self._settle(mine)
                self._to_all(slices, mine)
            else:
                # Into every replica of the node in the same pass.
                _host.host_average(slices, slices, dtype=dtype)
        else:
            # Summed in rank order as the host kernel sums, across the nodes, then divided
            # once (what pads the slice is summed too, and dropped).
            part = self.part[:chunk]
            part[:hi - lo] = slices[0]
            for a in slices[1:]:
                part[:hi - lo] += a
            if reach == "world":
                mine[:] = self._across(part)[:hi - lo] / np.float32(self.ctx.nranks)
                if whole:
                    n = self.outer.params_in(lo, hi)
                    self.outer.reset(mine[:n], slice(0, n))
            else:
                self._outer(part[:hi - lo], mine, lo, hi, reach == "outer-all")
            self._to_all(slices, mine)
        self.ctx.meet(self.barrier)  # every slice has reached every rank of the node

    def _to_all(self, slices, mine):
        """This rank's averaged slice ``mine`` into the node's other replicas."""
        for r, a in enumerate(slices):
            if r != self.rank:
                a[:] = mine

    def _across(self, x, wire=None):
        """``x`` summed across the nodes (pympgu.exchange.across), its bytes counted."""
        self.across_bytes += self.across.sent_bytes(x.size, wire)
        return self.across(x, wire)

    def _outer(self, sums, mine, lo, hi, everything):
        """The outer step on this rank's slice (``sums``: the node's sums of it): on the
        parameters due (self.outer.due), the rest the node's mean or (``everything``) every
        node's."""
        outer = self.outer
        n = outer.params_in(lo, hi)
        at = outer.due(lo, lo + n, everything)
        local = np.float32(self.nranks)
        if at.stop > at.start and self.overlap and not everything:
            # The fragment goes on from the node's mean; its outer step, once the sum
            # across the nodes is in, moves it as it would have moved it now.
            then = sums[at] / local
            part = sums[at]
            outer.step(part, at, self.nranks)
            self.across_bytes += self.across.sent_bytes(part.size, outer.wire)
            self.beside = Beside(self.across, part.copy(), outer.wire, at, then, self.overlap)
            mine[at] = then
        elif at.stop > at.start:  # the same on this local index of every node
            part = sums[at]
            outer.step(part, at, self.nranks)
            mine[at] = outer.finish(self._across(part, outer.wire), at, everything)
        mine[:at.start] = sums[:at.start] / local
        mine[at.stop:n] = sums[at.stop:n] / local
        if n < hi - lo:
            rest = sums[n:]
            if everything:
                mine[n:] = self._across(rest)[:rest.size] / np.float32(self.ctx.nranks)
            else:
                mine[n:] = rest / local

    def _settle(self, mine=None):
        """The fragment whose sum across the nodes ran beside the inner steps: its outer
        step finished and, with ``mine`` (the node's mean now, this rank's slice), the
        fragment moved by what the step changed (the global parameters minus the node's
        mean it began from)."""
        from .across import WORD_S, LinkLost
        beside, self.beside = self.beside, None
        try:
            total = beside.wait(self.ctx.check)
        except LinkLost:  # another node gone: the launcher's word (a loss) comes first
            self.ctx.await_word(WORD_S)
            raise
        new = self.outer.finish(total, beside.at, False)
        if mine is not None:
            mine[beside.at] += new - beside.then

    def _bounds(self, count):
        """The chunk of ``count`` elements each rank sums, and this rank's [lo, hi)."""
        chunk = -(-count // self.nranks)
        lo = min(count, self.rank * chunk)
        return chunk, lo, min(count, lo + chunk)

    def _slice(self, rank):
        chunk = -(-self.ex.total // self.nranks)
        lo = min(self.ex.total, rank * chunk)
        return lo, min(self.ex.total, lo + chunk)

    def outer_state(self, attr):
        """The outer optimizer's array ``attr`` (its slices) whole, on local rank 0 (None on
        the others), each rank's slice passed through the shared buffers: every rank of the
        node calls it, between exchanges."""
        outer, arrays = self.outer, self.views[self.ex.dtype]
        lo, hi = self._slice(self.rank)
        n = outer.params_in(lo, hi)
        arrays[self.rank][lo:lo + n] = getattr(outer, attr)[:n]
        self.ctx.meet(self.barrier)  # every slice is in its rank's buffer
        whole = None
        if self.rank == 0:
            whole = np.concatenate([arrays[r][slice(*self._slice(r))][:outer.params_in(
                *self._slice(r))] for r in range(self.nranks)])
        self.ctx.meet(self.barrier)  # read: the buffers are free again
        return whole

    def set_outer_state(self, attr, whole):
        """This rank's slice of the outer optimizer's array ``attr``, from the whole (a
        checkpoint's)."""
        lo, hi = self._slice(self.rank)
        n = self.outer.params_in(lo, hi)
        getattr(self.outer, attr)[:n] = whole[lo:lo + n]

    def copy_from(self, root, dtype, count):
        """Every rank's buffer gets rank root's first count elements."""
        arrays = self.views[dtype]
        self.ctx.meet(self.barrier)  # root has packed
        if self.rank != root:
            arrays[self.rank][:count] = arrays[root][:count]
        self.ctx.meet(self.barrier)  # root's buffer may be packed again

    def copy_from_node(self, source, dtype, count):
        """Every rank's buffer gets the first count elements of node ``source``'s (whose
        ranks hold the same): each rank's slice of them crosses from that node's rank of
        its local index."""
        rank, arrays = self.rank, self.views[dtype]
        _, lo, hi = self._bounds(count)
        self.ctx.meet(self.barrier)  # every rank of the node has packed
        mine = arrays[rank][lo:hi]
        if self.across is not None:
            mine[:] = self.across.take(mine, source)
        self._to_all([a[lo:hi] for a in arrays], mine)
        self.ctx.meet(self.barrier)  # every slice has reached every rank of the node

    def take_outer(self, source):
        """The outer optimizer's slice of node ``source``'s rank of this local index (a
        node that joins late holds none)."""
        outer = self.outer
        if outer is None:
            return
        turn = np.array([outer.turn, outer.ready], np.float32)
        turn, ready = self.across.take(turn, source)
        outer.turn, outer.ready = int(turn), bool(ready)
        for k in outer.kept:
            getattr(outer, k)[:] = self.across.take(getattr(outer, k), source)
        outer.version += 1

    def wait(self):
        pass  # the host average is complete when average() returns

    def unpack(self, kind, flat, k, count, shift):
        """The first k entries' averages (count elements of the buffer), whose references
        lie shift elements further in ref."""
        ex, rank = self.ex, self.rank
        result = self.views[ex.dtype][rank][:count]
        if ex.wire_dtype:
            ref = self.ref[shift:shift + count]
            if kind == "delta":
                _host.host_accumulate(ref, self.views[ex.wire_dtype][rank][:count],
                                      ex.wire_dtype)
            else:
                ref[:] = result
            # ref stays this rank's: a copy, aligned as XLA's CPU client takes a host array
            # without copying it (docs/DECISIONS.md, "CPU workers' copies on every core of
            # theirs"); entries keep their offsets.
            result = aligned_empty(count, ref.dtype)
            _host.host_copy([(ref, result)])
        # Else the buffer itself (page-aligned, entries 256 bytes apart): the next exchange
        # writes the other one, the one after this one again (Exchanger.finish).
        self.side = 1 - self.side
        if flat:
            return result
        return [result[off:off + size].reshape(shape)
                for (_, shape, _), off, size in zip(ex.layout[:k], ex.offsets, ex.sizes)]

    def close(self):
        _host.set_threads(1)  # (nothing left running)
        if self.beside is not None:
            self.beside.cancel()
            self.beside = None
        if self.across is not None:
            self.across.close()
            self.across = None
        # Drop the numpy views first, or the mappings cannot close (results handed out
        # keep theirs mapped while they live: shm.Segment.close).
        self.sides = ({}, {})
        self.barrier = None
        for seg in self.segments:
            if seg is not self.own:
                seg.close()
        self.segments = []
        self.own.close()


class Beside:
    """One fragment's sum across the nodes (NodeSum), on a thread beside the inner steps;
    ``at``, ``then``: its range and the node's mean of it when it began; ``countdown``: the
    node's exchanges to go before it is settled."""

    SLICE_S = 0.02  # the waiting main thread reads the launcher's socket this often

    def __init__(self, across, x, wire, at, then, countdown):
        self.at, self.then, self.countdown = at, then, countdown
        self.stopping = threading.Event()
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(across, x, wire),
                                       name="pympgu-outer", daemon=True)
        self.thread.start()

    def _run(self, across, x, wire):
        try:
            self.result = across(x, wire, self._check)
        except BaseException as e:  # re-raised in the main thread by wait()
            self.error = e

    def _check(self):
        if self.stopping.is_set():
            raise _Cancelled()

    def wait(self, check):
        """The sum; ``check`` (the main thread's: the launcher's STOP) while it runs."""
        while self.thread.is_alive():
            self.thread.join(self.SLICE_S)
            check()
        if self.error is not None:
            raise self.error
        return self.result

    def cancel(self):
        self.stopping.set()
        self.thread.join(5)


class _Cancelled(Exception):
    """The exchange closed while a sum ran beside the steps."""
