"""PyTorch with pympgu's exchange: DDP's gradient buckets, or a whole model's replicas.

    import torch.distributed as dist, pympgu.ddp
    dist.init_process_group("nccl")            # or "gloo": the setup is all it carries
    model = DDP(net.cuda(rank), device_ids=[rank])
    state = pympgu.ddp.register(model)         # every rank, as DDP's constructor
    ...                                        # train as before
    state.close()

DDP hands each bucket of gradients, once it is complete, to a communication hook
(``register_comm_hook``). This one copies the bucket into its own place in a buffer that
every rank maps into the others' processes (a :class:`pympgu.cuda.PeerGroup`), averages it
there with pympgu's kernels, reading the peers' memory over NVLink/P2P, and gives DDP the
mean in place, from which DDP copies it into the gradients. The mean is summed in rank
order and divided once, so every rank gets the same bits, as pympgu's training does.
Everything is queued on the stream DDP's backward runs on; the host never waits, so a step
captured in a CUDA graph captures its exchanges too (the kernels count their barriers on
in device memory: each replay is a fresh exchange).

Without DDP, :class:`ModelAverager` averages the replicas themselves every so often, as
pympgu's own training and the 2014 demo do (local SGD; torch's ``PeriodicModelAverager``):
the model's parameters, its batch norms' statistics and the optimizer's state live in the
shared buffer, so an average is the kernels alone.

The ranks of one machine share the buffer, and their GPUs must reach one another (peer
access). Ranks on several machines (as many on each) average float32 tensors the way
pympgu's training does across nodes: its kernels inside each machine, one NCCL
communicator a local index between them (PeerGroup.join_nodes). The process group carries
the setup only (the buffers' handles, NCCL's ids, and DDP's own broadcast of the first
parameters); pympgu's kernels and NCCL move every value.
"""
# Where each bucket's place starts, as the Exchanger's arrays; the dtypes pympgu averages.
from . import methods, settings
from .exchange import ALIGN_BYTES, ITEMSIZE


def _aligned(nbytes):
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def bucket_bytes(parameters) -> int:
    """Bytes that the gradients of ``parameters`` take in the buffer, each bucket aligned:
    enough for any bucketing DDP makes of them (each parameter's own place aligned is at
    least its share of any bucket's)."""
    return sum(_aligned(p.numel() * p.element_size()) for p in parameters if p.requires_grad)


class _Peers:
    """A PeerGroup over the ranks of a torch process group, set up collectively: what
    PeerState and ModelAverager share."""

    # What every rank's setup must agree on, beside the handles: the fact and what to do.
    ALIKE = {"layout": "average the same tensors (the same model, and optimizer state alike)",
             "nbytes": "size the buffer alike (nbytes, or the same parameters)",
             "method": "use the same method",
             "settings": "run with the same PYMPGU_* settings (pympgu.settings)"}

    across = None  # the NCCL communicator between hosts, when there are several

    def __init__(self, process_group, method, timeout):
        import torch
        import torch.distributed as dist
        from . import cuda

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("pympgu.ddp: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first")
        self.torch, self.cuda, self.process_group = torch, cuda, process_group
        self.rank = dist.get_rank(process_group)
        self.nranks = dist.get_world_size(process_group)
        self.method, self.timeout = method, timeout
        self.group = self.device = None
        self.local, self.node, self.nnodes = self.rank, 0, 1
        self.host_ranks = list(range(self.nranks))

    def _setup(self, prepare):
        """Collective. ``prepare()`` checks this rank's arguments and returns its CUDA
        device, the buffer's bytes and facts every rank must share (ALIKE's keys); then the
        ranks meet, and each maps the buffers of the ranks of its host. Ranks on several
        hosts also join one NCCL communicator a local index, which sums each slice between
        the hosts (PeerGroup.join_nodes)."""
        import torch.distributed as dist
        cuda = self.cuda
        # Every rank checks its arguments and makes its buffer before any rank gives up: one
        # that raised alone would leave its peers waiting in the gathers below.
        facts, error = {}, None
        try:
            methods.get(self.method, ("auto", *methods.KERNELS))
            self.device, nbytes, shared = prepare()
        except Exception as e:
            error = e
        if self.nranks == 1:  # nothing to exchange
            if error is not None:
                raise error
            return
        everyone = [None] * self.nranks
        try:
            # NCCL gathers objects through tensors on the current device: make it this
            # rank's own, or ranks that never set it would all gather on GPU 0.
            with self.torch.cuda.device(self.device or self.torch.cuda.current_device()):
                dist.all_gather_object(everyone, (_host(), _reason(error)),
                                       group=self.process_group)
                _raise_any(error, [e for _, e in everyone], "set up its exchange")
                self._place_on_hosts([h for h, _ in everyone])
                try:
                    # The staging area of 'push' and 'ce', and of 'auto' where it would push.
                    staging = methods.staging(self.method)
                    self.group = cuda.PeerGroup(self.local, len(self.host_ranks), nbytes,
                                                device=self.device.index,
                                                timeout=self.timeout, staging=staging)
                    facts = {"handle": self.group.handle, "device": self.device.index,
                             "nbytes": nbytes, "method": self.method,
                             "settings": settings.get().fingerprint(),
                             "max_blocks": self.group.max_blocks, **shared}
                except Exception as e:
                    error = e
                dist.all_gather_object(everyone, (facts, _reason(error)),
                                       group=self.process_group)
                _raise_any(error, [e for _, e in everyone], "set up its exchange")
                failure = None
                try:
                    self._connect(cuda, [f for f, _ in everyone])
                except Exception as e:
                    failure = e
                # Every rank has mapped every flags page (no name need stay in /dev/shm), or
                # every rank learns which could not: none is left waiting for it.
                dist.all_gather_object(everyone, _reason(failure), group=self.process_group)
                _raise_any(failure, everyone, "map its peers' buffers")
                self.group.release_names()
                if self.nnodes > 1:
                    self._join_nodes(dist)
        except BaseException:
            self.close()
            raise

    def _place_on_hosts(self, hosts):
        """This rank's host (node), and its place among the ranks there: the ranks of a
        host, in rank order, share a PeerGroup. The host is NCCL's: $NCCL_HOSTID where set,
        else the host name."""
        order = list(dict.fromkeys(hosts))
        counts = {h: hosts.count(h) for h in order}
        if len(set(counts.values())) != 1:
            raise ValueError("pympgu.ddp: every host must run as many ranks; ranks by host: "
                             + ", ".join(f"{h}: {n}" for h, n in counts.items()))
        mine = hosts[self.rank]
        self.host_ranks = [r for r, h in enumerate(hosts) if h == mine]
        self.local, self.node, self.nnodes = (self.host_ranks.index(self.rank),
                                              order.index(mine), len(order))
        self.first_host_ranks = [r for r, h in enumerate(hosts) if h == order[0]]

    def _join_nodes(self, dist):
        """One NCCL communicator of every host's rank of this local index: the first host's
        rank makes its id (docs/DECISIONS.md, "NCCL between nodes")."""
        cuda = self.cuda
        everyone = [None] * self.nranks
        mine = cuda.nccl_unique_id() if self.node == 0 else None
        dist.all_gather_object(everyone, mine, group=self.process_group)
        uid = everyone[self.first_host_ranks[self.local]]
        self.across = cuda.NcclComm(self.nnodes, self.node, uid, self.timeout)
        self.across.watch()
        self.group.join_nodes(self.across, self.nranks)

    def _across_dtype(self, dtype):
        if self.across is not None and dtype != "float32":
            raise ValueError(f"pympgu.ddp: rank {self.rank}: across hosts pympgu averages "
                             f"float32 tensors, got {dtype}")

    def _connect(self, cuda, facts):
        for key, what in self.ALIKE.items():
            values = [f.get(key) for f in facts]
            if any(v != values[0] for v in values):
                if isinstance(values[0], list):  # a layout: its first entry that differs
                    values = _first_difference(values)
                raise ValueError(f"pympgu.ddp: every rank must {what}; {key} by rank: " +
                                 ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
        own = self.device.index
        facts = [facts[r] for r in self.host_ranks]  # the peers are this host's ranks
        unreachable = [(r, f["device"]) for r, f in zip(self.host_ranks, facts)
                       if f["device"] != own and not cuda.can_access_peer(own, f["device"])]
        if unreachable:
            raise RuntimeError(f"pympgu.ddp: rank {self.rank}'s GPU {own} has no peer access "
                               "to " + ", ".join(f"rank {r}'s GPU {d}" for r, d in unreachable)
                               + "; keep torch.distributed's all-reduce on such a machine")
        # Every rank's kernels must take the same grid: their barriers count blocks.
        self.group.connect([f["handle"] for f in facts],
                           max_blocks=min(f["max_blocks"] for f in facts))

    def close(self) -> None:
        """Free the buffer, once this device's queued work is done."""
        if self.group is not None:
            try:
                self.torch.cuda.synchronize(self.device)
            finally:
                self._release()
                self.group.close()
                self.group = None
                if self.across is not None:
                    self.across.close()
                    self.across = None

    def _release(self):
        """What a subclass lets go of before the buffer is freed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PeerState(_Peers):
    """One rank's share of the exchange that :func:`average_hook` runs for DDP.

    Collective: every rank of ``process_group`` (default: the world) makes it alike, after
    the model is on its GPU. ``parameters`` (a module or an iterable) sizes the buffer
    (:func:`bucket_bytes`) unless ``nbytes`` is given. ``method`` is the PeerGroup's
    algorithm ('auto' picks by each bucket's size, README "Calling the kernel directly"),
    ``timeout`` how long a kernel waits for a peer before it traps. ``close()`` (or leaving
    a ``with`` block) frees the buffer once the device is done with it (DDP may still read
    it); the hook then fails if DDP calls it again.
    """

    def __init__(self, parameters, process_group=None, nbytes=None, method="auto",
                 timeout=60.0):
        super().__init__(process_group, method, timeout)
        self.cursor = 0
        self.places = {}  # (offset, n, dtype) -> (the PeerGroup's view, torch's view of it)

        def prepare():
            params = list(parameters.parameters() if hasattr(parameters, "parameters")
                          else parameters)
            device = _one_cuda_device(params, "the parameters")
            return device, (bucket_bytes(params) if nbytes is None else int(nbytes)), {}

        self._setup(prepare)

    def average(self, bucket):
        """The future of ``bucket``'s mean over the ranks (DDP's hook contract)."""
        torch = self.torch
        grads = bucket.buffer()
        future = torch.futures.Future(devices=[self.device])
        if self.group is None:
            future.set_result(grads)
            return future
        if bucket.index() == 0:  # DDP runs its buckets in order, every rank alike
            self.cursor = 0
        dtype = _dtype(grads)
        self._across_dtype(dtype)
        n, offset = grads.numel(), self.cursor
        self.cursor += _aligned(n * grads.element_size())
        if self.cursor > self.group.nbytes:
            raise ValueError(f"pympgu.ddp: rank {self.rank}: DDP's buckets take more than the "
                             f"{self.group.nbytes} bytes made for them; give PeerState the "
                             "parameters DDP trains, or a larger nbytes")
        place = self.places.get((offset, n, dtype))
        if place is None:
            view = self.group.data(dtype, (n,), offset)
            place = self.places[offset, n, dtype] = (view, torch.from_dlpack(view))
        view, mean = place
        stream = torch.cuda.current_stream(self.device)
        # DDP reads the last mean from here before its next backward starts: by then this
        # stream has waited for it, so the copy needs no wait of its own.
        mean.copy_(grads)
        # The group's stream after the copy, the kernel, and DDP's stream after the
        # kernel: events only, no host wait.
        self.group.stream.wait_for(stream.cuda_stream)
        self.group.allreduce(n, dtype, algo=self.method, synchronize=False, offset=offset)
        view.order_before(stream.cuda_stream)
        future.set_result(mean)
        return future

    def _release(self):
        self.places = {}


# No return annotation: DDP refuses any but the type torch.futures.Future[torch.Tensor]
# itself, and pympgu imports torch only when it is used.
def average_hook(state, bucket):
    """DDP communication hook: ``ddp.register_comm_hook(PeerState(...), average_hook)``;
    returns a torch.futures.Future of the bucket's mean."""
    if state.group is None and state.nranks > 1:
        raise RuntimeError(f"pympgu.ddp: rank {state.rank}: the PeerState is closed")
    return state.average(bucket)


def register(model, process_group=None, **options) -> "PeerState":
    """Make a :class:`PeerState` for the DDP module ``model`` and register
    :func:`average_hook` with it; returns the state. ``options`` go to PeerState."""
    if not hasattr(model, "register_comm_hook"):
        raise TypeError("pympgu.ddp.register takes the DistributedDataParallel module, got "
                        f"a {type(model).__name__}")
    state = PeerState(model.module, process_group=process_group, **options)
    try:
        model.register_comm_hook(state, average_hook)
    except BaseException:
        state.close()
        raise
    return state


class ModelAverager(_Peers):
    """Averages the replicas of a PyTorch model in place, as pympgu's training does: for a
    loop that trains each rank's replica on its own and averages every so often (local SGD;
    torch's ``PeriodicModelAverager``, with pympgu's kernels in place of its all-reduce).

        averager = pympgu.ddp.ModelAverager(model, optimizer)
        for step, (x, y) in enumerate(batches):
            loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
            if step % 4 == 3:
                averager.average()       # every rank, at the same steps
        averager.close()

    It averages the model's trainable parameters, its floating-point buffers (batch norms'
    running statistics; ``buffers=False`` leaves them) and, given the ``optimizer``, every
    floating-point tensor of its state shaped like its parameter (SGD's momentum, Adam's
    moments). Each mean is the rank-order float32 sum divided once: the same bits on every
    rank. Collective: every rank of ``process_group`` (default: the world) makes it alike
    and calls :meth:`average` at the same points.

    The first :meth:`average` (once the optimizer's state exists) moves each tensor into
    its own place in a buffer that every rank maps into the others' processes: the tensors
    stay the same objects (their ``.data`` points there), so every average after is the
    kernels alone, with no copy in or out, queued on the current stream without a host
    wait. A tensor found elsewhere (``optimizer.load_state_dict`` makes new ones) is copied
    back into its place first. :meth:`close` gives every tensor memory of its own again
    and frees the buffer. ``method`` and ``timeout`` are as for :class:`PeerState`. After
    the first, eager, :meth:`average`, later ones may be captured in a CUDA graph; a graph
    averages the places as they were when it was captured.
    """

    def __init__(self, model, optimizer=None, process_group=None, buffers=True,
                 method="auto", timeout=60.0):
        super().__init__(process_group, method, timeout)
        if not hasattr(model, "named_parameters"):
            raise TypeError(f"pympgu.ddp.ModelAverager takes a torch module, got a "
                            f"{type(model).__name__}")
        self.model, self.optimizer, self.buffers = model, optimizer, buffers
        self.ready = self.closed = False
        self.names = []   # of every tensor averaged, in order
        self.fixed = []   # the parameters and buffers: the same objects for good
        self.states = []  # (parameter, key): the optimizer's tensors, looked up anew
        self.places = []  # torch's views of the buffer, one per tensor, in order
        self.ptrs = []    # and where each starts
        self.offsets = []  # each tensor's place, in bytes
        self.regions = []  # (offset, n, dtype): one allreduce each
        self.stated = 0    # parameters the optimizer had state for at the setup
        self.flat = self.view = None

    def _collect(self):
        """The tensors to average, named, in order: the fixed ones, then the optimizer's."""
        torch = self.torch
        names = {}
        for name, p in self.model.named_parameters():
            names[p] = name
            if p.requires_grad:
                self.names.append(f"parameter {name}")
                self.fixed.append(p)
        if self.buffers:
            for name, b in self.model.named_buffers():
                if b.is_floating_point():
                    self.names.append(f"buffer {name}")
                    self.fixed.append(b)
        if self.optimizer is not None:
            self.stated = len(self.optimizer.state)
            for g, group in enumerate(self.optimizer.param_groups):
                for j, p in enumerate(group["params"]):
                    state = self.optimizer.state.get(p, {})
                    for key in sorted(state):
                        v = state[key]
                        if (torch.is_tensor(v) and v.is_floating_point()
                                and v.shape == p.shape):
                            where = names.get(p, f"{j} of parameter group {g}")
                            self.names.append(f"optimizer state {key!r} of {where}")
                            self.states.append((p, key))

    def _tensors(self, strict=True):
        """The tensors to average, in self.names' order, the optimizer's looked up anew. One
        that is gone raises, or with strict=False is left out."""
        if not self.states:
            return self.fixed
        state = self.optimizer.state
        try:  # one comprehension: average() calls it every time
            return self.fixed + [state.get(p, _NOTHING)[key] for p, key in self.states]
        except KeyError:
            pass
        found = [state.get(p, _NOTHING).get(key) for p, key in self.states]
        if strict:
            name = self.names[len(self.fixed) + found.index(None)]
            raise ValueError(f"pympgu.ddp: rank {self.rank}: {name} is gone since the "
                             "first average(); the optimizer's state must keep its "
                             "tensors (make the averager after it has stepped)")
        return self.fixed + [v for v in found if v is not None]

    def _prepare(self):
        self._collect()
        tensors = self._tensors()
        if not tensors:
            raise ValueError("pympgu.ddp: the model has nothing to average")
        device = _one_cuda_device(tensors, "the model and its state")
        specs = [(_dtype(t), t.numel()) for t in tensors]
        for name, t, (dtype, _) in zip(self.names, tensors, specs):
            if dtype not in ITEMSIZE:
                raise ValueError(f"pympgu.ddp: {name} is {dtype}; pympgu averages float32, "
                                 "float16 and bfloat16")
            if not _dense(t.shape, t.stride()):
                raise ValueError(f"pympgu.ddp: {name} overlaps itself or has gaps (strides "
                                 f"{tuple(t.stride())}); average a dense tensor")
        self.offsets, self.regions, nbytes = _layout(specs)
        layout = [(name, *spec) for name, spec in zip(self.names, specs)]
        return device, nbytes, {"layout": layout}

    def average(self):
        """Replace every rank's tensors with their mean over the ranks (collective)."""
        if self.closed:
            raise RuntimeError(f"pympgu.ddp: rank {self.rank}: the ModelAverager is closed")
        if not self.ready:
            if self.torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"pympgu.ddp: rank {self.rank}: the first average() sets the exchange up "
                    "(collective, and it allocates the shared buffer), which a CUDA graph "
                    "cannot capture; call it once before capturing")
            self._setup(self._prepare)
            self.ready = True
            for _, _, dtype in self.regions:
                self._across_dtype(dtype)
            if self.group is not None:
                self._place()
        if self.group is None:  # one rank: nothing to exchange
            return
        torch = self.torch
        if self.optimizer is not None and len(self.optimizer.state) != self.stated:
            # New tensors would have no place, and their replicas would drift apart.
            raise ValueError(f"pympgu.ddp: rank {self.rank}: the optimizer has state for "
                             f"{len(self.optimizer.state)} parameters, {self.stated} at the "
                             "first average(); make the ModelAverager's first average after "
                             "every parameter has stepped (or close it and make another)")
        tensors = self._tensors()
        if [t.data_ptr() for t in tensors] != self.ptrs:  # one moved: put it back
            self._readopt(tensors)
        # The group's stream after the model's work, the kernels, and the model's stream
        # after them: events only, no host wait.
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.group.stream.wait_for(stream)
        for offset, n, dtype in self.regions:
            self.group.allreduce(n, dtype, algo=self.method, synchronize=False, offset=offset)
        self.view.order_before(stream)

    def _readopt(self, tensors):
        for name, t, place, ptr in zip(self.names, tensors, self.places, self.ptrs):
            if t.data_ptr() != ptr:
                if t.shape != place.shape or t.dtype != place.dtype:
                    raise ValueError(f"pympgu.ddp: rank {self.rank}: {name} is now "
                                     f"{tuple(t.shape)} {t.dtype}, not {tuple(place.shape)} "
                                     f"{place.dtype} as at the first average()")
                place.copy_(t)
                t.data = place

    def _place(self):
        """Move every tensor into its place in the buffer, keeping its strides."""
        torch = self.torch
        self.view = self.group.data()
        self.flat = torch.from_dlpack(self.view)  # bytes
        for t, offset in zip(self._tensors(), self.offsets):
            raw = self.flat[offset:offset + t.numel() * t.element_size()]
            place = raw.view(t.dtype).as_strided(t.shape, t.stride())
            place.copy_(t)
            t.data = place
            self.places.append(place)
        self.ptrs = [p.data_ptr() for p in self.places]

    def close(self):
        """Give every tensor memory of its own again (same values, same strides) and free
        the buffer; average() then refuses."""
        self.closed = True
        super().close()

    def _release(self):
        places = set(self.ptrs)
        for t in self._tensors(strict=False) if places else ():
            if t.data_ptr() in places:
                t.data = t.data.clone(memory_format=self.torch.preserve_format)
        self.places, self.ptrs, self.flat, self.view = [], [], None, None


_NOTHING = {}  # an optimizer's state for a parameter that has none (never written)


def _dtype(t):
    """A torch tensor's dtype by pympgu's name for it ('float32', 'bfloat16', ...)."""
    return str(t.dtype).removeprefix("torch.")


def _one_cuda_device(tensors, what):
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"pympgu.ddp: {what} must all be on one CUDA device, found "
                         f"{sorted(map(str, devices))}")
    return next(iter(devices))


def _dense(shape, strides):
    """Whether a tensor of this shape and these strides (in elements) covers its numel()
    elements exactly once, as contiguous and channels-last tensors do."""
    if 0 in shape:
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(strides, shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _first_difference(lists):
    """Each list's entry at the first index where the lists differ (None past the end)."""
    k = next(k for k in range(max(map(len, lists)))
             if len({repr(v[k]) if k < len(v) else None for v in lists}) > 1)
    return [f"#{k} {v[k]}" if k < len(v) else f"{len(v)} entries" for v in lists]


def _layout(specs):
    """Places for tensors given as (dtype, numel), grouped by dtype so that each dtype is
    one span the kernels average in one call: (each tensor's byte offset, the spans as
    (offset, n, dtype), the bytes in all). Each place starts on ALIGN_BYTES."""
    dtypes = list(dict.fromkeys(d for d, _ in specs))
    offsets, regions, cursor = [None] * len(specs), [], 0
    for dtype in dtypes:
        start = cursor
        for k, (d, n) in enumerate(specs):
            if d == dtype:
                offsets[k] = cursor
                cursor += _aligned(n * ITEMSIZE[dtype])
        regions.append((start, (cursor - start) // ITEMSIZE[dtype], dtype))
    return offsets, regions, cursor


def _host():
    """The host as NCCL sees it: $NCCL_HOSTID where set (so that one machine's processes
    can play several hosts), else the host name."""
    import os
    import socket
    return os.environ.get("NCCL_HOSTID") or socket.gethostname()


def _reason(error):
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise_any(error, reasons, what):
    """After a gather of every rank's failure: this rank's own, else every rank raises
    naming the ranks that could not ``what`` (none is left waiting for another)."""
    if error is not None:
        raise error
    failed = [f"rank {r}: {e}" for r, e in enumerate(reasons) if e]
    if failed:
        raise RuntimeError(f"pympgu.ddp: not every rank could {what}; " + "; ".join(failed))

