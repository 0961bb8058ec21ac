// Two-shot by loads: each rank reads a slice of every replica and stores its mean into all.
#include "kernels.cuh"
#include "methods.h"

namespace {

// Two-shot, in place: rank k averages the k-th 1/R slice of all replicas and writes it into
// every replica (reduce-scatter and all-gather in one pass). Slices are disjoint and each is
// read and written by its owner only, so no round barriers are needed; the closing barrier
// makes every peer's writes into our replica visible before the kernel ends.
template <typename T, int R>
__global__ void __launch_bounds__(kThreads)
    twoshot_kernel(pmg_peers p, int rank, size_t n, uint64_t timeout_ns) {
  constexpr int P = kPerVec<T>;
  const size_t nvec = n / P;
  const size_t slice = (nvec + R - 1) / R;
  const size_t lo = min(nvec, size_t(rank) * slice);
  const size_t hi = min(nvec, lo + slice);
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  block_barrier(p, rank, R, timeout_ns);
  average_to_all<T, R>(p, rank, lo, hi,
                       [&](int r) { return static_cast<const uint4 *>(p.data[r]); });
  // The last rank owns the scalar tail (its slice is the shortest).
  const size_t tail = n - nvec * P;
  if (rank == R - 1 && tid < tail) {
    const size_t i = nvec * P + tid;
    const T out = Elem<T>::store(scalar_mean<T>(p, R, i));
    for (int r = 0; r < R; ++r) static_cast<T *>(p.data[r])[i] = out;
  }
  block_barrier(p, rank, R, timeout_ns);
}

}  // namespace

int pmg_launch_twoshot(const pmg_call &c) {
  if (int err = with_dtype(c.dtype, [&](auto t) {
        using T = decltype(t);
        with_ranks(c.nranks, [&](auto r) {
          constexpr int R = decltype(r)::value;
          const size_t slice = (c.n / kPerVec<T> + R - 1) / R;
          const unsigned blocks = grid_for(slice, size_t(kThreads) * kTwoShotUnroll<R>,
                                           c.max_blocks);
          twoshot_kernel<T, R><<<blocks, kThreads, 0, c.stream>>>(*c.peers, c.rank, c.n,
                                                                   c.timeout_ns);
        });
        return 0;
      }))
    return err;
  return launched();
}
