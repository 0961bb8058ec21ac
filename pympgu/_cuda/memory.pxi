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
