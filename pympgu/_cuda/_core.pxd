# Declarations of pympgu's CUDA C API (csrc/pympgu.h built with PMG_WITH_CUDA).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from "cuda_runtime_api.h" nogil:
    ctypedef void *cudaStream_t
    ctypedef void *cudaEvent_t

cdef extern from "pympgu.h" nogil:
    enum:
        PMG_MAX_RANKS
        PMG_MAX_BLOCKS
        PMG_IPC_HANDLE_BYTES
        PMG_ALGO_ONESHOT
        PMG_ALGO_TWOSHOT
        PMG_ALGO_PUSH
        PMG_ALGO_CE
        PMG_ALGO_GATHER
        PMG_ALGO_LL
        PMG_LL_MAX_BYTES
        PMG_ERR_INVALID_ARGUMENT
        PMG_ERR_TIMEOUT
        PMG_MARKS

    ctypedef struct pmg_signal:
        pass

    ctypedef struct pmg_stream_sync:
        uint32_t queued
        int32_t late_rank_plus_one

    ctypedef struct pmg_peers:
        void *data[PMG_MAX_RANKS]
        pmg_signal *signal[PMG_MAX_RANKS]

    ctypedef struct pmg_doorbell:
        uint64_t ring
        uint64_t done

    ctypedef struct pmg_tensor:
        const void *inputs[PMG_MAX_RANKS]
        void *out
        uint64_t n

    ctypedef struct pmg_group:
        pmg_peers peers
        size_t stage_offset
        size_t nbytes
        int rank
        int nranks
        int device
        uint64_t timeout_ns
        cudaStream_t copy_stream
        cudaEvent_t event
        cudaStream_t side
        cudaEvent_t side_in
        cudaEvent_t side_out
        cudaEvent_t side_first
        void *shadow
        size_t shadow_offset
        pmg_stream_sync *stream_sync
        uint32_t *stream_flags[PMG_MAX_RANKS]
        cudaEvent_t marks[PMG_MARKS]
        void *nccl_comm
        int world
        int nccl_flat

    const char *pmg_error_name(int status)
    const char *pmg_error_string(int status)
    void pmg_clear_last_error()
    size_t pmg_dtype_size(int dtype)

    int pmg_runtime_version(int *version)
    int pmg_driver_version(int *version)
    int pmg_get_device_count(int *count)
    int pmg_get_device(int *device)
    int pmg_set_device(int device)
    int pmg_device_name(int device, char *name, size_t length)
    int pmg_device_sm_count(int device, int *count)
    int pmg_device_synchronize()
    int pmg_pointer_device(const void *ptr, int *device)
    int pmg_can_access_peer(int device, int peer, int *can)
    int pmg_enable_peer_access(int peer)
    int pmg_malloc(void **ptr, size_t nbytes)
    int pmg_free(void *ptr)
    int pmg_host_alloc(void **ptr, size_t nbytes)
    int pmg_host_register(void *ptr, size_t nbytes, void **device_ptr)
    int pmg_host_unregister(void *ptr)
    int pmg_host_free(void *ptr)
    int pmg_memset_async(void *ptr, int value, size_t nbytes, cudaStream_t stream)
    int pmg_memcpy_async(void *dst, const void *src, size_t nbytes, cudaStream_t stream)
    int pmg_memcpy_peer_async(void *dst, int dst_device, const void *src, int src_device,
                              size_t nbytes, cudaStream_t stream)
    int pmg_ipc_get_handle(void *base, void *handle)
    int pmg_ipc_open_handle(const void *handle, void **ptr)
    int pmg_ipc_close_handle(void *ptr)
    int pmg_stream_create(cudaStream_t *stream, int high_priority)
    int pmg_stream_destroy(cudaStream_t stream)
    int pmg_stream_synchronize(cudaStream_t stream)
    int pmg_event_create(cudaEvent_t *event, int timing)
    int pmg_event_destroy(cudaEvent_t event)
    int pmg_event_record(cudaEvent_t event, cudaStream_t stream)
    int pmg_event_synchronize(cudaEvent_t event)
    int pmg_event_elapsed_ms(cudaEvent_t start, cudaEvent_t end, float *ms)
    int pmg_stream_wait(cudaStream_t consumer, cudaStream_t producer)

    int pmg_average(const void *const *inputs, int nranks, void *out, size_t n, int dtype,
                    cudaStream_t stream)
    int pmg_multi_average(const pmg_tensor *table, int ntensors, int nranks, uint64_t max_n,
                          int dtype, cudaStream_t stream)
    int pmg_multi_delta(const pmg_tensor *table, int ntensors, uint64_t max_n, int wire_dtype,
                        cudaStream_t stream)
    int pmg_accumulate(float *ref, const void *avg, size_t n, int wire_dtype, cudaStream_t stream)
    int pmg_allreduce_average(const pmg_peers *peers, size_t stage_offset, int rank,
                              int nranks, size_t n, int dtype, int algo, int max_blocks,
                              uint64_t timeout_ns, cudaStream_t stream, size_t chunk_bytes,
                              cudaStream_t copy_stream, cudaEvent_t event)
    const char *pmg_method_name(int algo)
    int pmg_node_average(const pmg_peers *peers, int rank, int nranks, size_t n,
                         void *nccl_comm, int world, int max_blocks, uint64_t timeout_ns,
                         cudaStream_t stream)
    size_t pmg_stage_bytes(int nranks, size_t nbytes)
    size_t pmg_ll_bytes(int nranks)
    enum: PMG_CE_MAX_CHUNKS
    int pmg_ce_chunks(int nranks, size_t n, int dtype, size_t chunk_bytes, size_t *bounds,
                      int *count)
    int pmg_doorbell_alloc(pmg_doorbell **bell)
    int pmg_doorbell_free(pmg_doorbell *bell)
    int pmg_resident_start(const pmg_peers *peers, int rank, int nranks, int blocks,
                           uint64_t timeout_ns, pmg_doorbell *bell, cudaStream_t stream)
    int pmg_resident_ring(pmg_doorbell *bell, uint32_t count, size_t n, int dtype)
    int pmg_resident_wait(pmg_doorbell *bell, uint32_t count, uint64_t timeout_ns,
                          cudaStream_t stream)
    int pmg_resident_stop(pmg_doorbell *bell, uint32_t count, cudaStream_t stream)
    int pmg_stream_barrier_available()
    int pmg_device_barrier(const pmg_peers *peers, int rank, int nranks, uint64_t timeout_ns,
                           cudaStream_t stream)
    int pmg_gather_peers(const pmg_peers *peers, int rank, int nranks, void *shadow, size_t n,
                         int dtype, cudaStream_t stream)
    int pmg_shadow_average(const pmg_peers *peers, int rank, int nranks, const void *shadow,
                           size_t n, int dtype, cudaStream_t stream)
    int pmg_copy_average(const pmg_peers *peers, int rank, int nranks, void *shadow, size_t n,
                         int dtype, uint64_t timeout_ns, cudaStream_t stream)
    int pmg_group_average(const pmg_group *g, size_t start, size_t n, int dtype, int algo,
                          int max_blocks, size_t chunk_bytes, cudaStream_t stream)
    int pmg_xla_register(const pmg_group *group, int64_t *id)
    int pmg_xla_unregister(int64_t id)
    void *pmg_xla_handler(const char *name)

    ctypedef struct pmg_nccl_id:
        char internal[128]
    enum:
        PMG_NCCL_MIN_VERSION
        PMG_ERR_NCCL
        PMG_ERR_NCCL_MISSING
    int pmg_nccl_load(const char *path, char *why, size_t length)
    int pmg_nccl_loaded()
    int pmg_nccl_version(int *version)
    int pmg_nccl_unique_id(pmg_nccl_id *id)
    int pmg_nccl_init(void **comm, int nranks, int rank, const pmg_nccl_id *id)
    int pmg_nccl_state(void *comm)
    int pmg_nccl_allreduce(void *comm, const void *send, void *recv, size_t count,
                           int dtype, int average, uint64_t timeout_ns, void *stream)
    int pmg_nccl_finalize(void *comm)
    int pmg_nccl_destroy(void *comm)
    int pmg_nccl_abort(void *comm)
    const char *pmg_nccl_last_error(void *comm)

cdef extern from "dlpack.h" nogil:
    ctypedef struct DLDevice:
        int32_t device_type
        int32_t device_id
    ctypedef struct DLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct DLTensor:
        void *data
        DLDevice device
        int32_t ndim
        DLDataType dtype
        int64_t *shape
        int64_t *strides
        uint64_t byte_offset
    ctypedef struct DLManagedTensor:
        DLTensor dl_tensor
        void *manager_ctx
        void (*deleter)(DLManagedTensor *)
    enum:
        kDLCUDA
        kDLInt
        kDLUInt
        kDLFloat
        kDLBfloat

cdef int check(int status) except -1 nogil
