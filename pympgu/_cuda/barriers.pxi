# The XLA operations' handlers, and the stream barriers that their exchanges wait at: the
# flags page each rank's GPU waits on, and the watchdog that times a late peer out.

XLA_OPERATIONS = ("pympgu_average", "pympgu_average_start", "pympgu_average_done",
                  "pympgu_average_wait")
# The points of an exchange that PeerGroup.xla_timeline reports, in pmg_mark's order.
XLA_MARKS = ("start", "side_begin", "first_sent", "last_start", "first_landed", "last_sent",
             "landed", "done", "averaged")
XLA_MARK_COUNT = PMG_MARKS


def xla_handler(name="pympgu_average"):
    """A PyCapsule of the XLA FFI handler of the operation ``name`` (one of XLA_OPERATIONS;
    for jax.ffi.register_ffi_target), or None when pympgu was built without jaxlib's
    headers."""
    if name not in XLA_OPERATIONS:
        raise ValueError(f"no XLA operation {name!r}; pympgu has {XLA_OPERATIONS}")
    cdef void *handler = pmg_xla_handler(name.encode())
    if handler == NULL:
        return None
    return PyCapsule_New(handler, NULL, NULL)


class BarrierWatch:
    """What PeerGroup's watchdog decides from each look at this rank's stream barrier flags
    (HostFlags: how far this rank's stream got, and the last barrier each peer announced),
    apart from how it reads them: which peers to let the stream past.

    A peer is late when this rank's stream has reached a barrier the peer has not announced
    (numbers compared cyclically, as cuStreamWaitValue32 does). While none has been found,
    the stream is let past nothing, and a peer is found (``late``, the first such rank) once
    the flags have stayed the same, with a peer late, for more than ``timeout`` seconds. From
    then on every late peer is let past at once: the group has failed."""

    def __init__(self, rank, timeout):
        self.rank, self.timeout = rank, timeout
        self.late = None
        self._since = self._seen = None

    def look(self, flags, now):
        """The peers to let the stream past, given the flags read at time ``now`` (s)."""
        own = flags[self.rank]
        late = self.behind(flags, own)
        if self.late is None:
            state = (own, [flags[p] for p in late])
            if not late or state != self._seen:
                self._since, self._seen = now, state
                return []
            if now - self._since <= self.timeout:
                return []
            self.late = late[0]
        return late

    def behind(self, flags, queued):
        """The peers that have not announced barrier ``queued``: while watching, the one this
        rank's stream has reached; when the group closes, the last one it queued (those to
        let go then)."""
        return [p for p, f in enumerate(flags)
                if p != self.rank and 0 < (queued - f) % 2**32 < 2**31]


def _flags_name(prefix=None):
    """A name for a PeerGroup's flags page that no other group on this machine has: prefix
    (by default pympgu-flags-<pid>), then random digits."""
    import secrets
    return f"{prefix or f'pympgu-flags-{os.getpid()}'}-{secrets.token_hex(6)}"


def _split_handles(handles, int nranks, prefixes=None):
    """PeerGroup handles (``PeerGroup.handle``) as (the IPC handles, the names of the ranks'
    flags pages, or None when no rank has one). Ranks that disagree on stream barriers would
    wait for flags that never come: refused, naming them. A name not of pympgu's form (or
    not beginning with ``prefixes[r]``) is refused too: it must never reach another file."""
    from ..runtime import shm
    ipc, names = [], []
    for r, h in enumerate(handles):
        h = bytes(h)
        if len(h) < PMG_IPC_HANDLE_BYTES:
            raise ValueError(f"a PeerGroup handle is at least {PMG_IPC_HANDLE_BYTES} bytes, "
                             f"got {len(h)}")
        ipc.append(h[:PMG_IPC_HANDLE_BYTES])
        name = h[PMG_IPC_HANDLE_BYTES:].decode("ascii", "replace")
        if name:
            shm.check_name(name, prefixes[r] if prefixes is not None else None)
        names.append(name)
    if nranks < 2 or not any(names):
        return ipc, None
    if not all(names):
        raise ValueError("every rank must make its PeerGroup with stream_barriers alike (and "
                         "have stream memory operations); stream barriers by rank: " +
                         ", ".join(f"rank {r}: {'on' if n else 'off'}"
                                   for r, n in enumerate(names)))
    return ipc, names


cdef class HostFlags:
    """A page of stream barrier flags in POSIX shared memory (/dev/shm/<name>), page-locked
    and mapped for the GPUs: one rank's PMG_MAX_RANKS flags (pmg_stream_barrier), which the
    peers' GPUs write and its own GPU waits on. In host memory, not the GPU's, so that a
    watchdog reads and releases them with plain loads and stores (``view``): a CUDA call
    could wait behind the very barrier it should release (docs/DECISIONS.md, "Stream
    barriers").
    The creator zeroes the page and unlinks it when closed; every rank maps it."""
    cdef readonly str name
    cdef readonly object view  # numpy uint32, PMG_MAX_RANKS of them
    cdef object segment
    cdef void *host
    cdef void *device

    def __init__(self, str name, bint create):
        import mmap

        from ..runtime import shm
        self.segment = shm.Segment(name, mmap.PAGESIZE, create)
        self.name = name
        try:
            self.view = np.frombuffer(self.segment.buffer, np.uint32, count=PMG_MAX_RANKS)
            if create:
                self.view[:] = 0
            self.host = <void *><uintptr_t>self.view.ctypes.data  # the page's start
            check(pmg_host_register(self.host, mmap.PAGESIZE, &self.device))
        except BaseException:
            self.host = NULL
            self.close()
            raise

    def unlink(self):
        """Remove the page's name (the creator only); the mappings stay."""
        if self.segment is not None:
            self.segment.unlink()

    @property
    def device_ptr(self):
        """Where the GPU current at creation (and, portable, every GPU) addresses the flags."""
        return <uintptr_t>self.device

    def __del__(self):
        # Dropped unclosed: the creator's page must not stay in /dev/shm.
        try:
            self.close()
        except Exception:
            pass

    def close(self):
        """Unregister and unmap (the creator also unlinks); calling it again does nothing."""
        cdef int status = 0
        if self.host != NULL:
            status = pmg_host_unregister(self.host)
            self.host = NULL
        self.view = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        check(status)
