# A rank's resident exchange: a kernel left running that averages each time the host rings.
# Blocks of a resident exchange by default (docs/DECISIONS.md, "The resident exchange").
RESIDENT_BLOCKS = 8


cdef class Resident:
    """A rank's resident exchange, from :meth:`PeerGroup.resident`: a kernel that stays on
    the GPU and averages the group's buffer each time :meth:`allreduce` rings it.

    A launched exchange pays a kernel launch and a wait on its stream, about 12 us from
    Python on an H200 host even with no peer to wait for; here the host writes a command into
    page-locked memory that the kernel polls, and polls the line where the kernel reports
    it done. The averaging is the 'll' algorithm's, in the same mailboxes, with the same
    bits. Every rank starts its own and rings the same commands in the same order. A context
    manager; ``close()`` stops the kernel (closing the group stops it too).
    """
    cdef PeerGroup group
    cdef pmg_doorbell *bell
    cdef readonly Stream stream
    cdef readonly int blocks
    cdef readonly int device
    cdef uint32_t count
    cdef readonly bint running
    # A call waits with the GIL released: another thread's ring or stop meanwhile would
    # overwrite the command the kernel is waiting for, and both would hang.
    cdef bint busy

    def __cinit__(self):
        self.bell = NULL
        self.running = False
        self.busy = False

    def __init__(self, PeerGroup group, int blocks):
        self.group = group
        self.blocks = blocks
        self.device = group.device
        set_device(self.device)
        check(pmg_doorbell_alloc(&self.bell))
        self.stream = Stream()
        # The kernel must not start before the group's queued work (a launched exchange
        # still in flight would share its mailboxes); waiting once here is cheap.
        group.synchronize()
        check(pmg_resident_start(&group.peers, group.rank, group.nranks, blocks,
                                 group.timeout_ns, self.bell, self.stream.handle))
        self.running = True
        self.count = 0
        group._resident = self
        _resident_on[self.device] = _resident_on.get(self.device, 0) + 1
        _running.add(self)

    def allreduce(self, size_t n, dtype="float32"):
        """Average the first n elements of every rank's data buffer, in place, and wait for
        it. Every rank calls it with the same n and dtype. The data must be in place: work
        that wrote it on a stream must be finished (synchronize that stream) first."""
        cdef int code = dtype_code(dtype)
        if not self.running:
            raise RuntimeError("this resident exchange is closed")
        self._enter()
        try:
            self._average(n, code)
        finally:
            self.busy = False

    cdef _enter(self):
        if self.busy:
            raise RuntimeError("this resident exchange is in a call already (from another "
                               "thread): one call at a time")
        self.busy = True

    cdef _average(self, size_t n, int code):
        cdef size_t nbytes = n * pmg_dtype_size(code)
        self.group._require_fit(n, code)
        if nbytes > LL_MAX_BYTES:
            raise ValueError(f"the resident exchange averages at most {LL_MAX_BYTES} bytes "
                             f"('ll'), got {nbytes}")
        self.count += 1
        cdef uint32_t count = self.count
        cdef uint64_t timeout_ns = self.group.timeout_ns
        cdef cudaStream_t s = self.stream.handle
        cdef int status
        check(pmg_resident_ring(self.bell, count, n, code))
        with nogil:
            status = pmg_resident_wait(self.bell, count, timeout_ns, s)
        if status != 0:
            if status != PMG_ERR_TIMEOUT:  # the kernel ended; after a timeout it may run on
                self._ended()
            _raise(status, f"rank {self.group.rank} of {self.group.nranks}, resident exchange "
                           f"{count} (if a peer died or stopped ringing, the kernel traps after "
                           f"{timeout_ns / 1e9:g} s)")

    cdef _ended(self):
        """The kernel is gone (or given up on): forget it, free what it held."""
        self.running = False
        _running.discard(self)
        if self.group is not None and self.group._resident is self:
            self.group._resident = None
        left = _resident_on.get(self.device, 0) - 1
        if left > 0:
            _resident_on[self.device] = left
        else:
            _resident_on.pop(self.device, None)
            keep = []
            for ptr, device in _deferred_frees:
                if device == self.device:
                    pmg_free(<void *><uintptr_t>ptr)
                else:
                    keep.append((ptr, device))
            _deferred_frees[:] = keep

    def close(self):
        """Stop the kernel and wait for it to end; calling it again does nothing."""
        cdef int status = 0
        cdef uint32_t count
        cdef cudaStream_t s
        if self.running:
            self._enter()  # the flag stays: a closed one takes no more calls
            self.count += 1
            count = self.count
            s = self.stream.handle
            with nogil:
                status = pmg_resident_stop(self.bell, count, s)
            self._ended()
        if self.bell != NULL:
            pmg_doorbell_free(self.bell)
            self.bell = NULL
        if self.stream is not None:
            self.stream.close()
        if status != 0:
            _raise(status, f"rank {self.group.rank} of {self.group.nranks}, resident exchange")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __dealloc__(self):
        # A kernel still running holds the doorbell: leave both to the process's end rather
        # than free memory the GPU polls.
        if self.bell != NULL and not self.running:
            pmg_doorbell_free(self.bell)
