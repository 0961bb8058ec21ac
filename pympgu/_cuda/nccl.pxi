# NCCL, loaded at run time (csrc/nccl.cc): the exchange between nodes.

NCCL_MIN_VERSION = PMG_NCCL_MIN_VERSION
NCCL_ID_BYTES = 128
_NCCL_IN_PROGRESS = PMG_ERR_NCCL + 7


def nccl_candidates():
    """Where NCCL is looked for, in order: the nvidia-nccl wheel (JAX's CUDA plugin and
    PyTorch bring one), then the system's libnccl.so.2 (the loader's search path)."""
    import importlib.util
    found = []
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "lib", "libnccl.so.2")
        if os.path.exists(path):
            found.append(path)
    return found + ["libnccl.so.2"]


_nccl_loaded_from = []


def nccl_load(path=None):
    """Load NCCL once a process, from ``path`` or else the first of nccl_candidates() that
    loads, and return where it was loaded from; CudaError (pmgErrorNcclMissing) naming every
    place tried and why each failed, with the fix."""
    cdef char why[512]
    if pmg_nccl_loaded():
        return _nccl_loaded_from[0]
    tried = []
    for path in [path] if path is not None else nccl_candidates():
        if pmg_nccl_load(os.fsencode(path), why, sizeof(why)) == 0:
            _nccl_loaded_from.append(path)
            return path
        tried.append(f"{path}: {why.decode(errors='replace')}")
    raise CudaError(PMG_ERR_NCCL_MISSING, "pmgErrorNcclMissing",
                    "NCCL " + str(NCCL_MIN_VERSION // 10000) + "." +
                    str(NCCL_MIN_VERSION // 100 % 100) + " or later is needed between nodes "
                    "and was not found (" + "; ".join(tried) + "): pip install nvidia-nccl-cu13 "
                    "(or -cu12), or put the system's libnccl.so.2 on LD_LIBRARY_PATH")


def nccl_version():
    """The loaded NCCL's version code (22306 for 2.23.6); loads it first."""
    cdef int v = 0
    nccl_load()
    check(pmg_nccl_version(&v))
    return v


def nccl_unique_id():
    """A new NCCL unique id (128 bytes): one member of a communicator makes it, and the
    application hands it to every other member (pympgu: through its launchers)."""
    cdef pmg_nccl_id uid
    nccl_load()
    with nogil:
        check(pmg_nccl_unique_id(&uid))
    return uid.internal[:NCCL_ID_BYTES]


cdef class NcclComm:
    """One member of an NCCL communicator on the current device, non-blocking: nothing here
    waits for a peer without a deadline, and a failure or a timeout aborts the communicator
    (ncclCommAbort) before it raises, so no NCCL call is left to hang.

    Every member calls ``NcclComm(nranks, rank, uid, timeout)`` with the same ``uid``
    (:func:`nccl_unique_id`, made by one of them) at about the same time.
    """
    cdef void *comm
    cdef readonly int rank, nranks, device
    cdef readonly double timeout
    cdef readonly bint aborted
    cdef readonly object failure  # what the watch found, once it aborted the communicator
    cdef object watch_stop, watcher

    def __cinit__(self, int nranks, int rank, bytes uid, double timeout=60.0):
        cdef pmg_nccl_id id_
        self.comm = NULL
        self.aborted = False
        self.failure = self.watcher = None
        if len(uid) != NCCL_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {NCCL_ID_BYTES} bytes, got {len(uid)}")
        if not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} is not in a communicator of {nranks}")
        nccl_load()
        self.rank, self.nranks, self.timeout = rank, nranks, timeout
        check(pmg_get_device(&self.device))
        memcpy(id_.internal, <const char *>uid, NCCL_ID_BYTES)
        self._check(pmg_nccl_init(&self.comm, nranks, rank, &id_), "joining the communicator")
        self.wait("joining the communicator")

    cdef _check(self, int status, what):
        if status == 0 or status == _NCCL_IN_PROGRESS:
            return
        detail = pmg_nccl_last_error(self.comm).decode(errors="replace") if self.comm else ""
        self.abort()
        pmg_clear_last_error()
        raise CudaError(status, pmg_error_name(status).decode(),
                        pmg_error_string(status).decode() + (f" ({detail})" if detail else ""),
                        f"NCCL rank {self.rank} of {self.nranks}, {what}")

    def wait(self, what="an NCCL call", timeout=None):
        """Wait (the GIL released between polls) until the communicator's last call has been
        taken; abort it and raise after ``timeout`` seconds (the communicator's own)."""
        import time
        cdef int status
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        pause = 1e-5
        while True:
            if self.comm == NULL:
                raise CudaError(PMG_ERR_INVALID_ARGUMENT, "pmgErrorInvalidArgument",
                                "the NCCL communicator is closed", f"NCCL rank {self.rank}")
            status = pmg_nccl_state(self.comm)
            if status != _NCCL_IN_PROGRESS:
                self._check(status, what)
                return
            if time.monotonic() > deadline:
                self.abort()
                raise CudaError(PMG_ERR_TIMEOUT, "pmgErrorTimeout",
                                f"NCCL did not finish within {limit:g} s (a peer gone, or "
                                "not started?); the communicator was aborted",
                                f"NCCL rank {self.rank} of {self.nranks}, {what}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def error(self):
        """None while the communicator is sound, else its error as a CudaError (not raised):
        for a watchdog that polls it."""
        if self.comm == NULL:
            return None
        cdef int status = pmg_nccl_state(self.comm)
        if status in (0, _NCCL_IN_PROGRESS):
            return None
        return CudaError(status, pmg_error_name(status).decode(),
                         pmg_error_string(status).decode(), f"NCCL rank {self.rank}")

    def watch(self, double every=0.1):
        """Poll the communicator's asynchronous error from a thread, every ``every`` s; on
        one, abort it (a peer's loss then stops NCCL's kernels, and the stream and the host
        behind them go on) and keep the error in ``failure`` for the caller to raise."""
        import threading
        if self.watcher is not None:
            return
        self.watch_stop = threading.Event()
        self.watcher = threading.Thread(target=self._watch, args=(every,), daemon=True,
                                        name=f"pympgu-nccl-watch-{self.rank}")
        self.watcher.start()

    def _watch(self, every):
        while not self.watch_stop.wait(every):
            err = self.error()
            if err is not None:
                self.failure = err
                self.abort()
                return

    def abort(self):
        """ncclCommAbort: every call of this communicator queued or running stops, now."""
        cdef void *comm = self.comm
        if comm == NULL:
            return
        self.comm = NULL
        self.aborted = True
        with nogil:
            pmg_nccl_abort(comm)

    def close(self):
        """Finalize (waiting at most 10 s, or the timeout if shorter), then destroy; a
        communicator that cannot finalize is aborted."""
        if self.watcher is not None:
            self.watch_stop.set()
            self.watcher.join()
            self.watcher = None
        if self.comm == NULL:
            return
        try:
            self._check(pmg_nccl_finalize(self.comm), "closing")
            self.wait("closing", min(self.timeout, 10.0))
        except CudaError:
            return  # aborted already
        cdef void *comm = self.comm
        self.comm = NULL
        pmg_nccl_destroy(comm)

    def __dealloc__(self):
        if self.comm != NULL:
            pmg_nccl_abort(self.comm)
            self.comm = NULL
