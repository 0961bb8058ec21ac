# cython: language_level=3
"""pympgu's CUDA layer: the runtime calls pympgu needs, device memory, IPC, and the kernels.

Rules of this module, stated once:

* Every CUDA failure raises :class:`pympgu.CudaError` carrying CUDA's own error name and
  message; CUDA's last (non-sticky) error is cleared first, so one failure is reported once.
* The ``cuda``/``pmg_`` prefixes are dropped: ``get_device_count`` wraps ``cudaGetDeviceCount``.
  Results are returned, never passed through out-arguments.
* Pointers are Python ints (device addresses under UVA); IPC handles are 64 ``bytes``.
* Calls that can block (synchronisation, allocation, copies, opening handles) release the GIL.
* Enabling peer access that is already enabled counts as success.
"""
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

import atexit
import os

import numpy as np

from .errors import CudaError

MAX_RANKS = PMG_MAX_RANKS
IPC_HANDLE_BYTES = PMG_IPC_HANDLE_BYTES
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}
_TYPESTR = {"float32": "<f4", "float16": "<f2", "uint8": "|u1"}
_FROM_TYPESTR = {"<f4": "float32", "<f2": "float16", "|u1": "uint8", "<u1": "uint8"}
# Registered allocations put the peer-visible signal block first. The data, the staging
# area and the shadow that follow each start on a 2 MiB page (cudaMalloc's large pages), and
# the block is whole pages. Against the data only 256-byte aligned (18688 bytes past a page)
# in a block of no whole number of pages, 'ce' went from 3,873 to 2,928 us at 1 GiB and the
# copy method from 4,293 to 3,698; the wide MLP's --sync-every 1 step, whose arrays are
# copied into the shadow by DMA, went from 0.79 ms (sessions 12 and 14) to 0.71-0.72. Copies
# by DMA both ways from that offset ran at 307 GB/s in an allocation of no whole number of
# pages and at 390 in one of whole pages (docs/BENCHMARKS.md, session 16).
_PAGE = 2 << 20


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


# ---------------------------------------------------------------- device memory

cdef void _dlpack_deleter(DLManagedTensor *m) noexcept nogil:
    with gil:
        Py_DECREF(<object>m.manager_ctx)
    free(m.dl_tensor.shape)
    free(m)


cdef void _dlpack_capsule_destructor(object capsule) noexcept:
    # A capsule nobody consumed still owns its tensor; a consumer renames it "used_dltensor".
    cdef DLManagedTensor *m
    if PyCapsule_IsValid(capsule, b"dltensor"):
        m = <DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")
        m.deleter(m)


cdef class DeviceArray:
    """A typed, C-contiguous view of device memory that pympgu owns (or has mapped).

    It exports ``__cuda_array_interface__`` (v3) and DLPack, so CuPy, PyTorch and JAX can see
    it without a copy; it keeps its owner alive for as long as any consumer holds it.

    ``stream`` (a handle; 0 for none) is the stream whose queued work writes the memory. A
    consumer that names its own stream through DLPack gets that stream ordered after it,
    with no host wait; one that names none, or reads ``__cuda_array_interface__``, is told
    to synchronise with it.
    """
    cdef readonly object owner
    cdef readonly uintptr_t ptr
    cdef readonly tuple shape
    cdef readonly str dtype
    cdef readonly int device
    cdef readonly uintptr_t stream

    def __init__(self, owner, uintptr_t ptr, shape, dtype, int device, uintptr_t stream=0):
        if str(dtype) not in _ITEMSIZE:
            raise ValueError(f"unsupported dtype {dtype!r}")
        self.owner = owner
        self.ptr = ptr
        self.shape = tuple(int(s) for s in shape)
        self.dtype = str(dtype)
        self.device = device
        self.stream = stream

    @property
    def size(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self):
        return self.size * _ITEMSIZE[self.dtype]

    @property
    def __cuda_array_interface__(self):
        if self.dtype not in _TYPESTR:
            raise TypeError("bfloat16 has no __cuda_array_interface__ type string; use DLPack")
        return {"shape": self.shape, "typestr": _TYPESTR[self.dtype], "data": (self.ptr, False),
                "strides": None, "version": 3, "stream": self.stream or None}

    def __dlpack_device__(self):
        return (kDLCUDA, self.device)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        # The DLPack stream handshake: the consumer's stream (None: the legacy default
        # stream, as the standard says; -1: the consumer will synchronise itself) waits for
        # the work still queued on ours, and the host never does.
        if self.stream and stream != -1:
            self.order_before(1 if stream is None or stream == 0 else int(stream))
        cdef DLManagedTensor *m = <DLManagedTensor *>malloc(sizeof(DLManagedTensor))
        if m == NULL:
            raise MemoryError()
        cdef int ndim = len(self.shape)
        cdef int64_t *shape = <int64_t *>malloc(sizeof(int64_t) * max(ndim, 1))
        if shape == NULL:
            free(m)
            raise MemoryError()
        for i in range(ndim):
            shape[i] = self.shape[i]
        memset(m, 0, sizeof(DLManagedTensor))
        m.dl_tensor.data = <void *>self.ptr
        m.dl_tensor.device.device_type = kDLCUDA
        m.dl_tensor.device.device_id = self.device
        m.dl_tensor.ndim = ndim
        m.dl_tensor.shape = shape
        m.dl_tensor.strides = NULL
        m.dl_tensor.byte_offset = 0
        m.dl_tensor.dtype.lanes = 1
        m.dl_tensor.dtype.bits = 8 * _ITEMSIZE[self.dtype]
        m.dl_tensor.dtype.code = {"float32": kDLFloat, "float16": kDLFloat,
                                  "bfloat16": kDLBfloat, "uint8": kDLUInt}[self.dtype]
        Py_INCREF(self)
        m.manager_ctx = <void *>self
        m.deleter = _dlpack_deleter
        return PyCapsule_New(m, b"dltensor", _dlpack_capsule_destructor)

    def order_before(self, consumer):
        """Make the consumer stream (handle or Stream) wait for the work queued on
        self.stream; the host does not wait."""
        cdef cudaStream_t c = _stream_of(consumer)
        if not self.stream or <uintptr_t>c == self.stream:
            return
        with _OnDevice(self.device):  # the event must live on the producer stream's device
            check(pmg_stream_wait(c, <cudaStream_t>self.stream))

    def copy_from_host(self, array):
        """Copy a host array of the same byte size into this view (blocking)."""
        a = np.ascontiguousarray(array)
        if a.nbytes != self.nbytes:
            raise ValueError(f"host array has {a.nbytes} bytes, the view {self.nbytes}")
        self.order_before(0)  # _memcpy runs on the legacy stream
        _memcpy(self.ptr, a.ctypes.data, a.nbytes)

    def copy_from(self, src):
        """Copy a device array of the same byte size (any framework) into this view (blocking)."""
        info = array_info(src, "src")
        if info.size * _ITEMSIZE[info.dtype] != self.nbytes:
            raise ValueError(f"src has {info.size * _ITEMSIZE[info.dtype]} bytes, the view "
                             f"{self.nbytes}")
        self.order_before(0)
        _memcpy(self.ptr, info.ptr, self.nbytes)

    def copy_to_host(self):
        """A numpy copy of the view (bfloat16 comes back as uint16 storage)."""
        npdtype = np.uint16 if self.dtype == "bfloat16" else np.dtype(self.dtype)
        out = np.empty(self.shape, dtype=npdtype)
        self.order_before(0)  # the legacy stream does not wait for non-blocking ones
        _memcpy(out.ctypes.data, self.ptr, out.nbytes)
        return out

    def fill_bytes(self, int value):
        """Set every byte of the view to value (blocking); used to poison outputs."""
        cdef void *p = <void *>self.ptr
        cdef size_t n = self.nbytes
        self.order_before(0)
        with nogil:
            check(pmg_memset_async(p, value, n, NULL))
            check(pmg_stream_synchronize(NULL))

    def __repr__(self):
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device})"


def _memcpy(uintptr_t dst, uintptr_t src, size_t nbytes):
    # The legacy stream, waited for alone: callers order it after the data's own stream.
    with nogil:
        check(pmg_memcpy_async(<void *>dst, <const void *>src, nbytes, NULL))
        check(pmg_stream_synchronize(NULL))


cdef class DeviceBuffer:
    """``nbytes`` of device memory from cudaMalloc on ``device`` (default: the current one).

    A context manager; ``close()`` frees the memory at once, and views taken with ``view()``
    must not be used after that. Exports the whole buffer as uint8 through the array protocols.
    """
    cdef void *_ptr
    cdef readonly size_t nbytes
    cdef readonly int device

    def __cinit__(self, size_t nbytes, device=None):
        self._ptr = NULL
        if device is not None:
            set_device(device)
        self.device = get_device()
        self.nbytes = nbytes
        with nogil:
            check(pmg_malloc(&self._ptr, nbytes if nbytes else 1))

    @property
    def ptr(self):
        if self._ptr == NULL:
            raise ValueError("DeviceBuffer is closed")
        return <uintptr_t>self._ptr

    def view(self, dtype="uint8", shape=None, size_t offset=0, stream=None):
        """A DeviceArray of dtype and shape starting offset bytes into the buffer; stream is
        the one whose queued work writes it (see DeviceArray), if any."""
        itemsize = _ITEMSIZE.get(str(dtype))
        if itemsize is None:
            raise ValueError(f"unsupported dtype {dtype!r}")
        if shape is None:
            shape = ((self.nbytes - offset) // itemsize,)
        elif isinstance(shape, int):
            shape = (shape,)
        count = 1
        for s in shape:
            count *= int(s)
        if offset + count * itemsize > self.nbytes:
            raise ValueError(f"view of {count * itemsize} bytes at offset {offset} overruns "
                             f"a buffer of {self.nbytes} bytes")
        return DeviceArray(self, self.ptr + offset, shape, dtype, self.device,
                           <uintptr_t>_stream_of(stream))

    @property
    def __cuda_array_interface__(self):
        return self.view().__cuda_array_interface__

    def __dlpack__(self, **kwargs):
        return self.view().__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (kDLCUDA, self.device)

    def close(self):
        """Free the memory now; calling it again does nothing."""
        if self._ptr != NULL:
            _free_device(self._ptr, self.device)
            self._ptr = NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __dealloc__(self):
        if self._ptr != NULL:
            _free_device(self._ptr, self.device)


# ---------------------------------------------------------------- foreign arrays

class ArrayInfo:
    """Where a device array lives: pointer, element count, dtype name and device."""
    __slots__ = ("ptr", "size", "dtype", "device", "keepalive")

    def __init__(self, ptr, size, dtype, device, keepalive):
        self.ptr, self.size, self.dtype, self.device, self.keepalive = (
            ptr, size, dtype, device, keepalive)


def array_info(obj, what="array", stream=None):
    """Describe a C-contiguous device array from any framework, ready for use.

    ``stream`` (a handle or Stream, 0 for the legacy default stream) is where the caller
    will use the array. The array's producer then orders its pending work before that
    stream through DLPack's stream handshake, and the host does not wait; DLPack is read
    first. With stream None the host waits for the producer, and
    ``__cuda_array_interface__`` is read first. ``what`` names the argument in errors.
    """
    if isinstance(obj, DeviceArray):
        a = <DeviceArray>obj
        if stream is None:
            if a.stream:
                _sync_stream(a.stream)
        else:
            a.order_before(stream)
        return ArrayInfo(a.ptr, a.size, a.dtype, a.device, a)
    if stream is not None and hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, what, stream)
    cai = getattr(obj, "__cuda_array_interface__", None)
    # Some producers (torch) describe bfloat16 in CAI as an opaque '<V2': DLPack says more.
    if cai is not None and not (cai["typestr"] not in _FROM_TYPESTR and hasattr(obj, "__dlpack__")):
        return _from_cai(cai, obj, what)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, what)
    raise TypeError(f"{what} is a {type(obj).__name__}, not a device array: pympgu reads "
                    "__cuda_array_interface__ or DLPack")


def _size_and_contiguity(shape, strides, itemsize, what):
    n = 1
    for s in shape:
        n *= int(s)
    if strides is not None and n > 1:
        expect = itemsize
        for dim, stride in zip(reversed(shape), reversed(strides)):
            if dim != 1 and stride != expect:
                raise ValueError(f"{what} is not C-contiguous")
            expect *= dim
    return n


def _from_cai(cai, obj, what):
    typestr = cai["typestr"]
    dtype = _FROM_TYPESTR.get(typestr)
    if dtype is None:
        raise ValueError(f"{what} has element type {typestr!r}: pympgu averages float32, "
                         "float16 and bfloat16 (bfloat16 through DLPack)")
    n = _size_and_contiguity(tuple(cai["shape"]), cai.get("strides"), _ITEMSIZE[dtype], what)
    ptr = int(cai["data"][0])
    stream = cai.get("stream")
    if stream not in (None, 0, 1, 2):
        # CAI v3: the producer's work may still be running on its stream.
        _sync_stream(int(stream))
    device = pointer_device(ptr) if n else get_device()
    return ArrayInfo(ptr, n, dtype, device, obj)


def _from_dlpack(obj, what, stream=None):
    # Exported on the array's own device: torch exports only from there.
    dev = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else None
    with _OnDevice(int(dev[1]) if dev is not None and int(dev[0]) == kDLCUDA else -1):
        if stream is None:
            capsule = obj.__dlpack__()
        else:
            # DLPack forbids 0 for CUDA streams: the legacy default stream is 1.
            capsule = obj.__dlpack__(stream=(<uintptr_t>_stream_of(stream)) or 1)
    cdef DLManagedTensor *m = <DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")
    cdef DLTensor *t = &m.dl_tensor
    if t.device.device_type != kDLCUDA:
        raise ValueError(f"{what} is not on a CUDA device (DLPack device type "
                         f"{t.device.device_type})")
    key = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
    dtype = {(kDLFloat, 32, 1): "float32", (kDLFloat, 16, 1): "float16",
             (kDLBfloat, 16, 1): "bfloat16", (kDLUInt, 8, 1): "uint8"}.get(key)
    if dtype is None:
        raise ValueError(f"{what} has DLPack dtype {key}: pympgu averages float32, float16 "
                         "and bfloat16")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None
    if t.strides != NULL:
        strides = tuple(t.strides[i] * _ITEMSIZE[dtype] for i in range(t.ndim))
    n = _size_and_contiguity(shape, strides, _ITEMSIZE[dtype], what)
    ptr = <uintptr_t>t.data + t.byte_offset
    # The capsule stays unconsumed and alive in keepalive; its destructor releases the
    # producer's tensor once pympgu is done with the pointer.
    return ArrayInfo(ptr, n, dtype, t.device.device_id, capsule)


# ---------------------------------------------------------------- averaging of arrays

def average(inputs, out=None, stream=None, synchronize=True):
    """Write the mean of the device arrays in inputs (rank order) into out, in one launch.

    The arrays (1 to 8, any framework) must have one shape and dtype, and every input must
    be addressable from out's device: the same GPU, or a peer with peer access enabled.
    out defaults to inputs[0] (in place). Runs on stream (None: the legacy default stream),
    then waits for it unless synchronize is False. Returns out.
    """
    if out is None:
        out = inputs[0]
    cdef int nranks = len(inputs)
    if nranks < 1 or nranks > PMG_MAX_RANKS:
        raise ValueError(f"average takes 1 to {PMG_MAX_RANKS} inputs, got {nranks}")
    on = <uintptr_t>_stream_of(stream)  # the arrays' producers order their work before it
    o = array_info(out, "out", on)
    infos = [array_info(a, f"inputs[{r}]", on) for r, a in enumerate(inputs)]
    for r, info in enumerate(infos):
        if info.size != o.size or info.dtype != o.dtype:
            raise ValueError(f"inputs[{r}] has {info.size} {info.dtype} elements, out has "
                             f"{o.size} {o.dtype}")
    cdef int code = dtype_code(o.dtype)
    cdef const void *ptrs[PMG_MAX_RANKS]
    for r, info in enumerate(infos):
        ptrs[r] = <const void *><uintptr_t>info.ptr
    cdef void *dst = <void *><uintptr_t>o.ptr
    cdef size_t n = o.size
    cdef cudaStream_t s = _stream_of(stream)
    set_device(o.device)
    check(pmg_average(ptrs, nranks, dst, n, code, s))
    if synchronize:
        with nogil:
            check(pmg_stream_synchronize(s))
    return out


def average_many(replicas, outs=None, stream=None, synchronize=True):
    """Average many tensors in one launch: outs[t] = mean over r of replicas[r][t].

    replicas is a list (one per rank, 1 to 8) of equally long lists of device arrays; every
    tensor shares one dtype. outs defaults to replicas[0] (in place). Returns outs. The
    call always waits for the launch, since the uploaded table must outlive it.
    """
    nranks = len(replicas)
    if nranks < 1 or nranks > PMG_MAX_RANKS:
        raise ValueError(f"average_many takes 1 to {PMG_MAX_RANKS} replica lists, got {nranks}")
    if outs is None:
        outs = replicas[0]
    ntensors = len(outs)
    for r, lst in enumerate(replicas):
        if len(lst) != ntensors:
            raise ValueError(f"replicas[{r}] has {len(lst)} tensors, outs has {ntensors}")
    if ntensors == 0:
        return outs
    on = <uintptr_t>_stream_of(stream)
    o_infos = [array_info(x, f"outs[{t}]", on) for t, x in enumerate(outs)]
    dtype = o_infos[0].dtype
    entries, keep = [], []
    for t, o in enumerate(o_infos):
        if o.dtype != dtype:
            raise ValueError(f"outs[{t}] is {o.dtype}, outs[0] is {dtype}: one dtype per call")
        ins = []
        for r in range(nranks):
            info = array_info(replicas[r][t], f"replicas[{r}][{t}]", on)
            if info.size != o.size or info.dtype != dtype:
                raise ValueError(f"replicas[{r}][{t}] has {info.size} {info.dtype} elements, "
                                 f"outs[{t}] has {o.size} {dtype}")
            keep.append(info)
            ins.append(info.ptr)
        entries.append((ins, o.ptr, o.size))
    set_device(o_infos[0].device)
    table = TensorTable(ntensors, nranks, dtype)
    table.set(entries)
    table.launch(stream)
    _sync_stream(stream)
    return outs


def accumulate(ref, avg, stream=None, synchronize=True):
    """ref += avg on the GPU: ref float32, avg float16 or bfloat16 of the same size.

    The second half of the low-precision wire (TensorTable op "delta" is the first); the
    same arithmetic as pympgu.host_accumulate. Returns ref.
    """
    on = <uintptr_t>_stream_of(stream)
    r = array_info(ref, "ref", on)
    a = array_info(avg, "avg", on)
    if r.dtype != "float32":
        raise ValueError(f"ref must be float32, got {r.dtype}")
    if a.size != r.size:
        raise ValueError(f"avg has {a.size} elements, ref has {r.size}")
    cdef int code = dtype_code(a.dtype)
    cdef cudaStream_t s = _stream_of(stream)
    set_device(r.device)
    check(pmg_accumulate(<float *><uintptr_t>r.ptr, <const void *><uintptr_t>a.ptr, r.size,
                         code, s))
    if synchronize:
        with nogil:
            check(pmg_stream_synchronize(s))
    return ref


def _sync_stream(stream):
    cdef cudaStream_t s = _stream_of(stream)
    with nogil:
        check(pmg_stream_synchronize(s))


cdef class TensorTable:
    """A multi-tensor table kept in device memory, refilled and relaunched many times.

    set() takes entries (input pointers tuple, output pointer, n) and uploads them; launch()
    runs one kernel over all of them. op "average" (the default) writes the mean of an
    entry's nranks inputs (with nranks 1 it is a gather copy, which is how the exchanger
    packs parameters into its buffer in one launch). op "delta" takes two float32 inputs
    (x, ref) and writes round(x - ref) in dtype, float16 or bfloat16: the low-precision
    wire of pmg_host_delta.

    The table travels to the device on the launch stream from page-locked memory, so a
    launch never waits for the host or the device; set() waits only if the previous
    launch's upload has not left yet.
    """
    cdef readonly object buffer
    cdef readonly int capacity
    cdef readonly int ntensors
    cdef readonly int nranks
    cdef readonly uint64_t max_n
    cdef readonly int dtype_code
    cdef readonly str op
    cdef pmg_tensor *host
    cdef cudaEvent_t uploaded
    cdef bint pending

    def __cinit__(self, int capacity, int nranks, dtype, op="average"):
        self.host = NULL
        self.uploaded = NULL
        self.pending = False
        if capacity < 1 or nranks < 1 or nranks > PMG_MAX_RANKS:
            raise ValueError(f"TensorTable needs capacity >= 1 and 1 to {PMG_MAX_RANKS} ranks")
        if op not in ("average", "delta"):
            raise ValueError(f"op must be 'average' or 'delta', got {op!r}")
        if op == "delta" and (nranks != 2 or str(dtype) not in ("float16", "bfloat16")):
            raise ValueError("op 'delta' takes 2 inputs (x, ref) and a float16 or bfloat16 output")
        self.capacity, self.nranks, self.ntensors, self.max_n = capacity, nranks, 0, 0
        self.dtype_code = dtype_code(dtype)
        self.op = op
        self.buffer = DeviceBuffer(sizeof(pmg_tensor) * capacity)
        check(pmg_host_alloc(<void **>&self.host, sizeof(pmg_tensor) * capacity))
        check(pmg_event_create(&self.uploaded, 0))

    def set(self, entries):
        """Upload entries: a list of (input pointers, output pointer, element count)."""
        if len(entries) > self.capacity:
            raise ValueError(f"{len(entries)} entries exceed the table's {self.capacity}")
        if self.pending:  # the last upload may still be reading the host copy
            with nogil:
                check(pmg_event_synchronize(self.uploaded))
            self.pending = False
        memset(self.host, 0, sizeof(pmg_tensor) * self.capacity)
        self.max_n = 0
        for t, (ins, out, n) in enumerate(entries):
            if len(ins) != self.nranks:
                raise ValueError(f"entry {t} has {len(ins)} inputs, expected {self.nranks}")
            for r, p in enumerate(ins):
                self.host[t].inputs[r] = <const void *><uintptr_t>p
            self.host[t].out = <void *><uintptr_t>out
            self.host[t].n = n
            self.max_n = max(self.max_n, n)
        self.ntensors = len(entries)

    def launch(self, stream=None):
        """Upload the table and run the multi-tensor kernel over it on stream; neither the
        host nor the device is synchronised."""
        cdef const pmg_tensor *table = <const pmg_tensor *><uintptr_t>self.buffer.ptr
        cdef cudaStream_t s = _stream_of(stream)
        if self.ntensors == 0:
            return
        check(pmg_memcpy_async(<void *>table, self.host, sizeof(pmg_tensor) * self.ntensors, s))
        check(pmg_event_record(self.uploaded, s))
        self.pending = True
        if self.op == "delta":
            check(pmg_multi_delta(table, self.ntensors, self.max_n, self.dtype_code, s))
        else:
            check(pmg_multi_average(table, self.ntensors, self.nranks, self.max_n,
                                    self.dtype_code, s))

    def __dealloc__(self):
        if self.uploaded != NULL:
            if self.pending:
                pmg_event_synchronize(self.uploaded)
            pmg_event_destroy(self.uploaded)
        if self.host != NULL:
            pmg_host_free(self.host)


# ---------------------------------------------------------------- IPC

def ipc_get_handle(buffer):
    """The 64-byte IPC handle of a DeviceBuffer's allocation (its base address)."""
    cdef char handle[PMG_IPC_HANDLE_BYTES]
    cdef uintptr_t base = buffer.ptr
    check(pmg_ipc_get_handle(<void *>base, handle))
    return handle[:PMG_IPC_HANDLE_BYTES]


cdef class IpcMapping:
    """Another process's allocation mapped into this one; close() unmaps it."""
    cdef void *_ptr
    cdef readonly int device

    def __cinit__(self, bytes handle):
        if len(handle) != PMG_IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC handle is {PMG_IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        self._ptr = NULL
        self.device = get_device()
        cdef const char *h = handle
        with nogil:
            check(pmg_ipc_open_handle(h, &self._ptr))

    @property
    def ptr(self):
        if self._ptr == NULL:
            raise ValueError("IpcMapping is closed")
        return <uintptr_t>self._ptr

    def close(self):
        """Unmap; calling it again does nothing."""
        if self._ptr != NULL:
            p = self._ptr
            self._ptr = NULL
            check(pmg_ipc_close_handle(p))

    def __dealloc__(self):
        if self._ptr != NULL:
            pmg_ipc_close_handle(self._ptr)


def ipc_open_handle(bytes handle):
    """Map the allocation behind a peer's 64-byte IPC handle; returns an IpcMapping."""
    return IpcMapping(handle)


# ---------------------------------------------------------------- the peer group

LL_MAX_BYTES = PMG_LL_MAX_BYTES


def _env_bytes(name, default):
    """The byte count in environment variable name, or default when it is unset or empty."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a whole number of bytes, 0 or more; got {text!r}")
    return value


def ll_max_bytes(int nranks):
    """Largest buffer the 'auto' algorithm averages with 'll' (one crossing of the link, no
    barrier; csrc/pympgu.h); above it, one-shot or two-shot.

    Override with PYMPGU_LL_MAX_BYTES (0 turns 'll' off; at most LL_MAX_BYTES). On 2 H200s
    over NVLink (docs/BENCHMARKS.md, session 14) 'll' beat one-shot and two-shot at every
    size it takes, 4 KiB to 256 KiB, hence all of them. It stores R - 1 copies of twice the
    bytes, so with more ranks the crossover will come sooner; they are not measured yet and
    use the same.
    """
    return min(_env_bytes("PYMPGU_LL_MAX_BYTES", LL_MAX_BYTES), LL_MAX_BYTES)


def oneshot_max_bytes(int nranks):
    """Largest buffer the 'auto' algorithm sends one-shot; above it, two-shot.

    Override with PYMPGU_ONESHOT_MAX_BYTES. On 2 H200s over NVLink (docs/BENCHMARKS.md)
    one-shot won at 64 KiB and two-shot at 256 KiB, hence 128 KiB; more ranks are not
    measured yet and use the same.
    """
    return _env_bytes("PYMPGU_ONESHOT_MAX_BYTES", 128 * 1024)


def push_min_bytes(int nranks):
    """Smallest buffer the 'auto' algorithm averages with 'push' (two-shot by stores) rather
    than 'twoshot'; PeerGroups at least this large get a staging area by default.

    Override with PYMPGU_PUSH_MIN_BYTES. Measured on 2 H200s over NVLink (docs/BENCHMARKS.md):
    'push' beat 'twoshot' at 16 MiB, the smallest size it was timed at, and above; below
    16 MiB the staging memory is not known to buy anything. On 4 H200s (session 26, one
    run) 'push' took 3% less time than 'twoshot' at 1 MiB, 5% less at 16 MiB and 10% less
    at 64 MiB.
    """
    return _env_bytes("PYMPGU_PUSH_MIN_BYTES", 16 * 1024 * 1024)


def ce_min_bytes(int nranks):
    """Smallest buffer the 'auto' algorithm averages with 'ce' (two-shot, every byte by DMA)
    rather than 'push', in a PeerGroup with a staging area.

    Override with PYMPGU_CE_MIN_BYTES. On 2 H200s over NVLink (docs/BENCHMARKS.md, session
    17) 'ce' took 1% less time than 'push' at 512 MiB, 3% less at 768 MiB and 4% less at
    1 GiB, and 4% more at 256 MiB, where its few chunks pipeline less. More ranks use the
    same, though on 4 H200s (session 26, one run) 'ce' took 5% more time than 'push' at
    1 GiB and 6% more at 256 MiB: 512 MiB to 1 GiB on 4 GPUs is to be timed in rounds
    before the threshold depends on the number of ranks.
    """
    return _env_bytes("PYMPGU_CE_MIN_BYTES", 512 * 1024 * 1024)


def ce_chunk_bytes():
    """Bytes of each of the last two pipelined chunks of a rank's slice in the 'ce'
    algorithm; each chunk before them is twice the one after it (ce_chunks).
    PYMPGU_CE_CHUNK_BYTES overrides; every rank must use the same. On 2 H200s at 1 GiB, last
    chunks of 16 and 32 MiB took 2,841-2,852 us, 8 MiB 2,874-2,881, 4 MiB 2,890 and 128 MiB
    2,897; fixed 32 MiB chunks had taken 2,928 (docs/BENCHMARKS.md, session 17)."""
    return _env_bytes("PYMPGU_CE_CHUNK_BYTES", 16 * 1024 * 1024)


def ce_chunks(int nranks, size_t n, dtype, chunk_bytes=None):
    """The bounds, in elements from the start of a rank's slice, of the chunks that the 'ce'
    algorithm pipelines for n elements of dtype over nranks ranks: a list of chunks + 1
    offsets, the last the slice's length. chunk_bytes defaults to ce_chunk_bytes()."""
    cdef size_t bounds[PMG_CE_MAX_CHUNKS + 1]
    cdef int count = 0
    cdef size_t last = ce_chunk_bytes() if chunk_bytes is None else chunk_bytes
    status = pmg_ce_chunks(nranks, n, dtype_code(dtype), last, bounds, &count)
    if status:
        _raise(status, f"ce_chunks(nranks={nranks}, n={n}, chunk_bytes={last})")
    return [bounds[i] for i in range(count + 1)]


ALGORITHMS = ("ll", "oneshot", "twoshot", "push", "ce")
# The C API's code of each algorithm (pmg_algo).
# (The overlapped XLA pair also has "gather": pympgu.xla.)
ALGORITHM_CODES = {"ll": PMG_ALGO_LL, "oneshot": PMG_ALGO_ONESHOT,
                   "twoshot": PMG_ALGO_TWOSHOT, "push": PMG_ALGO_PUSH, "ce": PMG_ALGO_CE,
                   "gather": PMG_ALGO_GATHER}


XLA_OPERATIONS = ("pympgu_average", "pympgu_average_start", "pympgu_average_done",
                  "pympgu_average_wait")
# The points of an exchange that PeerGroup.xla_timeline reports, in pmg_mark's order.
XLA_MARKS = ("start", "side_begin", "first_sent", "last_start", "first_landed", "last_sent",
             "landed", "done", "averaged")
XLA_MARK_COUNT = PMG_MARKS


def _push_barrier_on_xla():
    """PYMPGU_PUSH_BARRIER: 'side' (the default) or 'xla', the stream that runs the barrier
    before the XLA pair's copies into the peers' shadows (csrc/pympgu.h, pmg_group)."""
    value = os.environ.get("PYMPGU_PUSH_BARRIER", "side")
    if value not in ("side", "xla"):
        raise ValueError(f"PYMPGU_PUSH_BARRIER must be 'side' or 'xla', got {value!r}")
    return value == "xla"


def _stream_barrier():
    """PYMPGU_STREAM_BARRIER: '1' (the default) runs the XLA pair's barriers as stream memory
    operations, where the driver has them (csrc/pympgu.h, pmg_stream_barrier); '0' runs
    barrier kernels, which hold an SM while they wait."""
    value = os.environ.get("PYMPGU_STREAM_BARRIER", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PYMPGU_STREAM_BARRIER must be '0' or '1', got {value!r}")
    return value == "1"


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


def _split_handles(handles, int nranks):
    """PeerGroup handles (``PeerGroup.handle``) as (the IPC handles, the names of the ranks'
    flags pages, or None when no rank has one). Ranks that disagree on stream barriers would
    wait for flags that never come: refused, naming them."""
    ipc, names = [], []
    for h in handles:
        h = bytes(h)
        if len(h) < PMG_IPC_HANDLE_BYTES:
            raise ValueError(f"a PeerGroup handle is at least {PMG_IPC_HANDLE_BYTES} bytes, "
                             f"got {len(h)}")
        ipc.append(h[:PMG_IPC_HANDLE_BYTES])
        names.append(h[PMG_IPC_HANDLE_BYTES:].decode())
    if nranks < 2 or not any(names):
        return ipc, None
    if not all(names):
        raise ValueError("every rank must set PYMPGU_STREAM_BARRIER alike (and have stream "
                         "memory operations); stream barriers by rank: " +
                         ", ".join(f"rank {r}: {'on' if n else 'off'}"
                                   for r, n in enumerate(names)))
    return ipc, names


cdef class HostFlags:
    """A page of stream barrier flags in POSIX shared memory (/dev/shm/<name>), page-locked
    and mapped for the GPUs: one rank's PMG_MAX_RANKS flags (pmg_stream_barrier), which the
    peers' GPUs write and its own GPU waits on. In host memory, not the GPU's, so that a
    watchdog reads and releases them with plain loads and stores (``view``): a CUDA call
    could wait behind the very barrier it should release (docs/BENCHMARKS.md, session 22).
    The creator zeroes the page and unlinks it when closed; every rank maps it."""
    cdef readonly str name
    cdef readonly object view  # numpy uint32, PMG_MAX_RANKS of them
    cdef object segment
    cdef void *host
    cdef void *device

    def __init__(self, str name, bint create):
        import mmap

        from . import shm
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


cdef class Resident  # below: a PeerGroup knows its running one


cdef class PeerGroup:
    """This process's replica in a group of nranks processes that average a buffer together.

    It allocates one registered block on the current (or given) device: a signal area that
    peers write barrier flags into, the mailboxes they store into for the algorithm 'll'
    (2 * nranks * 512 KiB), then ``nbytes`` of data, then (``staging``) the area the
    peers store into for the algorithms 'push' and 'ce', (nranks - 1) / nranks of ``nbytes``.
    staging=None allocates it when 'auto' would use it, for buffers of at least
    ``push_min_bytes(nranks)``. ``shadow`` adds nranks - 1 copies of ``nbytes`` that the
    peers copy their arrays into by DMA: the XLA operations' 'gather' algorithm then needs no
    pack (pympgu.xla.average_results, correct_during); without it, the shadow they need is
    private and allocated on first use. Every rank must pass the same nbytes, staging and
    shadow. With PYMPGU_STREAM_BARRIER=1 (the default) and more than one rank it also makes
    the page of flags that the XLA pair's stream barriers use (HostFlags), named
    ``flags_prefix`` and random digits. Share ``handle`` (the block's 64-byte
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
    # The stream barriers' flags (PYMPGU_STREAM_BARRIER=1, where the driver has the
    # operations): this rank's, and every rank's mapped here once connected (this one's too).
    cdef HostFlags flags
    cdef object rank_flags
    cdef object marks  # the pair's timeline events (PYMPGU_XLA_TIMELINE=1), or None
    # 'auto''s thresholds, read from the environment once: a lookup there costs about a
    # microsecond, a fifth of what queueing a small exchange takes (docs/BENCHMARKS.md).
    cdef size_t ll_max, oneshot_max, push_min, ce_min
    cdef Resident _resident  # while one runs: nothing else may exchange

    def __init__(self, int rank, int nranks, size_t nbytes, device=None, double timeout=60.0,
                 staging=None, bint shadow=False, flags_prefix=None):
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
        self.ll_max = ll_max_bytes(nranks)
        self.oneshot_max = oneshot_max_bytes(nranks)
        self.push_min = push_min_bytes(nranks)
        self.ce_min = ce_min_bytes(nranks)
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
        if nranks > 1 and _stream_barrier() and pmg_stream_barrier_available() == 0:
            self.flags = HostFlags(_flags_name(flags_prefix), create=True)

    @property
    def auto_bytes(self):
        """'auto''s thresholds as this group read them: (ll_max_bytes, oneshot_max_bytes,
        push_min_bytes, ce_min_bytes)."""
        return (self.ll_max, self.oneshot_max, self.push_min, self.ce_min)

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

    def connect(self, handles, max_blocks=None):
        """Map every peer's block; handles[r] is rank r's handle (ours is skipped).

        max_blocks must be the same on every rank (the launcher passes twice the smallest
        SM count in the group); by default twice this device's.
        """
        if self.connected:
            raise RuntimeError("PeerGroup.connect called twice")
        if len(handles) != self.nranks:
            raise ValueError(f"connect needs {self.nranks} handles, got {len(handles)}")
        if max_blocks is not None:
            if not 1 <= max_blocks <= PMG_MAX_BLOCKS:
                raise ValueError(f"max_blocks must be 1 to {PMG_MAX_BLOCKS}, got {max_blocks}")
            self.max_blocks = max_blocks
        ipc, names = _split_handles(handles, self.nranks)
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
        cdef int b = RESIDENT_BLOCKS if blocks is None else blocks
        if not 1 <= b <= min(self.sm_count, PMG_MAX_BLOCKS):
            raise ValueError(f"blocks must be 1 to the GPU's {self.sm_count} SMs (every block "
                             f"must fit on the device at once), got {b}")
        return Resident(self, b)

    def algorithm(self, size_t nbytes, algo="auto"):
        """The algorithm ('ll', 'oneshot', 'twoshot', 'push' or 'ce') that allreduce would
        use for nbytes."""
        return self._choose(nbytes, algo)

    cdef str _choose(self, size_t nbytes, algo):
        if algo == "auto":
            if nbytes <= self.ll_max:
                return "ll"
            if nbytes <= self.oneshot_max:
                return "oneshot"
            if self.stage_bytes and nbytes >= self.ce_min:
                return "ce"
            if self.stage_bytes and nbytes >= self.push_min:
                return "push"
            return "twoshot"
        if algo not in ALGORITHMS:
            raise ValueError(f"algo must be 'auto' or one of {ALGORITHMS}, got {algo!r}")
        if algo in ("push", "ce") and not self.stage_bytes and self.nranks > 1:
            raise ValueError(f"algo {algo!r} needs a PeerGroup made with staging=True")
        if algo == "ll" and nbytes > LL_MAX_BYTES:
            raise ValueError(f"algo 'll' averages at most {LL_MAX_BYTES} bytes, got {nbytes}")
        return algo

    def allreduce(self, size_t n, dtype="float32", algo="auto", bint synchronize=True,
                  max_blocks=None, size_t offset=0):
        """Average n elements of every rank's data buffer, in place, on the GPU: the first
        n, or those from ``offset`` bytes in (a multiple of 16, for the kernels' vector
        loads), so that arrays averaged one after another keep their own places, as
        pympgu.ddp's gradient buckets do.

        algo: 'll' (every rank stores its values, flagged, into every peer's mailbox: small
        buffers), 'oneshot' (every rank reads every replica), 'twoshot' (each rank reads a slice
        of every replica and stores its mean into all), 'push' (two-shot by stores only) and
        'ce' (two-shot, every byte by DMA) are described in csrc/pympgu.h; 'push' and 'ce' need
        staging (see the class). 'auto' picks by size. Every rank must call it with the same
        n, dtype, algo and max_blocks. max_blocks (default: the group's) caps the kernel's
        grid: fewer blocks leave SMs to work that runs beside the exchange. Returns the
        algorithm used.
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
        chosen = self._choose(n * pmg_dtype_size(code), algo)
        cdef int a = ALGORITHM_CODES[chosen]
        # The kernels average from every rank's data[r]; staging and the LL mailboxes stay
        # where they are (the staging's distance shrinks by the offset, the mailboxes hang
        # off the signal block).
        cdef pmg_peers shifted = self.peers
        cdef size_t stage = self.stage_offset - offset
        cdef int r
        for r in range(self.nranks):
            shifted.data[r] = <void *>(<char *>self.peers.data[r] + offset)
        check(pmg_set_device(self.device))  # with the GIL held: it takes far less than a release
        if chosen == "ce":
            status = pmg_ce_allreduce_average(
                &shifted, stage, self.rank, self.nranks, n, code, ce_chunk_bytes(),
                blocks, self.timeout_ns, self.stream.handle,
                self.copy_stream.handle if self.copy_stream is not None else NULL,
                self.order.handle if self.order is not None else NULL)
        else:
            status = pmg_allreduce_average(&shifted, stage, self.rank, self.nranks, n, code, a,
                                           blocks, self.timeout_ns, self.stream.handle)
        self._launched(status, synchronize)
        return chosen

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
        cdef pmg_group g
        memset(&g, 0, sizeof(pmg_group))
        g.peers = self.peers
        g.stage_offset = self.stage_offset
        g.nbytes = self.nbytes
        g.rank, g.nranks, g.device = self.rank, self.nranks, self.device
        g.timeout_ns = self.timeout_ns
        if self.copy_stream is not None:
            g.copy_stream = self.copy_stream.handle
            g.event = self.order.handle
        set_device(self.device)
        if self.side is None:
            self.side = Stream(high_priority=True)
            self.side_in = Event(timing=False)
            self.side_out = Event(timing=False)
            self.side_first = Event(timing=False)
        g.side = self.side.handle
        g.side_in, g.side_out = self.side_in.handle, self.side_out.handle
        g.side_first = self.side_first.handle
        g.barrier_on_xla = _push_barrier_on_xla()
        if self.rank_flags:
            g.stream_sync = &self.sync
            for r in range(self.nranks):
                g.stream_flags[r] = <uint32_t *>(<HostFlags>self.rank_flags[r]).device
            self._start_watchdog()
        if self.marks is None and os.environ.get("PYMPGU_XLA_TIMELINE") == "1":
            self.marks = [Event(timing=True) for _ in range(PMG_MARKS)]
        if self.marks is not None:
            for i, ev in enumerate(self.marks):
                g.marks[i] = (<Event>ev).handle
        if shadow or self.shadow_offset or self.shadow is not None:
            g.shadow = self._shadow()
            g.shadow_offset = self.shadow_offset
        check(pmg_xla_register(&g, &self._xla_id))  # a new id, or the same id updated
        return self._xla_id

    def _start_watchdog(self):
        import threading
        if self.watchdog is not None:
            return
        self.watch_stop = threading.Event()
        self.watchdog = threading.Thread(target=self._watch, daemon=True,
                                         name=f"pympgu-barrier-watchdog-{self.rank}")
        self.watchdog.start()

    def _watch(self):
        """The stream barriers' timeout (a barrier kernel has its own): every so often, read
        how far this rank's stream got (its flag of its own) and what each peer announced.
        When the stream has waited more than the group's timeout for a peer that made no
        progress, mark the group, so that every later start fails with an error naming that
        peer (xla_ffi.cc, peers_in_step), say so on stderr, and from then on let the stream
        past every barrier it waits at (write the number it waits for in the late peers'
        place): XLA's stream, and the host behind it, are not held for good. The exchanges
        let go that way end without the late peer's values. When the group closes, every
        barrier still queued is let go, so that nothing on the device waits for good.

        Plain loads and stores in host memory, and no CUDA call: the first launch of a kernel
        that CUDA loads lazily waits for a pending stream wait and holds the driver
        meanwhile, so a copy here could wait behind the very barrier it should release
        (docs/BENCHMARKS.md, session 22)."""
        import sys
        import time
        n, rank = self.nranks, self.rank
        flags = self.flags.view
        watch = BarrierWatch(rank, self.timeout_ns / 1e9)
        while not self.watch_stop.wait(min(0.25, watch.timeout / 8)):
            found = watch.late
            late = watch.look([int(flags[p]) for p in range(n)], time.monotonic())
            if found is None and watch.late is not None:
                # Marked before the stream goes on: the start that follows must see it.
                self.sync.late_rank_plus_one = watch.late + 1
                print(f"pympgu: rank {rank} of {n} waited more than {watch.timeout:g} s at "
                      f"an exchange's barrier for rank {watch.late}, which died or stopped "
                      "exchanging; its next exchange fails", file=sys.stderr, flush=True)
            for p in late:
                flags[p] = flags[rank]
        # Closing: no barrier is queued after this, so every one a peer has not announced
        # yet is let go.
        queued = self.sync.queued
        for p in watch.behind([int(flags[p]) for p in range(n)], queued):
            flags[p] = queued

    def _stop_watchdog(self):
        if self.watchdog is not None:
            self.watch_stop.set()
            self.watchdog.join()
            self.watchdog = None

    def xla_timeline(self):
        """Where the last exchange through the XLA start/done pair spent its time: a dict
        of milliseconds from its (first) start on XLA's stream to each point of
        ``XLA_MARKS`` (csrc/pympgu.h, pmg_mark). None unless PYMPGU_XLA_TIMELINE=1 was set
        when the group was registered (``xla_id``). Waits for that exchange to end."""
        if self.marks is None:
            return None
        self.marks[-1].synchronize()
        start = self.marks[0]
        return {name: start.elapsed_ms(ev) for name, ev in zip(XLA_MARKS, self.marks)}

    def copy_average(self, size_t n, dtype="float32", bint synchronize=True):
        """The seed's method: copy each peer's buffer into a shadow, then average locally."""
        cdef int code = dtype_code(dtype)
        self._require(n, code)
        cdef void *shadow = self._shadow()
        set_device(self.device)
        self._launched(pmg_copy_average(&self.peers, self.rank, self.nranks, shadow, n, code,
                                        self.timeout_ns, self.stream.handle), synchronize)

    def gather(self, size_t n, dtype="float32", bint synchronize=True):
        """First half of the copy method without GPU barriers: copy peers into the shadow.

        For GPUs without peer access to each other's memory: hold a host barrier before
        this and after it returns, then call shadow_average. ``synchronize=False`` leaves
        the copies queued on the group's stream (benchmarks/probe_timeline.py runs them
        beside a training step).
        """
        cdef int code = dtype_code(dtype)
        self._require(n, code)
        set_device(self.device)
        self._launched(pmg_gather_peers(&self.peers, self.rank, self.nranks, self._shadow(), n,
                                        code, self.stream.handle), synchronize)

    def shadow_average(self, size_t n, dtype="float32", bint synchronize=True):
        """Second half of the copy method: average own buffer and the shadow, in place."""
        cdef int code = dtype_code(dtype)
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
        self._stop_watchdog()  # which lets every barrier still queued go
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


# Blocks of a resident exchange by default: on 2 H200s, 8 averaged up to 64 KiB in under
# 10 us end to end (16 did 256 KiB in 10.5 against 14.3), and every block keeps work beside
# it off an SM: a matrix product ran 6-8% slower beside 1 block, 18-22% beside 8
# (docs/BENCHMARKS.md, session 15).
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
