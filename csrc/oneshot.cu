// One-shot: every rank reads every replica (docs/DECISIONS.md, "Algorithm thresholds").
#include "kernels.cuh"
#include "methods.h"

namespace {

// One-shot rounds: vectors per thread loaded before the round's barrier.
constexpr int kOneShotVecs = 2;

// One-shot, in place: every rank reads all R replicas of a round's elements, then, after a
// barrier that proves every rank has read that round, writes the mean into its own replica.
// Rounds keep the reads of round k+1 clear of the writes of round k on any rank, because an
// element belongs to the same block and round on every rank.
template <typename T, int R>
__global__ void __launch_bounds__(kThreads)
    oneshot_kernel(pmg_peers p, int rank, size_t n, uint64_t timeout_ns) {
  constexpr int P = kPerVec<T>;
  const size_t nvec = n / P;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  const float denom = float(R);
  block_barrier(p, rank, R, timeout_ns);  // every replica holds this exchange's input
  for (size_t base = 0; base < nvec; base += nthreads * kOneShotVecs) {
    float acc[kOneShotVecs][P];
#pragma unroll
    for (int k = 0; k < kOneShotVecs; ++k) {
      const size_t v = base + k * nthreads + tid;
      if (v < nvec) {
        uint4 raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) raw[r] = __ldcg(static_cast<const uint4 *>(p.data[r]) + v);
        acc_first<T>(acc[k], raw[0]);
#pragma unroll
        for (int r = 1; r < R; ++r) acc_add<T>(acc[k], raw[r]);
      }
    }
    block_barrier(p, rank, R, timeout_ns);  // every rank has read this round
#pragma unroll
    for (int k = 0; k < kOneShotVecs; ++k) {
      const size_t v = base + k * nthreads + tid;
      if (v < nvec) __stcg(static_cast<uint4 *>(p.data[rank]) + v, finish<T>(acc[k], denom));
    }
  }
  const size_t tail = n - nvec * P;
  if (tail) {
    const size_t i = nvec * P + tid;
    float mean = 0.f;
    if (tid < tail) mean = scalar_mean<T>(p, R, i);
    block_barrier(p, rank, R, timeout_ns);
    if (tid < tail) static_cast<T *>(p.data[rank])[i] = Elem<T>::store(mean);
  }
}

}  // namespace

int pmg_launch_oneshot(const pmg_call &c) {
  if (int err = with_dtype(c.dtype, [&](auto t) {
        using T = decltype(t);
        const unsigned blocks = grid_for(c.n / kPerVec<T>, size_t(kThreads) * kOneShotVecs,
                                         c.max_blocks);
        with_ranks(c.nranks, [&](auto r) {
          oneshot_kernel<T, decltype(r)::value><<<blocks, kThreads, 0, c.stream>>>(
              *c.peers, c.rank, c.n, c.timeout_ns);
        });
        return 0;
      }))
    return err;
  return launched();
}
