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
    same arithmetic as pympgu._host.host_accumulate. Returns ref.
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
