# cython: language_level=3
"""Host (CPU) averaging with the GPU kernels' arithmetic (csrc/host_average.cpp).

Replicas are summed in rank order in fp32 and divided once by R, so the result is bit-for-bit
what the device kernels produce. Arrays are numpy arrays (or anything exporting a writable
C-contiguous buffer); bfloat16 data travels as uint16 storage with ``dtype="bfloat16"``.
"""
from libc.stdint cimport uintptr_t

import numpy as np

DTYPES = {"float32": PMG_FLOAT32, "float16": PMG_FLOAT16, "bfloat16": PMG_BFLOAT16}
MAX_RANKS = PMG_MAX_RANKS


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
    """Write the mean of the arrays in inputs (rank order) into out; out may be one of them."""
    cdef const void *ptrs[PMG_MAX_RANKS]
    cdef int nranks = len(inputs)
    if nranks < 1 or nranks > PMG_MAX_RANKS:
        raise ValueError(f"host_average takes 1 to {PMG_MAX_RANKS} inputs, got {nranks}")
    name = str(out.dtype if dtype is None else dtype)
    cdef int code = dtype_code(name)
    cdef size_t esize = pmg_dtype_size(code)
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be a writable C-contiguous array")
    if out.itemsize != esize:
        raise ValueError(f"out holds {out.itemsize}-byte items, {name} needs {esize}")
    cdef size_t n = out.size
    for r, a in enumerate(inputs):
        if not a.flags.c_contiguous:
            raise ValueError(f"input {r} is not C-contiguous")
        if a.size != n or a.itemsize != esize:
            raise ValueError(
                f"input {r} has {a.size} items of {a.itemsize} bytes; out has {n} of {esize}"
            )
        ptrs[r] = <const void *><uintptr_t>a.ctypes.data
    cdef void *dst = <void *><uintptr_t>out.ctypes.data
    cdef int status
    with nogil:
        status = pmg_host_average(ptrs, nranks, dst, n, code)
    _check(status)
    return out
