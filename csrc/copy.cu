// The 2014 demo's method: every peer's replica copied by DMA into a shadow, then averaged
// here; with GPU barriers between, or the host's where there is no peer access.
#include "kernels.cuh"

extern "C" {

int pmg_gather_peers(const pmg_peers *peers, int rank, int nranks, void *shadow, size_t n,
                     int dtype, cudaStream_t stream) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (int err = check_peers(peers, nranks)) return err;
  const size_t esize = pmg_dtype_size(dtype);
  if (!esize) return PMG_ERR_UNSUPPORTED_DTYPE;
  if (!shadow && nranks > 1) return PMG_ERR_INVALID_ARGUMENT;
  const size_t nbytes = n * esize;
  char *slot = static_cast<char *>(shadow);
  for (int r = 0; r < nranks; ++r) {
    if (r == rank) continue;
    // DMA through the copy engines over P2P, as the seed's memcpy_peer did.
    cudaError_t err = cudaMemcpyAsync(slot, peers->data[r], nbytes, cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
    slot += nbytes;
  }
  return 0;
}

int pmg_push_peers(const pmg_peers *peers, size_t shadow_offset, size_t slot_bytes, int rank,
                   int nranks, const void *const *src, const size_t *at, const size_t *nbytes,
                   int count, cudaStream_t stream) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (int err = check_peers(peers, nranks)) return err;
  if (count < 0 || (count > 0 && (!src || !at || !nbytes)) || !shadow_offset)
    return PMG_ERR_INVALID_ARGUMENT;
  for (int i = 0; i < count; ++i)
    if (nbytes[i] && (!src[i] || at[i] + nbytes[i] > slot_bytes)) return PMG_ERR_INVALID_ARGUMENT;
  for (int p = 0; p < nranks; ++p) {
    if (p == rank) continue;
    // This rank's slot in p's shadow: p keeps no slot for itself.
    char *slot = static_cast<char *>(peers->data[p]) + shadow_offset +
                 size_t(rank < p ? rank : rank - 1) * slot_bytes;
    for (int i = 0; i < count; ++i) {
      if (!nbytes[i]) continue;
      // DMA writes over P2P: the copy engines carry them and leave every SM to the caller.
      cudaError_t err = cudaMemcpyAsync(slot + at[i], src[i], nbytes[i], cudaMemcpyDefault, stream);
      if (err != cudaSuccess) return err;
    }
  }
  return 0;
}

int pmg_shadow_average(const pmg_peers *peers, int rank, int nranks, const void *shadow,
                       size_t n, int dtype, cudaStream_t stream) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (int err = check_peers(peers, nranks)) return err;
  const size_t esize = pmg_dtype_size(dtype);
  if (!esize) return PMG_ERR_UNSUPPORTED_DTYPE;
  const void *inputs[PMG_MAX_RANKS];
  const char *slot = static_cast<const char *>(shadow);
  for (int r = 0; r < nranks; ++r) {
    if (r == rank) {
      inputs[r] = peers->data[r];
    } else {
      inputs[r] = slot;
      slot += n * esize;
    }
  }
  return pmg_average(inputs, nranks, peers->data[rank], n, dtype, stream);
}

int pmg_copy_average(const pmg_peers *peers, int rank, int nranks, void *shadow, size_t n,
                     int dtype, uint64_t timeout_ns, cudaStream_t stream) {
  // barrier: every replica is packed; gather; barrier: every peer has copied ours, so it
  // may be overwritten; then the local average in place.
  if (int err = pmg_device_barrier(peers, rank, nranks, timeout_ns, stream)) return err;
  if (int err = pmg_gather_peers(peers, rank, nranks, shadow, n, dtype, stream)) return err;
  if (int err = pmg_device_barrier(peers, rank, nranks, timeout_ns, stream)) return err;
  return pmg_shadow_average(peers, rank, nranks, shadow, n, dtype, stream);
}

}  // extern "C"
