cdef int check(int status) except -1 nogil:
    if status != 0:
        with gil:
            _raise(status, None)
    return 0


cdef _raise(int status, context):
    pmg_clear_last_error()
    raise CudaError(status, pmg_error_name(status).decode(), pmg_error_string(status).decode(),
                    context)


cdef size_t _align(size_t n, size_t a) noexcept nogil:
    return (n + a - 1) // a * a


def dtype_code(dtype):
    """The C API's code for a dtype name, or ValueError naming the dtypes pympgu averages."""
    try:
        return DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {str(dtype)!r}: pympgu averages float32, float16 and bfloat16"
        ) from None


# ---------------------------------------------------------------- devices

def runtime_version():
    """The CUDA runtime version pympgu was linked against, as an int (13000 for 13.0)."""
    cdef int v = 0
    check(pmg_runtime_version(&v))
    return v


def driver_version():
    """The installed driver's CUDA version as an int; 0 when no driver is present."""
    cdef int v = 0
    check(pmg_driver_version(&v))
    return v


def get_device_count():
    """The number of visible CUDA devices; raises CudaError when no driver or GPU works."""
    cdef int n = 0
    with nogil:
        check(pmg_get_device_count(&n))
    return n


def get_device():
    """The calling thread's current device."""
    cdef int d = 0
    check(pmg_get_device(&d))
    return d


def set_device(int device):
    """Make device current for the calling thread."""
    with nogil:
        check(pmg_set_device(device))


def device_name(int device):
    """The device's marketing name, as CUDA reports it."""
    cdef char buf[256]
    check(pmg_device_name(device, buf, sizeof(buf)))
    return buf.decode()


def device_sm_count(int device):
    """The number of streaming multiprocessors on device."""
    cdef int n = 0
    check(pmg_device_sm_count(device, &n))
    return n


def synchronize():
    """Wait for all work on the current device (not while a resident exchange runs there:
    that work never ends until it is closed)."""
    _refuse_device_wait(get_device(), "cuda.synchronize()")
    with nogil:
        check(pmg_device_synchronize())


# Devices on which a resident exchange kernel runs (PeerGroup.resident), and how many.
# Whatever waits for the whole device would wait for such a kernel forever, so pympgu's own
# host copies wait for their stream only, cuda.synchronize() refuses, and memory freed
# meanwhile (cudaFree waits for the device) is freed when the last one there ends.
_resident_on = {}
_deferred_frees = []  # (pointer, device)
# The running Residents themselves: held until closed, and closed at exit if the program
# did not, before the interpreter's teardown frees memory (which would wait for them).
_running = set()


@atexit.register
def _stop_residents():
    for resident in list(_running):
        try:
            resident.close()
        except (CudaError, RuntimeError):  # a dead kernel, or another thread in a call
            pass


def _refuse_device_wait(int device, what):
    if _resident_on.get(device):
        raise RuntimeError(f"{what} would wait forever for the resident exchange running on "
                           f"GPU {device}: close it (Resident.close) first")


cdef _free_device(void *ptr, int device):
    running = _resident_on  # None late in the interpreter's teardown: _stop_residents ran
    if running and running.get(device):
        _deferred_frees.append((<uintptr_t>ptr, device))
    else:
        pmg_free(ptr)


def pointer_device(uintptr_t ptr):
    """The device that holds the memory at ptr, or -1 for host memory."""
    cdef int d = -1
    check(pmg_pointer_device(<const void *>ptr, &d))
    return d


def can_access_peer(int device, int peer):
    """Whether device can read and write peer's memory directly (P2P)."""
    cdef int can = 0
    check(pmg_can_access_peer(device, peer, &can))
    return bool(can)


def enable_peer_access(int peer):
    """Let the current device access peer's memory; calling it twice is fine."""
    with nogil:
        check(pmg_enable_peer_access(peer))


# ---------------------------------------------------------------- streams and events

cdef class _OnDevice:
    """A with-block on ``device`` (-1: the current one), which then gives the caller its own
    device back: a CUDA event must be made on its stream's device, and some DLPack producers
    (torch) export only from their array's. A class, not contextlib: it runs per DDP bucket."""
    cdef int device, previous

    def __cinit__(self, int device):
        self.device, self.previous = device, -1

    def __enter__(self):
        cdef int current
        if self.device >= 0:
            current = get_device()
            if current != self.device:
                set_device(self.device)
                self.previous = current

    def __exit__(self, *exc):
        if self.previous >= 0:
            set_device(self.previous)
        return False


cdef class Stream:
    """A non-blocking CUDA stream on the device current at creation; high_priority gives it
    the device's highest priority (its kernels' blocks go first when SMs free up)."""
    cdef cudaStream_t handle
    cdef readonly int device

    def __cinit__(self, bint high_priority=False):
        self.handle = NULL
        self.device = get_device()
        check(pmg_stream_create(&self.handle, high_priority))

    @property
    def ptr(self):
        return <uintptr_t>self.handle

    def synchronize(self):
        """Wait for everything queued on this stream."""
        with nogil:
            check(pmg_stream_synchronize(self.handle))

    def wait_for(self, producer):
        """Make this stream wait, on the GPU, for the work queued so far on ``producer`` (a
        Stream, or a handle such as torch's ``cuda_stream``, of this stream's device); the
        host does not wait. Cheaper than DLPack's stream handshake, for a caller that knows
        the producer's stream."""
        with _OnDevice(self.device):  # the event must live on the producer's device
            check(pmg_stream_wait(self.handle, _stream_of(producer)))

    def close(self):
        """Destroy the stream; further use is an error."""
        if self.handle != NULL:
            pmg_stream_destroy(self.handle)
            self.handle = NULL

    def __dealloc__(self):
        if self.handle != NULL:
            pmg_stream_destroy(self.handle)


cdef cudaStream_t _stream_of(stream) except? NULL:
    if stream is None or stream == 0:
        return NULL
    if isinstance(stream, Stream):
        return (<Stream>stream).handle
    return <cudaStream_t><uintptr_t>int(stream)


cdef class Event:
    """A CUDA event: with timing (the default), for measuring device time between two
    records; without, a cheaper one for ordering streams."""
    cdef cudaEvent_t handle

    def __cinit__(self, bint timing=True):
        self.handle = NULL
        check(pmg_event_create(&self.handle, timing))

    def record(self, stream=None):
        """Record the event on stream (None: the legacy default stream)."""
        check(pmg_event_record(self.handle, _stream_of(stream)))

    def synchronize(self):
        """Wait until the event has completed."""
        with nogil:
            check(pmg_event_synchronize(self.handle))

    def elapsed_ms(self, Event end):
        """Milliseconds from this event to end (both recorded and completed)."""
        cdef float ms = 0
        check(pmg_event_elapsed_ms(self.handle, end.handle, &ms))
        return ms

    def __dealloc__(self):
        if self.handle != NULL:
            pmg_event_destroy(self.handle)
