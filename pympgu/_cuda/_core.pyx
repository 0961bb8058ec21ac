# cython: language_level=3
"""pympgu's CUDA layer: the runtime calls pympgu needs, device memory, IPC, and the kernels.

One extension built from one part per CUDA concept, as mpi4py builds its own: runtime.pxi
(errors, devices, streams, events), memory.pxi (device buffers and views, DLPack),
arrays.pxi (other frameworks' arrays, the averaging calls, multi-tensor tables), ipc.pxi,
algorithms.pxi ('auto''s thresholds), barriers.pxi (the stream barriers' flags and their
watchdog, the XLA operations' handlers), nccl.pxi (NCCL, loaded at run time, between
nodes), peergroup.pxi and resident.pxi. Every C declaration is in _core.pxd.

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

from .. import methods, settings
from ..errors import CudaError

MAX_RANKS = PMG_MAX_RANKS
IPC_HANDLE_BYTES = PMG_IPC_HANDLE_BYTES
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}
_TYPESTR = {"float32": "<f4", "float16": "<f2", "uint8": "|u1"}
_FROM_TYPESTR = {"<f4": "float32", "<f2": "float16", "|u1": "uint8", "<u1": "uint8"}
# The data, staging area and shadow of a registered block each start on a 2 MiB page, and
# the block is whole pages (docs/DECISIONS.md, "Page-aligned buffers").
_PAGE = 2 << 20

include "runtime.pxi"
include "memory.pxi"
include "arrays.pxi"
include "ipc.pxi"
include "algorithms.pxi"
include "barriers.pxi"
include "nccl.pxi"
include "peergroup.pxi"
include "xla_group.pxi"
include "resident.pxi"
