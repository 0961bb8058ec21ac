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
