"""The Exchanger: a worker's arrays averaged with every other worker's, on CPUs or GPUs."""
import math
import time

from .. import methods
from .layout import ITEMSIZE, plan_layout

METHODS = methods.NAMES
WIRE_DTYPES = methods.WIRES


class Exchanger:
    """Averages a fixed list of parameter arrays across every worker of a run.

    ``layout`` is a list of (name, shape, dtype); ``method`` is a name of pympgu.methods
    ('auto', a kernel method, 'copy' (the seed's peer-copy method) or 'nccl' (NCCL alone,
    every rank of every node in one communicator: the baseline)) and only matters on GPUs.
    Across nodes every method but 'nccl' takes pympgu's hierarchy:
    the kernels inside each node, NCCL between nodes (pympgu.exchange.gpu). ``wire_dtype``
    is None (the layout's dtype), or 'bfloat16' / 'float16' for float32 layouts (see the
    module docstring). ``max_blocks`` caps the GPU averaging kernel's grid (every rank must
    give the same; None: twice the SM count), leaving SMs free for compute that overlaps it.
    ``shadow`` (GPUs; every rank the same) gives the peer group a shared shadow, nranks - 1
    more copies of the buffer, that peers copy their arrays into by DMA: the XLA exchanges
    that overlap computation then need no pack, and can cut a training step in two.
    ``stream_barriers=False`` (GPUs; every rank the same) makes the XLA exchanges' barriers
    kernels, as on drivers without stream memory operations.
    ``host=True`` takes the CPU workers' road (shared memory, and pympgu's TCP links between
    nodes) whatever the workers' devices: the arrays cross to the host and back (GPU
    workers' outer optimizer between nodes, every H steps); ``nodes=False`` keeps a GPU
    exchange inside its node (``between`` then carries what crosses the nodes).
    ``stats`` adds up the host seconds spent in each step and counts exchanges.
    """

    def __init__(self, ctx, layout, method="auto", wire_dtype=None, timeout=60.0,
                 max_blocks=None, shadow=False, stream_barriers=True, host=False, nodes=True):
        self.way = methods.get(method)  # what it can do
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
        self.on_host = bool(ctx.is_cpu or host)
        self.nodes = bool(nodes)  # whether this exchange crosses the nodes
        # The host Exchanger of an exchange kept inside its node (GPU workers under an outer
        # optimizer between nodes: pympgu.training.worker.make_exchanger); closed with it.
        self.between = None
        if self.on_host:
            from .host import HostBackend
            self.backend = HostBackend(self, timeout)
        else:
            from .gpu import CudaBackend
            self.backend = CudaBackend(self, timeout, stream_barriers)

    @property
    def nbytes(self) -> int:
        """Bytes of the staging buffer (enough for an exact exchange)."""
        return self.total * ITEMSIZE[self.dtype]

    def start(self, arrays, flat=False, entries=None, root=None, reach="world",
              source=None) -> None:
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
        ``root`` (CPU workers): every rank gets rank root's arrays instead of the average
        (a worker that joins a run takes its state so); ``source`` (CPU workers across
        nodes): every rank gets node source's (a node that joins late takes them so).
        ``reach`` (host exchanges across nodes): 'world', every rank's average; 'node', this
        node's ranks' alone; 'outer', the node's, then the outer step set by
        ``set_outer`` across the nodes on the parameters (pympgu.exchange.outer);
        'outer-all', the same and the rest averaged across the nodes too.
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
        if reach != "world" and not (self.on_host and root is None and kind == "exact"):
            raise ValueError(f"Exchanger.start(reach={reach!r}) averages exact arrays of host "
                             "exchanges only")
        if source is not None:
            if kind != "exact" or not self.on_host or reach != "world":
                raise ValueError("Exchanger.start(source=...) copies exact arrays between "
                                 "CPU workers only")
            self.backend.copy_from_node(source, self.dtype, count)
        elif root is None and reach != "world":
            self.backend.average(self.dtype, count, reach)
        elif root is None:
            self.backend.average(self.wire_dtype if kind == "delta" else self.dtype, count)
        elif kind != "exact" or not self.on_host:
            raise ValueError("Exchanger.start(root=...) copies exact arrays between CPU "
                             "workers only")
        else:
            self.backend.copy_from(root, self.dtype, count)
        self.stats["pack_s"] += t1 - t0
        self.stats["average_s"] += time.perf_counter() - t1
        self.pending = kind
        self._started = (lo, hi, count)

    @property
    def across(self):
        """The Exchanger that meets the other nodes: ``between`` where this exchange is kept
        inside its node, else this one."""
        return self.between or self

    def set_outer(self, name, count, wire=None, streams=1, overlap=0, **settings) -> None:
        """The outer optimizer ``name`` between the nodes (host exchanges; a name of
        pympgu.exchange.outer's registry) on the first ``count`` elements of the buffer (the
        parameters), for start(reach='outer' or 'outer-all'); ``wire``: what crosses between
        the nodes (None, 'bfloat16', 'int8'); ``streams``: the parameters' fragments that
        meet in turn, one each reach='outer'; ``overlap``: the node's exchanges of the whole
        state (reach='node') during which a fragment's sum across the nodes runs beside
        them (0: it blocks; fewer than the exchanges between two fragments); ``settings``:
        the optimizer's own."""
        from . import outer
        backend = self.backend
        if not self.on_host or backend.across is None:
            raise ValueError("an outer step is between the nodes of a host exchange "
                             "(Exchanger(host=True) on several nodes)")
        if name not in outer.REGISTRY:
            raise ValueError(f"no outer optimizer {name!r}: one of {', '.join(outer.NAMES)}")
        chunk = -(-self.total // backend.nranks)
        backend.outer = outer.REGISTRY[name](count, self.total, chunk, self.ctx.nnodes, wire,
                                             streams, **settings)
        backend.overlap = int(overlap)

    def part(self, lo, hi) -> int:
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

    def finish(self, flat=False, wait=True) -> list:
        """Complete the started exchange; the averaged arrays (views of the shared buffer:
        numpy arrays on CPU workers, DeviceArrays on GPUs).

        flat=True returns one 1-D array instead, each entry at its offset in ``offsets``
        (``total`` elements; after ``start(entries=...)``, the part's count, laid out as the
        first entries): a framework then imports the result once, not per array.
        wait=False (GPU) does not wait for the average: the views are then for consumers
        that import them through DLPack naming their stream, which orders them after it.
        Either way they hold the result until the next start() (CPU workers': until the
        start after it, the exchanges taking two buffers in turn); copy what is kept longer.
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

    def average_arrays(self, arrays) -> list:
        """start and finish in one call."""
        self.start(arrays)
        return self.finish()

    def close(self) -> None:
        """Release the staging buffer and every peer mapping; calling it again does nothing."""
        between, self.between = self.between, None
        if between is not None:
            between.close()
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
