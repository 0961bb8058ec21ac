# Declarations of pympgu's host (CPU) C API: csrc/host_average.cpp and host_barrier.cpp,
# built without CUDA.
from libc.stdint cimport int64_t, uint32_t

cdef extern from "pympgu.h" nogil:
    enum:
        PMG_MAX_RANKS
        PMG_FLOAT32
        PMG_FLOAT16
        PMG_BFLOAT16
        PMG_HOST_BARRIER_BYTES
        PMG_MAX_HOST_THREADS
    const char *pmg_status_name(int status)
    const char *pmg_status_string(int status)
    size_t pmg_dtype_size(int dtype)
    int pmg_host_average(const void *const *inputs, int nranks, void *const *outs,
                         int nouts, size_t n, int dtype)
    int pmg_host_set_threads(int n)
    int pmg_host_threads()
    int pmg_host_copy(const void *const *srcs, void *const *dsts, const size_t *nbytes,
                      int count)
    int pmg_host_delta(const float *x, const float *ref, void *wire, size_t n, int wire_dtype)
    int pmg_host_accumulate(float *ref, const void *avg, size_t n, int wire_dtype)
    int pmg_host_barrier_arrive(void *words, int nranks, int rank, uint32_t *generation)
    int pmg_host_barrier_wait(void *words, uint32_t generation, int64_t timeout_ns, int spins)
    uint32_t pmg_host_barrier_arrivals(const void *words, int rank)
