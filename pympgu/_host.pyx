# cython: language_level=3
"""Host (CPU) averaging with the GPU kernels' arithmetic (csrc/host_average.cpp).

Replicas are summed in rank order in fp32 and divided once by R, so the result is bit-for-bit
what the device kernels produce. Arrays are numpy arrays (or anything exporting a writable
C-contiguous buffer); bfloat16 data travels as uint16 storage with ``dtype="bfloat16"``.
"""
from libc.stdint cimport int64_t, uint32_t, uintptr_t
from libc.stdlib cimport free, malloc

import numpy as np

DTYPES = {"float32": PMG_FLOAT32, "float16": PMG_FLOAT16, "bfloat16": PMG_BFLOAT16}
MAX_RANKS = PMG_MAX_RANKS
BARRIER_BYTES = PMG_HOST_BARRIER_BYTES


def dtype_code(dtype):
    """The C API's code for a dtype name, or ValueError naming the dtypes pympgu averages."""
    name = str(dtype)
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r}: pympgu averages float32, float16 and bfloat16"
        ) from None


def _check(status):
    if status != 0:
        raise ValueError(f"{pmg_status_name(status).decode()}: {pmg_status_string(status).decode()}")


def _wire_code(wire_dtype):
    if str(wire_dtype) not in ("float16", "bfloat16"):
        raise ValueError(f"wire dtype must be float16 or bfloat16, got {wire_dtype!r}")
    return dtype_code(wire_dtype)


cdef uintptr_t _flat(a, what, size_t itemsize, size_t n, bint writable) except 0:
    if not a.flags.c_contiguous or (writable and not a.flags.writeable):
        raise ValueError(f"{what} must be a {'writable ' if writable else ''}C-contiguous array")
    if a.itemsize != itemsize or a.size != n:
        raise ValueError(f"{what} has {a.size} items of {a.itemsize} bytes, expected "
                         f"{n} of {itemsize}")
    # 0 is this function's error value; an empty array's pointer is never dereferenced.
    return <uintptr_t>a.ctypes.data if a.size else <uintptr_t>1


def host_delta(x, ref, wire, wire_dtype="bfloat16"):
    """wire = round(x - ref) in wire_dtype: x and ref float32, wire 2-byte storage."""
    cdef int code = _wire_code(wire_dtype)
    cdef size_t n = x.size
    if x.dtype != np.float32 or ref.dtype != np.float32:
        raise ValueError("x and ref must be float32")
    cdef const float *px = <const float *>_flat(x, "x", 4, n, False)
    cdef const float *pr = <const float *>_flat(ref, "ref", 4, n, False)
    cdef void *pw = <void *>_flat(wire, "wire", 2, n, True)
    cdef int status
    with nogil:
        status = pmg_host_delta(px, pr, pw, n, code)
    _check(status)
    return wire


def host_accumulate(ref, avg, wire_dtype="bfloat16"):
    """ref += avg in float32, where avg holds wire_dtype values (2-byte storage)."""
    cdef int code = _wire_code(wire_dtype)
    cdef size_t n = ref.size
    if ref.dtype != np.float32:
        raise ValueError("ref must be float32")
    cdef float *pr = <float *>_flat(ref, "ref", 4, n, True)
    cdef const void *pa = <const void *>_flat(avg, "avg", 2, n, False)
    cdef int status
    with nogil:
        status = pmg_host_accumulate(pr, pa, n, code)
    _check(status)
    return ref


def host_average(inputs, out, dtype=None):
    """Write the mean of the arrays in inputs (rank order) into out, or into each array of
    the list out (one pass: the node's every replica at once); any may be an input."""
    cdef const void *ptrs[PMG_MAX_RANKS]
    cdef void *dsts[PMG_MAX_RANKS]
    cdef int nranks = len(inputs)
    if nranks < 1 or nranks > PMG_MAX_RANKS:
        raise ValueError(f"host_average takes 1 to {PMG_MAX_RANKS} inputs, got {nranks}")
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    cdef int nouts = len(outs)
    if nouts < 1 or nouts > PMG_MAX_RANKS:
        raise ValueError(f"host_average writes 1 to {PMG_MAX_RANKS} outputs, got {nouts}")
    name = str(outs[0].dtype if dtype is None else dtype)
    cdef int code = dtype_code(name)
    cdef size_t esize = pmg_dtype_size(code)
    cdef size_t n = outs[0].size
    for o, a in enumerate(outs):
        if not (a.flags.c_contiguous and a.flags.writeable):
            raise ValueError(f"output {o} must be a writable C-contiguous array")
        if a.size != n or a.itemsize != esize:
            raise ValueError(f"output {o} has {a.size} items of {a.itemsize} bytes; "
                             f"{name} needs {n} of {esize}")
        dsts[o] = <void *><uintptr_t>a.ctypes.data
    for r, a in enumerate(inputs):
        if not a.flags.c_contiguous:
            raise ValueError(f"input {r} is not C-contiguous")
        if a.size != n or a.itemsize != esize:
            raise ValueError(
                f"input {r} has {a.size} items of {a.itemsize} bytes; out has {n} of {esize}"
            )
        ptrs[r] = <const void *><uintptr_t>a.ctypes.data
    cdef int status
    with nogil:
        status = pmg_host_average(ptrs, nranks, dsts, nouts, n, code)
    _check(status)
    return out


def set_threads(int n):
    """Use n threads in all (the caller's among them) for host_average and host_copy from
    now on, made in this thread's CPU set; 1 (the default): the caller's alone."""
    if not 1 <= n <= PMG_MAX_HOST_THREADS:
        raise ValueError(f"threads must be 1 to {PMG_MAX_HOST_THREADS}, got {n}")
    _check(pmg_host_set_threads(n))


def threads():
    """The threads host_average and host_copy use (set_threads)."""
    return pmg_host_threads()


def host_copy(pairs):
    """Copy each (source, destination) pair of arrays, of equal byte sizes, C-contiguous,
    the work shared out among the threads (set_threads)."""
    cdef int count = len(pairs)
    cdef const void **srcs = <const void **>malloc(max(count, 1) * sizeof(void *))
    cdef void **dsts = <void **>malloc(max(count, 1) * sizeof(void *))
    cdef size_t *sizes = <size_t *>malloc(max(count, 1) * sizeof(size_t))
    cdef int status
    try:
        if srcs == NULL or dsts == NULL or sizes == NULL:
            raise MemoryError()
        for i, (src, dst) in enumerate(pairs):
            if not src.flags.c_contiguous:
                raise ValueError(f"source {i} is not C-contiguous")
            if not (dst.flags.c_contiguous and dst.flags.writeable):
                raise ValueError(f"destination {i} must be a writable C-contiguous array")
            if src.nbytes != dst.nbytes:
                raise ValueError(f"pair {i}: {src.nbytes} bytes into {dst.nbytes}")
            srcs[i] = <const void *><uintptr_t>src.ctypes.data
            dsts[i] = <void *><uintptr_t>dst.ctypes.data
            sizes[i] = src.nbytes
        with nogil:
            status = pmg_host_copy(srcs, dsts, sizes, count)
        _check(status)
    finally:
        free(srcs)
        free(dsts)
        free(sizes)


cdef class Barrier:
    """One node's ranks meeting in shared memory (csrc/host_barrier.cpp): ``words`` is a
    writable buffer of BARRIER_BYTES, 64-byte aligned and zeroed before any rank arrives,
    mapped by every rank; it must outlive this object."""
    cdef void *words
    cdef object keep
    cdef readonly int nranks, rank
    cdef uint32_t generation

    def __init__(self, words, int nranks, int rank):
        view = memoryview(words)
        if view.readonly or view.nbytes < PMG_HOST_BARRIER_BYTES or not view.c_contiguous:
            raise ValueError(f"a barrier needs a writable buffer of {PMG_HOST_BARRIER_BYTES} "
                             "bytes")
        a = np.frombuffer(view, np.uint8)
        if a.ctypes.data % 64:
            raise ValueError("a barrier's buffer must be 64-byte aligned")
        if not 1 <= nranks <= PMG_MAX_RANKS or not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} of {nranks}: at most {PMG_MAX_RANKS} ranks")
        self.keep = a
        self.words = <void *><uintptr_t>a.ctypes.data
        self.nranks, self.rank = nranks, rank

    def arrive(self):
        """Arrive; True if every rank has (this one was the last), else wait() until then."""
        cdef uint32_t generation = 0
        cdef int status
        with nogil:
            status = pmg_host_barrier_arrive(self.words, self.nranks, self.rank, &generation)
        if status < 0 or status > 1:
            _check(status)
        self.generation = generation
        return status == 1

    def wait(self, double timeout, int spins=0):
        """Wait up to ``timeout`` seconds (after ``spins`` polls) for the barrier arrived
        at last to release every rank: True once it has, False if not yet."""
        cdef int64_t ns = <int64_t>(max(timeout, 0.0) * 1e9)
        cdef int status
        with nogil:
            status = pmg_host_barrier_wait(self.words, self.generation, ns, spins)
        if status < 0 or status > 1:
            _check(status)
        return status == 1

    def arrivals(self, int rank):
        """How many barriers ``rank`` has arrived at."""
        return pmg_host_barrier_arrivals(self.words, rank)
