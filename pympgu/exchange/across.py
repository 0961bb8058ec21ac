"""CPU workers' exchange between nodes, over pympgu's own authenticated TCP links
(runtime.datalinks).

Inside a node the host backend sums each local rank's slice of the buffer through shared
memory; this sums that slice across the nodes, between the ranks of one local index. In
float32 on 3 nodes or more, by a ring (reduce-scatter, then all-gather: each chunk summed
once, on one node, and copied to the others); otherwise each node's slice crosses to every
other node (float32, bfloat16 or int8 with a scale a block) and every node sums them all in
float32 in node order. Either way every node gets the same bits (docs/DECISIONS.md, "CPU
workers across nodes"). Every rank of the run makes its links at once, as every rank
exchanges at once.
"""
import numpy as np

from ..runtime.datalinks import DataLinks, LinkLost

# How long a rank whose link to another node closed waits for the launcher to say why (the
# node's loss, seen by node 0 within its node timeout) before it raises the closed link.
WORD_S = 15.0

# int8 on the wire: one float32 scale for each block of this many values.
INT8_BLOCK = 256


class NodeSum:
    """Sums of equal-length float32 arrays over the ranks of one local index, one per node."""

    def __init__(self, ctx, timeout=60.0):
        self.nnodes, self.nlocal, self.node = ctx.nnodes, ctx.local_nranks, ctx.node
        peers = [n * self.nlocal + ctx.local_rank for n in range(self.nnodes) if n != ctx.node]
        self.ctx = ctx
        self.links = DataLinks.connect(ctx, peers, timeout)
        self.order = {p: p // self.nlocal for p in peers}  # peer -> its node
        # The ring's neighbours: the same local index on the next node and the previous.
        self.next = ((self.node + 1) % self.nnodes) * self.nlocal + ctx.local_rank
        self.previous = ((self.node - 1) % self.nnodes) * self.nlocal + ctx.local_rank

    def __call__(self, x, wire=None, check=None):
        """The sum of ``x`` (float32, 1-D, the same length on every rank of this local
        index) over the nodes, as a new array; every node gets the same bits. ``wire``:
        None (float32), 'bfloat16' or 'int8' (a float32 scale a block of INT8_BLOCK): each
        node's ``x`` crosses so, and every node sums them all in float32, in node order.
        ``check``: the links' wait's (DataLinks.exchange)."""
        x = np.ascontiguousarray(x, np.float32).reshape(-1)
        try:
            return self._sum(x, wire, check)
        except LinkLost:
            if check is None:  # the main thread: a lost node is the launcher's to tell
                self.ctx.await_word(WORD_S)
            raise

    def take(self, x, source):
        """Node ``source``'s ``x`` (float32, 1-D, the same length everywhere), on every
        node: what a node that joins late takes."""
        x = np.ascontiguousarray(x, np.float32).reshape(-1)
        peer = source * self.nlocal + self.ctx.local_rank
        try:
            if self.node == source:
                self.links.exchange(dict.fromkeys(self.order, x), {})
                return x.copy()
            return self.links.exchange({}, {peer: x.nbytes})[peer].view(np.float32)
        except LinkLost:
            self.ctx.await_word(WORD_S)
            raise

    def _sum(self, x, wire, check):
        if wire is None and self.nnodes > 2:
            return self._ring(x, check)
        mine = encode(x, wire)
        got = self.links.allgather(mine, check)
        parts = [None] * self.nnodes
        parts[self.node] = mine
        for peer, payload in got.items():
            parts[self.order[peer]] = payload
        total = decode(parts[0], x.size, wire).copy()
        for payload in parts[1:]:
            total += decode(payload, x.size, wire)
        return total

    def _ring(self, x, check):
        """The float32 sum by a ring of the nodes: node i's chunk c travels on to node i + 1,
        which adds its own, for nodes - 1 steps; then each node's finished chunk goes round."""
        m, i = self.nnodes, self.node
        bounds = _chunks(x.size, m)
        total = x.copy()
        chunk = lambda c: total[bounds[c]:bounds[c + 1]]  # noqa: E731
        for step in range(m - 1):  # reduce-scatter: node i ends with chunk i + 1 summed
            out, into = (i - step) % m, (i - step - 1) % m
            got = self.links.exchange({self.next: chunk(out)},
                                      {self.previous: chunk(into).nbytes}, check)[self.previous]
            chunk(into)[:] = got.view(np.float32) + chunk(into)
        for step in range(m - 1):  # all-gather: the finished chunks, copied as they are
            out, into = (i + 1 - step) % m, (i - step) % m
            got = self.links.exchange({self.next: chunk(out)},
                                      {self.previous: chunk(into).nbytes}, check)[self.previous]
            chunk(into)[:] = got.view(np.float32)
        return total

    def sent_bytes(self, n, wire=None):
        """The bytes that one sum of ``n`` values puts on the wire from this rank."""
        if wire is None and self.nnodes > 2:
            sizes = np.diff(_chunks(n, self.nnodes))
            m, i = self.nnodes, self.node
            return 4 * int(2 * n - sizes[(i + 1) % m] - sizes[(i + 2) % m])
        return (self.nnodes - 1) * self.wire_bytes(n, wire)

    @staticmethod
    def wire_bytes(n, wire=None):
        """The bytes of ``n`` values on the wire, to one other node."""
        if wire == "bfloat16":
            return 2 * n
        if wire == "int8":
            return n + 4 * -(-n // INT8_BLOCK)
        return 4 * n

    def close(self):
        self.links.close()


def _chunks(n, m):
    """The bounds of ``m`` near-equal chunks of ``n`` values."""
    return [c * n // m for c in range(m + 1)]


def encode(x, wire):
    """``x`` (float32) as it crosses: its bytes as a uint8 array."""
    if wire is None:
        return x.view(np.uint8)
    if wire == "bfloat16":
        import ml_dtypes  # JAX's own dtypes: rounded to nearest even, as XLA rounds
        return x.astype(ml_dtypes.bfloat16).view(np.uint8)
    if wire == "int8":
        # Per block: a scale (its largest magnitude / 127) and the values in int8, rounded
        # to nearest even; the last block padded with zeros.
        blocks = np.zeros(-(-x.size // INT8_BLOCK) * INT8_BLOCK, np.float32)
        blocks[:x.size] = x
        blocks = blocks.reshape(-1, INT8_BLOCK)
        scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
        q = np.round(blocks / np.where(scale > 0, scale, np.float32(1))).astype(np.int8)
        return np.concatenate([q.reshape(-1).view(np.uint8), scale.reshape(-1).view(np.uint8)])
    raise ValueError(f"no wire {wire!r} between nodes (float32, bfloat16 or int8)")


def decode(payload, n, wire):
    """The float32 values of ``n`` that ``payload`` (encode's bytes) carries."""
    if wire is None:
        return payload.view(np.float32)[:n]
    if wire == "bfloat16":
        import ml_dtypes
        return payload.view(ml_dtypes.bfloat16)[:n].astype(np.float32)
    nblocks = -(-n // INT8_BLOCK)
    q = payload[:nblocks * INT8_BLOCK].view(np.int8).reshape(nblocks, INT8_BLOCK)
    scale = payload[nblocks * INT8_BLOCK:].view(np.float32).reshape(nblocks, 1)
    return (q.astype(np.float32) * scale).reshape(-1)[:n]
