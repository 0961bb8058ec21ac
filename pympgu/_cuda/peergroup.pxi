# The group of processes that average a buffer together: its registered block, the peers'
# mappings and the exchange's launches (its registration for the XLA operations and the
# stream barriers' watchdog: xla_group.pxi).

cdef class Resident  # below: a PeerGroup knows its running one


cdef class PeerGroup:
    """This process's replica in a group of nranks processes that average a buffer together.

    It allocates one registered block on the current (or given) device: a signal area that
    peers write barrier flags into, the mailboxes they store into for the algorithm 'll'
    (2 * nranks * 512 KiB), then ``nbytes`` of data, then (``staging``) the area the
    peers store into for the algorithms 'push' and 'ce', (nranks - 1) / nranks of ``nbytes``.
    staging=None allocates it when 'auto' would use it, for buffers of at least
    ``push_min_bytes()``. ``shadow`` adds nranks - 1 copies of ``nbytes`` that the
    peers copy their arrays into by DMA: the XLA operations' 'gather' algorithm then needs no
    pack (pympgu.xla.average_results, correct_during); without it, the shadow they need is
    private and allocated on first use. Every rank must pass the same nbytes, staging,
    shadow and stream_barriers. With ``stream_barriers`` (the default), more than one rank
    and a driver with stream memory operations it also makes the page of flags that the XLA
    pair's stream barriers use (HostFlags), named ``flags_prefix`` and random digits;
    without, the pair's barriers are kernels, which hold an SM while they wait. Share ``handle`` (the block's 64-byte
    IPC handle, then that page's name) with the peers, then ``connect()`` with every rank's
    handle in rank order; after that ``allreduce()`` averages the data buffers of all ranks
    in place with no host round-trip. ``close()`` unmaps the peers and frees the block.
    """
    cdef pmg_peers peers
    cdef readonly int rank
    cdef readonly int nranks
    cdef readonly size_t nbytes
    cdef readonly size_t data_offset
    cdef size_t stage_offset  # from the data to the staging area
    cdef readonly int device
    cdef readonly int max_blocks
    cdef readonly bint connected
    cdef public uint64_t timeout_ns
    cdef readonly object block
    cdef readonly Stream stream
    cdef readonly size_t stage_bytes
    cdef object mappings
    cdef object shadow  # a private shadow's DeviceBuffer
    cdef readonly size_t shadow_offset  # from the data to the shared shadow; 0: none
    cdef Stream copy_stream
    cdef Event order
    cdef int64_t _xla_id
    cdef Stream side  # the overlapped XLA pair's, made with the registration
    cdef Event side_in, side_out, side_first
    cdef pmg_stream_sync sync  # the XLA pair's stream barriers (pmg_group.stream_sync)
    cdef object watchdog  # the thread that times them out, once they are used
    cdef object watch_stop
    # The stream barriers' flags (stream_barriers, where the driver has the operations):
    # this rank's, and every rank's mapped here once connected (this one's too).
    cdef HostFlags flags
    cdef object rank_flags
    cdef object marks  # the pair's timeline events (record_timeline), or None
    # 'auto''s thresholds, read once: they are looked up at every small exchange.
    cdef size_t ll_max, oneshot_max, push_min, ce_min
    cdef Resident _resident  # while one runs: nothing else may exchange
    cdef NcclComm across  # join_nodes: the communicator of every node's rank of this index
    cdef int world
    cdef bint flat  # ...or of every rank, NCCL alone averaging

    def __init__(self, int rank, int nranks, size_t nbytes, device=None, double timeout=60.0,
                 staging=None, bint shadow=False, flags_prefix=None,
                 bint stream_barriers=True):
        if nranks < 1 or nranks > PMG_MAX_RANKS:
            raise ValueError(f"nranks must be 1 to {PMG_MAX_RANKS}, got {nranks}")
        if rank < 0 or rank >= nranks:
            raise ValueError(f"rank {rank} is outside 0..{nranks - 1}")
        if device is not None:
            set_device(device)
        self.device = get_device()
        self.rank = rank
        self.nranks = nranks
        self.nbytes = nbytes
        self.timeout_ns = <uint64_t>(timeout * 1e9)
        # The signal block, then the LL mailboxes (csrc/pympgu.h), then the data.
        self.data_offset = _align(sizeof(pmg_signal) + pmg_ll_bytes(nranks), _PAGE)
        self.ll_max = ll_max_bytes()
        self.oneshot_max = oneshot_max_bytes()
        self.push_min = push_min_bytes()
        self.ce_min = ce_min_bytes()
        if staging is None:
            staging = nranks > 1 and nbytes >= self.push_min
        self.stage_bytes = pmg_stage_bytes(nranks, nbytes) if staging else 0
        self.stage_offset = _align(nbytes, _PAGE)
        cdef size_t end = self.stage_offset + self.stage_bytes
        self.shadow_offset = 0
        if shadow and nranks > 1:
            self.shadow_offset = _align(end, _PAGE)
            end = self.shadow_offset + (nranks - 1) * _align(nbytes, _PAGE)
        self.block = DeviceBuffer(_align(self.data_offset + end, _PAGE))
        self.stream = Stream()
        self._resident = None
        if self.stage_bytes:
            self.copy_stream = Stream()
            self.order = Event(timing=False)
        self.mappings = []
        self.shadow = None
        self.connected = False
        self.max_blocks = min(2 * device_sm_count(self.device), PMG_MAX_BLOCKS)
        memset(&self.peers, 0, sizeof(pmg_peers))
        cdef void *base = <void *><uintptr_t>self.block.ptr
        # Zero the flags, counters and mailboxes before the handle leaves this process: a
        # peer may signal into them as soon as it has mapped them.
        cdef cudaStream_t s = self.stream.handle
        with nogil:
            check(pmg_memset_async(base, 0, self.data_offset, s))
            check(pmg_stream_synchronize(s))
        self.rank_flags = []
        if nranks > 1 and stream_barriers and pmg_stream_barrier_available() == 0:
            self.flags = HostFlags(_flags_name(flags_prefix), create=True)

    @property
    def handle(self):
        """What the peers need to connect to this rank: the 64-byte IPC handle of its
        registered block, then the name of its stream barriers' flags page, if it has one."""
        return ipc_get_handle(self.block) + (self.flags.name.encode() if self.flags else b"")

    @property
    def flags_name(self):
        """The name of this rank's stream barrier flags page in /dev/shm, or None."""
        return self.flags.name if self.flags is not None else None

    @property
    def sm_count(self):
        return device_sm_count(self.device)

    def data(self, dtype="uint8", shape=None, size_t offset=0):
        """A DeviceArray view of this rank's data buffer, written by work on the group's
        stream: consumers that name a stream through DLPack are ordered after it."""
        if shape is None:
            shape = ((self.nbytes - offset) // _ITEMSIZE[str(dtype)],)
        if offset + (np.prod(shape, dtype=np.int64) * _ITEMSIZE[str(dtype)]) > self.nbytes:
            raise ValueError("view overruns the group's data buffer")
        return self.block.view(dtype, shape, self.data_offset + offset, self.stream)

    @property
    def data_ptr(self):
        return self.block.ptr + self.data_offset

    def shadow_view(self, dtype="float32"):
        """A DeviceArray of ``dtype`` over the shared shadow (nranks - 1 slots; the XLA
        pair's peers push into it), or None without one. pympgu.xla.shadow_array gives it
        to JAX."""
        if not self.shadow_offset:
            return None
        n = (self.nranks - 1) * _align(self.nbytes, _PAGE) // _ITEMSIZE[dtype]
        return self.block.view(dtype, (n,), self.data_offset + self.shadow_offset)

    def connect(self, handles, max_blocks=None, flags_prefixes=None):
        """Map every peer's block; handles[r] is rank r's handle (ours is skipped).

        max_blocks must be the same on every rank (the launcher passes twice the smallest
        SM count in the group); by default twice this device's. flags_prefixes[r], if
        given, is how rank r's flags page name must begin (its ``flags_prefix``).
        Once every rank has connected, release_names() leaves nothing in /dev/shm.
        """
        if self.connected:
            raise RuntimeError("PeerGroup.connect called twice")
        if len(handles) != self.nranks:
            raise ValueError(f"connect needs {self.nranks} handles, got {len(handles)}")
        if max_blocks is not None:
            if not 1 <= max_blocks <= PMG_MAX_BLOCKS:
                raise ValueError(f"max_blocks must be 1 to {PMG_MAX_BLOCKS}, got {max_blocks}")
            self.max_blocks = max_blocks
        ipc, names = _split_handles(handles, self.nranks, flags_prefixes)
        if (names is None) != (self.flags is None):  # this rank's own handle was not given
            raise ValueError(f"rank {self.rank}: handles[{self.rank}] is not this group's "
                             "handle (stream barrier flags "
                             f"{'missing' if names is None else 'unexpected'})")
        set_device(self.device)
        cdef uintptr_t base
        try:
            for r, h in enumerate(ipc):
                if r == self.rank:
                    base = self.block.ptr
                else:
                    m = IpcMapping(h)
                    self.mappings.append(m)
                    base = m.ptr
                self.peers.signal[r] = <pmg_signal *>base
                self.peers.data[r] = <void *>(base + self.data_offset)
            for r, name in enumerate(names or ()):
                self.rank_flags.append(self.flags if r == self.rank else
                                       HostFlags(name, create=False))
        except CudaError as e:
            self._unmap()
            raise CudaError(e.status, e.name, e.message,
                            f"rank {self.rank} could not map rank {r}'s buffer") from None
        except OSError as e:  # a peer's flags page: gone, or never made on this machine
            self._unmap()
            raise OSError(e.errno, f"rank {self.rank} could not map rank {r}'s stream barrier "
                                   f"flags: {e.strerror}", e.filename) from None
        self.connected = True

    def release_names(self):
        """Remove this rank's flags page from /dev/shm, the mappings kept: call it once
        every rank has connected, and nothing is left there however the process ends."""
        if self.flags is not None:
            self.flags.unlink()

    cdef _require(self, size_t n, int code):
        self._require_idle()
        self._require_fit(n, code)

    cdef _require_fit(self, size_t n, int code):
        if n * pmg_dtype_size(code) > self.nbytes:
            raise ValueError(f"{n} elements do not fit the group's {self.nbytes}-byte buffer")

    cdef _require_idle(self):
        if not self.connected:
            raise RuntimeError("PeerGroup is not connected: call connect(handles) first")
        if self._resident is not None:
            raise RuntimeError(f"rank {self.rank}: the group's resident exchange is running; "
                               f"average through it, or close it first")

    def resident(self, blocks=None):
        """Start this rank's resident exchange (a :class:`Resident`; every rank starts its
        own): a kernel left running that averages the group's buffer by 'll' each time
        ``Resident.allreduce`` rings it, with no launch, for up to LL_MAX_BYTES. ``blocks``
        (default RESIDENT_BLOCKS, at most the SM count) of 512 threads stay on the GPU until
        it is closed; meanwhile the group's other methods refuse, and so does
        ``cuda.synchronize()``: anything that waits for the whole device (torch.cuda.
        synchronize, cudaFree) would wait for it forever."""
        self._require_idle()
        self._one_node("resident()")
        cdef int b = RESIDENT_BLOCKS if blocks is None else blocks
        if not 1 <= b <= min(self.sm_count, PMG_MAX_BLOCKS):
            raise ValueError(f"blocks must be 1 to the GPU's {self.sm_count} SMs (every block "
                             f"must fit on the device at once), got {b}")
        return Resident(self, b)

    def algorithm(self, size_t nbytes, algo="auto"):
        """The kernel method (pympgu.methods.KERNELS) that allreduce would use for nbytes."""
        return self._choose(nbytes, algo)

    cdef str _choose(self, size_t nbytes, algo):
        if methods.chooses(algo):
            return methods.choose(nbytes, self.stage_bytes > 0, self.ll_max, self.oneshot_max,
                                  self.push_min, self.ce_min)
        return methods.check_kernel(algo, nbytes, self.stage_bytes > 0, self.nranks,
                                    LL_MAX_BYTES)

    def allreduce(self, size_t n, dtype="float32", algo="auto", bint synchronize=True,
                  max_blocks=None, size_t offset=0):
        """Average n elements of every rank's data buffer, in place, on the GPU: the first
        n, or those from ``offset`` bytes in (a multiple of 16, for the kernels' vector
        loads), so that arrays averaged one after another keep their own places, as
        pympgu.ddp's gradient buckets do.

        algo: 'auto' (by size), or a kernel method of pympgu.methods (csrc/pympgu.h
        describes each); 'push' and 'ce' need staging (see the class). Every rank must call
        it with the same n, dtype, algo and max_blocks. max_blocks (default: the group's)
        caps the kernel's grid: fewer blocks leave SMs to work that runs beside the
        exchange. Returns the method used: after join_nodes, 'nodes' or 'nccl'.
        """
        cdef int code = dtype_code(dtype)
        self._require_idle()
        if offset % 16:
            raise ValueError(f"offset must be a multiple of 16 bytes, got {offset}")
        if offset + n * pmg_dtype_size(code) > self.nbytes:
            raise ValueError(f"{n} {dtype} elements from byte {offset} do not fit the "
                             f"group's {self.nbytes}-byte buffer")
        cdef int blocks = self.max_blocks if max_blocks is None else max_blocks
        if not 1 <= blocks <= PMG_MAX_BLOCKS:
            raise ValueError(f"max_blocks must be 1 to {PMG_MAX_BLOCKS}, got {blocks}")
        if self.across is None:
            chosen = self._choose(n * pmg_dtype_size(code), algo)
        elif self.across.comm == NULL:
            raise ValueError("the NCCL communicator is closed (aborted after an error?)")
        elif not self.flat and code != DTYPES["float32"]:
            raise ValueError("the average across nodes is float32")
        else:
            chosen = "nccl" if self.flat else "nodes"
        cdef pmg_group g
        self._fill(&g)
        cdef int a = ALGORITHM_CODES.get(chosen, 0)
        check(pmg_set_device(self.device))  # with the GIL held: it takes far less than a release
        # The one dispatch the XLA operations share (csrc/methods.cu): the kernels average
        # from byte `offset` of every rank's data; staging and the LL mailboxes stay where
        # they are.
        status = pmg_group_average(&g, offset, n, code, a, blocks, ce_chunk_bytes(),
                                   self.stream.handle)
        if self.across is not None and PMG_ERR_NCCL <= status < PMG_ERR_NCCL + 100:
            self.across._check(status, "averaging across nodes")
        self._launched(status, synchronize)
        if self.across is not None and self.across.failure is not None:
            raise self.across.failure
        return chosen

    cdef _fill(self, pmg_group *g):
        """What pmg_group_average and the XLA operations need of this group."""
        memset(g, 0, sizeof(pmg_group))
        g.peers = self.peers
        g.stage_offset = self.stage_offset
        g.nbytes = self.nbytes
        g.rank, g.nranks, g.device = self.rank, self.nranks, self.device
        g.timeout_ns = self.timeout_ns
        if self.copy_stream is not None:
            g.copy_stream = self.copy_stream.handle
            g.event = self.order.handle
        if self.across is not None:
            g.nccl_comm, g.world, g.nccl_flat = self.across.comm, self.world, self.flat

    def join_nodes(self, NcclComm across, int world, bint flat=False):
        """Make every later average of this group one of every node's ranks: this node's
        replicas are summed slice by slice (rank k's slice into its own replica), ``across``
        (an NcclComm of every node's rank k, on this group's GPU) sums each slice across the
        nodes, and the slice divided by ``world`` (every node's ranks) is stored into every
        replica here (pmg_node_average). float32 only; allreduce() and the XLA operations
        then take that road whatever their algorithm, and the methods that gather into a
        shadow, and resident(), are refused. Every rank of every node calls it alike.

        ``flat``: ``across`` holds every rank of every node instead, and NCCL alone averages
        the whole buffer (ncclAvg, any dtype): the baseline the hierarchy must beat, and the
        road for GPUs without peer access."""
        self._require_idle()
        if across.comm == NULL:
            raise ValueError("the NCCL communicator is closed")
        if across.device != self.device:
            raise ValueError(f"the NCCL communicator is on GPU {across.device}, the group on "
                             f"GPU {self.device}")
        if flat and world != across.nranks:
            raise ValueError(f"a flat communicator holds every rank: world {world}, "
                             f"communicator {across.nranks}")
        if not flat and world < self.nranks * across.nranks:
            raise ValueError(f"world must count every node's ranks ({self.nranks} x "
                             f"{across.nranks}), got {world}")
        self.across, self.world, self.flat = across, world, flat
        if self._xla_id:
            _xla_register(self, False)

    cdef _one_node(self, what):
        if self.across is not None:
            raise ValueError(f"{what} works inside one node; this group averages across "
                             "nodes (join_nodes): use allreduce()")

    def xla_id(self, bint shadow=False):
        """This group's id for pympgu's XLA operations (pympgu.xla), registering it on first
        use; close() unregisters it, after which functions traced with it fail with an error
        rather than touch freed memory. shadow: the operations also get the shadow of the
        gather algorithm: the shared one (see the class), or else a private one ((nranks - 1)
        * nbytes, allocated once, here)."""
        self._require_idle()
        if self._xla_id and (not shadow or self.shadow_offset or self.shadow is not None
                             or self.nranks == 1):
            return self._xla_id
        return _xla_register(self, shadow)

    def record_timeline(self):
        """Record timing events at each point of the exchanges through the XLA start/done
        pair from now on (xla_timeline reads them), for the probes in benchmarks/. A
        function traced before records them too: the group's registration is updated."""
        if self.marks is None:
            self.marks = [Event(timing=True) for _ in range(PMG_MARKS)]
            if self._xla_id:
                _xla_register(self, False)

    def xla_timeline(self):
        """Where the last exchange through the XLA start/done pair spent its time: a dict
        of milliseconds from its (first) start on XLA's stream to each point of
        ``XLA_MARKS`` (csrc/pympgu.h, pmg_mark). None unless record_timeline was called
        before it. Waits for that exchange to end."""
        if self.marks is None:
            return None
        self.marks[-1].synchronize()
        start = self.marks[0]
        return {name: start.elapsed_ms(ev) for name, ev in zip(XLA_MARKS, self.marks)}

    def copy_average(self, size_t n, dtype="float32", bint synchronize=True):
        """The seed's method: copy each peer's buffer into a shadow, then average locally."""
        cdef int code = dtype_code(dtype)
        self._one_node("copy_average()")
        self._require(n, code)
        cdef void *shadow = self._shadow()
        set_device(self.device)
        self._launched(pmg_copy_average(&self.peers, self.rank, self.nranks, shadow, n, code,
                                        self.timeout_ns, self.stream.handle), synchronize)

    def gather(self, size_t n, dtype="float32", bint synchronize=True):
        """First half of the copy method without GPU barriers: copy peers into the shadow.

        For GPUs without peer access to each other's memory: hold a host barrier before
        this and after it returns, then call shadow_average. ``synchronize=False`` leaves
        the copies queued on the group's stream (a probe may run them
        beside a training step).
        """
        cdef int code = dtype_code(dtype)
        self._one_node("gather()")
        self._require(n, code)
        set_device(self.device)
        self._launched(pmg_gather_peers(&self.peers, self.rank, self.nranks, self._shadow(), n,
                                        code, self.stream.handle), synchronize)

    def shadow_average(self, size_t n, dtype="float32", bint synchronize=True):
        """Second half of the copy method: average own buffer and the shadow, in place."""
        cdef int code = dtype_code(dtype)
        self._one_node("shadow_average()")
        self._require(n, code)
        set_device(self.device)
        self._launched(pmg_shadow_average(&self.peers, self.rank, self.nranks, self._shadow(),
                                          n, code, self.stream.handle), synchronize)

    def barrier(self, bint synchronize=True):
        """A GPU-side barrier of the whole group, queued on the group's stream."""
        self._require_idle()
        set_device(self.device)
        self._launched(pmg_device_barrier(&self.peers, self.rank, self.nranks, self.timeout_ns,
                                          self.stream.handle), synchronize)

    def synchronize(self):
        """Wait for the group's stream."""
        self._launched(0, True)

    cdef void *_shadow(self) except? NULL:
        if self.nranks == 1:
            return NULL
        if self.shadow_offset:
            return <void *><uintptr_t>(self.block.ptr + self.data_offset + self.shadow_offset)
        if self.shadow is None:
            self.shadow = DeviceBuffer((self.nranks - 1) * _align(self.nbytes, _PAGE),
                                       self.device)
        return <void *><uintptr_t>self.shadow.ptr

    cdef _launched(self, int status, bint synchronize):
        if status == 0 and synchronize:
            with nogil:
                status = pmg_stream_synchronize(self.stream.handle)
        if status != 0:
            context = f"rank {self.rank} of {self.nranks}"
            if status == 719:  # cudaErrorLaunchFailure: how a barrier timeout surfaces
                context += (f" (if a peer died or stopped exchanging, the GPU barrier traps "
                            f"after {self.timeout_ns / 1e9:g} s)")
            _raise(status, context)

    cdef _unmap(self):
        errors = []
        for m in self.mappings:
            try:
                m.close()
            except CudaError as e:
                errors.append(e)
        self.mappings = []
        for f in self.rank_flags:
            if f is not self.flags:
                try:
                    f.close()
                except CudaError as e:
                    errors.append(e)
        self.rank_flags = []
        memset(&self.peers, 0, sizeof(pmg_peers))
        self.connected = False
        return errors

    def close(self):
        """Unmap every peer and free this rank's memory; calling it again does nothing."""
        errors = []
        if self._resident is not None:
            try:
                self._resident.close()
            except CudaError as e:  # free the rest all the same
                errors.append(e)
        if self._xla_id:
            pmg_xla_unregister(self._xla_id)
            self._xla_id = 0
        _stop_watchdog(self)  # which lets every barrier still queued go
        if self.side is not None and self.rank_flags:
            # Its last barriers may still write into the peers' flags pages, unmapped next.
            try:
                self.side.synchronize()
            except CudaError as e:
                errors.append(e)
        errors += self._unmap()
        if self.flags is not None:
            try:
                self.flags.close()
            except CudaError as e:
                errors.append(e)
            self.flags = None
        if self.shadow is not None:
            self.shadow.close()
            self.shadow = None
        if self.block is not None:
            self.block.close()
        if self.stream is not None:
            self.stream.close()
        if self.copy_stream is not None:
            self.copy_stream.close()
        if self.side is not None:
            self.side.close()
            self.side = None
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
