"""PyTorch DistributedDataParallel with pympgu's exchange in place of its all-reduce.

    import torch.distributed as dist, pympgu.ddp
    dist.init_process_group("nccl")            # or "gloo": DDP's setup is all it carries
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
Everything is queued on the stream DDP's backward runs on; the host never waits.

The ranks must be processes of one machine whose GPUs reach one another (peer access).
The process group carries the setup only (the buffers' handles, and DDP's own broadcast of
the first parameters); pympgu's kernels move every gradient.
"""
from .exchange import ALIGN_BYTES  # where each bucket's place starts, as the Exchanger's arrays


def _aligned(nbytes):
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def bucket_bytes(parameters):
    """Bytes that the gradients of ``parameters`` take in the buffer, each bucket aligned:
    enough for any bucketing DDP makes of them (each parameter's own place aligned is at
    least its share of any bucket's)."""
    return sum(_aligned(p.numel() * p.element_size()) for p in parameters if p.requires_grad)


class PeerState:
    """One rank's share of the exchange that :func:`average_hook` runs for DDP.

    Collective: every rank of ``process_group`` (default: the world) makes it alike, after
    the model is on its GPU. ``parameters`` (a module or an iterable) sizes the buffer
    (:func:`bucket_bytes`) unless ``nbytes`` is given. ``method`` is the PeerGroup's
    algorithm ('auto' picks by each bucket's size, README "Calling the kernel directly"),
    ``timeout`` how long a kernel waits for a peer before it traps. ``close()`` (or leaving
    a ``with`` block) frees the buffer once the device is done with it.
    """

    def __init__(self, parameters, process_group=None, nbytes=None, method="auto",
                 timeout=60.0):
        import torch
        import torch.distributed as dist
        from . import cuda

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("pympgu.ddp: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first")
        self.torch, self.cuda, self.process_group = torch, cuda, process_group
        self.rank = dist.get_rank(process_group)
        self.nranks = dist.get_world_size(process_group)
        self.method = method
        self.group = self.device = None
        self.cursor = 0
        self.places = {}  # (offset, n, dtype) -> (the PeerGroup's view, torch's view of it)
        # Every rank checks its arguments and makes its buffer before any rank gives up: one
        # that raised alone would leave its peers waiting in the gather below.
        facts, error = {}, None
        try:
            if method not in ("auto", *cuda.ALGORITHMS):
                raise ValueError(f"method must be 'auto' or one of {cuda.ALGORITHMS}, "
                                 f"got {method!r}")
            params = list(parameters.parameters() if hasattr(parameters, "parameters")
                          else parameters)
            devices = {p.device for p in params}
            if len(devices) != 1 or next(iter(devices)).type != "cuda":
                raise ValueError("pympgu.ddp: the parameters must all be on one CUDA device, "
                                 f"found {sorted(map(str, devices))}")
            self.device = next(iter(devices))
            if self.nranks > 1:
                nbytes = bucket_bytes(params) if nbytes is None else int(nbytes)
                # The staging area of 'push' and 'ce', and of 'auto' where it would push.
                staging = {"push": True, "ce": True, "auto": None}.get(method, False)
                self.group = cuda.PeerGroup(self.rank, self.nranks, nbytes,
                                            device=self.device.index, timeout=timeout,
                                            staging=staging)
                facts = {"handle": self.group.handle, "device": self.device.index,
                         "nbytes": nbytes, "method": method,
                         "auto_bytes": self.group.auto_bytes,
                         "max_blocks": self.group.max_blocks, "host": _host()}
        except Exception as e:
            error = e
        if self.nranks == 1:  # nothing to exchange: the hook hands each bucket back
            if error is not None:
                raise error
            return
        try:
            reason = None if error is None else f"{type(error).__name__}: {error}"
            everyone = [None] * self.nranks
            # NCCL gathers objects through tensors on the current device: make it this
            # rank's own, or ranks that never set it would all gather on GPU 0.
            with torch.cuda.device(self.device or torch.cuda.current_device()):
                dist.all_gather_object(everyone, (facts, reason), group=process_group)
            if error is not None:
                raise error
            self._connect(cuda, [f for f, _ in everyone], [e for _, e in everyone])
        except BaseException:
            self.close()
            raise

    def _connect(self, cuda, facts, errors):
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed:
            raise RuntimeError("pympgu.ddp: not every rank could set up its exchange; "
                               + "; ".join(failed))
        for key, what in (("host", "run on one machine (CUDA IPC maps memory within one)"),
                          ("nbytes", "size the buffer alike (nbytes, or the same parameters)"),
                          ("method", "use the same method"),
                          ("auto_bytes", "use the same PYMPGU_LL_MAX_BYTES, "
                                         "PYMPGU_ONESHOT_MAX_BYTES, PYMPGU_PUSH_MIN_BYTES and "
                                         "PYMPGU_CE_MIN_BYTES")):
            values = [f[key] for f in facts]
            if any(v != values[0] for v in values):
                raise ValueError(f"pympgu.ddp: every rank must {what}; {key} by rank: " +
                                 ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
        own = self.device.index
        unreachable = [(r, f["device"]) for r, f in enumerate(facts)
                       if f["device"] != own and not cuda.can_access_peer(own, f["device"])]
        if unreachable:
            raise RuntimeError(f"pympgu.ddp: rank {self.rank}'s GPU {own} has no peer access "
                               "to " + ", ".join(f"rank {r}'s GPU {d}" for r, d in unreachable)
                               + "; keep DDP's own all-reduce on such a machine")
        # Every rank's kernels must take the same grid: their barriers count blocks.
        self.group.connect([f["handle"] for f in facts],
                           max_blocks=min(f["max_blocks"] for f in facts))

    def average(self, bucket):
        """The future of ``bucket``'s mean over the ranks (DDP's hook contract)."""
        torch, cuda = self.torch, self.cuda
        grads = bucket.buffer()
        future = torch.futures.Future(devices=[self.device])
        if self.group is None:
            future.set_result(grads)
            return future
        if bucket.index() == 0:  # DDP runs its buckets in order, every rank alike
            self.cursor = 0
        dtype = str(grads.dtype).removeprefix("torch.")
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
        # The group's stream after the copy (DLPack's stream handshake), the kernel, and
        # DDP's stream after the kernel: events only, no host wait.
        cuda.array_info(mean, "the bucket", stream=self.group.stream)
        self.group.allreduce(n, dtype, algo=self.method, synchronize=False, offset=offset)
        view.order_before(stream.cuda_stream)
        future.set_result(mean)
        return future

    def close(self):
        """Free the buffer, once this device's queued work is done (DDP may still read it).
        The hook then fails if DDP calls it again."""
        if self.group is not None:
            try:
                self.torch.cuda.synchronize(self.device)
            finally:
                self.places = {}
                self.group.close()
                self.group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def average_hook(state, bucket):
    """DDP communication hook: ``ddp.register_comm_hook(PeerState(...), average_hook)``."""
    if state.group is None and state.nranks > 1:
        raise RuntimeError(f"pympgu.ddp: rank {state.rank}: the PeerState is closed")
    return state.average(bucket)


def register(model, process_group=None, **options):
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


def _host():
    import socket
    return socket.gethostname()

