// Two-shot by stores: every byte crosses the link as a remote store into the peer's staging.
#include "kernels.cuh"
#include "methods.h"

namespace {

// Two-shot by stores only ('push'): on NVLink a remote store needs no round trip, a remote
// load does (docs/DECISIONS.md, "Two-shot by stores"). Phase A:
// rank r stores its copy of every other rank's slice into that rank's staging slot. Phase
// B: each rank averages its slice from its replica and its staging area, in rank order, and
// stores the mean into every replica. An element maps to the same block in both phases on
// every rank, so per-block barriers suffice. No barrier is needed on entry: phase A reads
// only this rank's replica, and the previous call's closing barrier proved that every peer
// had finished reading its staging area.
template <typename T, int R>
__global__ void __launch_bounds__(kThreads)
    push_kernel(pmg_peers p, size_t stage_offset, int rank, size_t n, uint64_t timeout_ns) {
  constexpr int P = kPerVec<T>;
  constexpr int U = kTwoShotUnroll<R>;
  const size_t nvec = n / P;
  const size_t slice = staged_slice(R, n, sizeof(T)) / P;  // in vectors
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  const uint4 *mine = static_cast<const uint4 *>(p.data[rank]);
#pragma unroll 1
  for (int j = 1; j < R; ++j) {
    const int s = (rank + j) % R;  // rotated, so that ranks do not all store to rank 0 first
    const size_t lo = min(nvec, s * slice), hi = min(nvec, lo + slice);
    uint4 *slot = staging(p, s, stage_offset) + staged_slot(rank, s) * slice - lo;
    for (size_t v0 = lo + tid; v0 < hi; v0 += nthreads * U) {
      uint4 raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (v0 + u * nthreads < hi) raw[u] = __ldcg(mine + v0 + u * nthreads);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (v0 + u * nthreads < hi) __stcg(slot + v0 + u * nthreads, raw[u]);
    }
  }
  block_barrier(p, rank, R, timeout_ns);  // every peer's copy of our slice has landed
  const size_t lo = min(nvec, rank * slice), hi = min(nvec, lo + slice);
  const uint4 *stage = staging(p, rank, stage_offset) - lo;
  average_to_all<T, R>(p, rank, lo, hi, [&](int r) {
    return r == rank ? mine : stage + staged_slot(r, rank) * slice;
  });
  // The scalar tail (n % P elements, in the last non-empty slice): its owner reads it from
  // every replica directly; nobody changes it before the closing barrier.
  const size_t i = nvec * P + tid;
  if (i < n && i / (slice * P) == size_t(rank)) {
    const T out = Elem<T>::store(scalar_mean<T>(p, R, i));
    for (int r = 0; r < R; ++r) static_cast<T *>(p.data[r])[i] = out;
  }
  block_barrier(p, rank, R, timeout_ns);  // every peer's stores into our replica have landed
}

}  // namespace

int pmg_launch_push(const pmg_call &c) {
  if (int err = with_dtype(c.dtype, [&](auto t) {
        using T = decltype(t);
        with_ranks(c.nranks, [&](auto r) {
          constexpr int R = decltype(r)::value;
          const size_t slice = staged_slice(R, c.n, sizeof(T)) / kPerVec<T>;
          const unsigned blocks = grid_for(slice, size_t(kThreads) * kTwoShotUnroll<R>,
                                           c.max_blocks);
          push_kernel<T, R><<<blocks, kThreads, 0, c.stream>>>(*c.peers, c.stage_offset,
                                                                c.rank, c.n, c.timeout_ns);
        });
        return 0;
      }))
    return err;
  return launched();
}
