// The node's phases of the average across nodes: its replicas summed slice by slice, NCCL's
// sum of each slice between the nodes, and the mean spread back.
#include "kernels.cuh"

namespace {

// The node's phases of the exchange across nodes, in float32 (docs/DECISIONS.md, "NCCL
// between nodes"). Rank k owns the elements of staged_slice geometry [k * slice, ...).
// Phase one: rank k sums its slice of the R replicas, in rank order, into its own replica.
// It writes nothing a peer reads: peers read only their own slices.
template <int R>
__global__ void __launch_bounds__(kThreads)
    slice_sum_kernel(pmg_peers p, int rank, size_t n, uint64_t timeout_ns) {
  const size_t slice = staged_slice(R, n, sizeof(float));
  const size_t lo = min(n, rank * slice), hi = min(n, lo + slice);
  const size_t vlo = lo / 4, vhi = hi / 4;  // lo is whole vectors; hi may end in a tail
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  block_barrier(p, rank, R, timeout_ns);  // every replica holds this exchange's input
  uint4 *mine = static_cast<uint4 *>(p.data[rank]);
  for (size_t v = vlo + tid; v < vhi; v += nthreads) {
    uint4 raw[R];
#pragma unroll
    for (int r = 0; r < R; ++r) raw[r] = __ldcg(static_cast<const uint4 *>(p.data[r]) + v);
    float acc[4];
    acc_first<float>(acc, raw[0]);
#pragma unroll
    for (int r = 1; r < R; ++r) acc_add<float>(acc, raw[r]);
    __stcg(mine + v, make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]),
                                __float_as_uint(acc[2]), __float_as_uint(acc[3])));
  }
  for (size_t i = vhi * 4 + tid; i < hi; i += nthreads) {
    float a = static_cast<const float *>(p.data[0])[i];
    for (int r = 1; r < R; ++r) a += static_cast<const float *>(p.data[r])[i];
    static_cast<float *>(p.data[rank])[i] = a;
  }
}

// Phase three, after the sum across nodes: rank k divides its slice by the world's rank
// count, once, and stores the quotient into every replica. Its slice of every replica is
// read (phase one) and written by rank k alone, so no barrier is needed on entry; the
// closing one makes every peer's stores into our replica land before the kernel ends.
template <int R>
__global__ void __launch_bounds__(kThreads)
    slice_spread_kernel(pmg_peers p, int rank, size_t n, float world, uint64_t timeout_ns) {
  const size_t slice = staged_slice(R, n, sizeof(float));
  const size_t lo = min(n, rank * slice), hi = min(n, lo + slice);
  const size_t vlo = lo / 4, vhi = hi / 4;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  const uint4 *mine = static_cast<const uint4 *>(p.data[rank]);
  for (size_t v = vlo + tid; v < vhi; v += nthreads) {
    float acc[4];
    acc_first<float>(acc, __ldcg(mine + v));
    const uint4 out = finish<float>(acc, world);
#pragma unroll
    for (int j = 1; j <= R; ++j) __stcg(static_cast<uint4 *>(p.data[(rank + j) % R]) + v, out);
  }
  for (size_t i = vhi * 4 + tid; i < hi; i += nthreads) {
    const float out = __fdiv_rn(static_cast<const float *>(p.data[rank])[i], world);
    for (int j = 1; j <= R; ++j) static_cast<float *>(p.data[(rank + j) % R])[i] = out;
  }
  block_barrier(p, rank, R, timeout_ns);
}

}  // namespace

extern "C" {

int pmg_node_average(const pmg_peers *peers, int rank, int nranks, size_t n, void *nccl_comm,
                     int world, int max_blocks, uint64_t timeout_ns, cudaStream_t stream) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (int err = check_peers(peers, nranks)) return err;
  if (!nccl_comm || world < nranks || max_blocks < 1 || max_blocks > PMG_MAX_BLOCKS)
    return PMG_ERR_INVALID_ARGUMENT;
  const size_t slice = staged_slice(nranks, n, sizeof(float));
  const size_t lo = min(n, rank * slice), count = min(n, lo + slice) - lo;
  const unsigned blocks = grid_for((slice + 3) / 4, kThreads, max_blocks);
  with_ranks(nranks, [&](auto r) {
    slice_sum_kernel<decltype(r)::value><<<blocks, kThreads, 0, stream>>>(*peers, rank, n,
                                                                          timeout_ns);
  });
  if (int err = launched()) return err;
  float *mine = static_cast<float *>(peers->data[rank]) + lo;
  if (int err = pmg_nccl_allreduce(nccl_comm, mine, mine, count, PMG_FLOAT32, 0, timeout_ns,
                                   stream))
    return err;
  with_ranks(nranks, [&](auto r) {
    slice_spread_kernel<decltype(r)::value><<<blocks, kThreads, 0, stream>>>(
        *peers, rank, n, float(world), timeout_ns);
  });
  return launched();
}

}  // extern "C"
