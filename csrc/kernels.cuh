// What every kernel file shares: the element types and their 16-byte vectors, the fp32
// accumulators, the GPU-side barrier, the staged slices' geometry, and the launches' checks.
// Every kernel sums the replicas in rank order 0..R-1 in fp32 and divides once by R with
// IEEE rounding (__fdiv_rn, matching the host's '/'), so every rank writes the same bits
// and the host implementation is an exact reference.
#ifndef PYMPGU_KERNELS_CUH
#define PYMPGU_KERNELS_CUH
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "pympgu.h"

static_assert(sizeof(pmg_signal) == PMG_MAX_BLOCKS * PMG_MAX_RANKS * 4 + PMG_MAX_BLOCKS * 4 + 16,
              "pmg_signal is shared between processes: its layout is part of the ABI");
static_assert(sizeof(pmg_peers) == 128, "pmg_peers is a kernel parameter: keep it small");
static_assert(sizeof(pmg_tensor) == 80, "pmg_tensor is uploaded as raw bytes from Python");

namespace {

constexpr int kThreads = 512;

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  __device__ static float load(float x) { return x; }
  __device__ static float store(float x) { return x; }
};
template <>
struct Elem<__half> {
  __device__ static float load(__half x) { return __half2float(x); }
  __device__ static __half store(float x) { return __float2half_rn(x); }
};
template <>
struct Elem<__nv_bfloat16> {
  __device__ static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

// Elements per 16-byte vector: every replica buffer is 16-byte aligned, so the bulk moves as
// ld.128/st.128 and only the last n % kPerVec elements go one at a time.
template <typename T>
constexpr int kPerVec = 16 / sizeof(T);

template <typename T>
__device__ __forceinline__ void acc_first(float *acc, const uint4 &raw) {
  const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
  for (int i = 0; i < kPerVec<T>; ++i) acc[i] = Elem<T>::load(e[i]);
}

template <typename T>
__device__ __forceinline__ void acc_add(float *acc, const uint4 &raw) {
  const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
  for (int i = 0; i < kPerVec<T>; ++i) acc[i] += Elem<T>::load(e[i]);
}

template <typename T>
__device__ __forceinline__ uint4 finish(const float *acc, float denom) {
  uint4 raw;
  T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
  for (int i = 0; i < kPerVec<T>; ++i) e[i] = Elem<T>::store(__fdiv_rn(acc[i], denom));
  return raw;
}

template <typename T>
__device__ __forceinline__ float scalar_mean(const pmg_peers &p, int nranks, size_t i) {
  float a = Elem<T>::load(static_cast<const T *>(p.data[0])[i]);
  for (int r = 1; r < nranks; ++r) a += Elem<T>::load(static_cast<const T *>(p.data[r])[i]);
  return __fdiv_rn(a, float(nranks));
}

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// System scope, because the flag's reader is another GPU (or another process on this one).
__device__ __forceinline__ void st_release_sys(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Block blockIdx.x of every rank meets here. Each rank keeps its own monotonic count per
// block (counter[b], never touched by peers); thread t announces the new count in rank t's
// flags[b][rank] with a release store, then waits with acquire loads until rank t's
// announcement in our own flags[b][t] reaches it. The __syncthreads on either side make
// the release cover the whole block's earlier accesses and the acquire order the whole
// block's later ones. Counts only grow, so a peer already one barrier ahead still passes
// the comparison, and the signed difference survives wrap-around. Every rank runs the same
// grid, so block b always has partners; a peer that never arrives (it died) traps the
// kernel after timeout_ns instead of hanging the process forever.
__device__ inline void block_barrier(const pmg_peers &p, int rank, int nranks, uint64_t timeout_ns) {
  __syncthreads();
  pmg_signal *self = p.signal[rank];
  const uint32_t flag = self->counter[blockIdx.x] + 1;
  if (threadIdx.x < nranks) {
    const int peer = threadIdx.x;
    st_release_sys(&p.signal[peer]->flags[blockIdx.x][rank], flag);
    const uint32_t *mine = &self->flags[blockIdx.x][peer];
    uint64_t start = 0;
    while (static_cast<int32_t>(ld_acquire_sys(mine) - flag) < 0) {
      const uint64_t now = globaltimer();
      if (start == 0) {
        start = now;
      } else if (now - start > timeout_ns) {
        __trap();
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) self->counter[blockIdx.x] = flag;
}

// Vectors per thread per two-shot iteration: enough loads in flight to cover NVLink latency
// while R * kUnroll 16-byte registers still fit at kThreads threads per block.
template <int R>
constexpr int kTwoShotUnroll = R <= 2 ? 4 : (R <= 4 ? 2 : 1);

// The second half of both two-shot kernels: average vectors [lo, hi) of the R replicas in
// rank order, reading rank r's from source(r) (indexed by vector), and store the mean into
// every replica, starting with the next rank so that R ranks do not all write to rank 0
// first. U vectors per thread are loaded before any is stored.
template <typename T, int R, typename Source>
__device__ __forceinline__ void average_to_all(const pmg_peers &p, int rank, size_t lo, size_t hi,
                                               Source source) {
  constexpr int P = kPerVec<T>;
  constexpr int U = kTwoShotUnroll<R>;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  const float denom = float(R);
  for (size_t v0 = lo + tid; v0 < hi; v0 += nthreads * U) {
    uint4 raw[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t v = v0 + u * nthreads;
      if (v < hi) {
#pragma unroll
        for (int r = 0; r < R; ++r) raw[u][r] = __ldcg(source(r) + v);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t v = v0 + u * nthreads;
      if (v < hi) {
        float acc[P];
        acc_first<T>(acc, raw[u][0]);
#pragma unroll
        for (int r = 1; r < R; ++r) acc_add<T>(acc, raw[u][r]);
        const uint4 out = finish<T>(acc, denom);
#pragma unroll
        for (int j = 1; j <= R; ++j) __stcg(static_cast<uint4 *>(p.data[(rank + j) % R]) + v, out);
      }
    }
  }
}

// The staged algorithms' geometry ('push' and 'ce'): rank s owns elements
// [s * slice, (s + 1) * slice) of n (clipped to n); slices are whole 16-byte vectors, so
// every slice and chunk stays 16-byte aligned.
__host__ __device__ __forceinline__ size_t staged_slice(int nranks, size_t n, size_t esize) {
  const size_t per_vec = 16 / esize;
  return (n + nranks * per_vec - 1) / (nranks * per_vec) * per_vec;
}

// Where rank src's copy of rank dst's slice lands in dst's staging area: one slot per peer.
__host__ __device__ __forceinline__ size_t staged_slot(int src, int dst) {
  return size_t(src < dst ? src : src - 1);
}

__device__ __forceinline__ uint4 *staging(const pmg_peers &p, int r, size_t stage_offset) {
  return reinterpret_cast<uint4 *>(static_cast<char *>(p.data[r]) + stage_offset);
}

inline unsigned grid_for(size_t work_items, size_t per_block, int max_blocks) {
  size_t b = (work_items + per_block - 1) / per_block;
  if (b < 1) b = 1;
  if (b > size_t(max_blocks)) b = max_blocks;
  return unsigned(b);
}

// Block count for plain (barrier-free) launches: enough to fill an H200 several times over.
constexpr int kPlainMaxBlocks = 1024;

inline int check_ranks(int rank, int nranks) {
  if (nranks < 1 || nranks > PMG_MAX_RANKS || rank < 0 || rank >= nranks)
    return PMG_ERR_BAD_RANK_COUNT;
  return 0;
}

inline int check_peers(const pmg_peers *peers, int nranks) {
  if (!peers) return PMG_ERR_INVALID_ARGUMENT;
  for (int r = 0; r < nranks; ++r) {
    if (!peers->data[r] || !peers->signal[r]) return PMG_ERR_INVALID_ARGUMENT;
    if (reinterpret_cast<uintptr_t>(peers->data[r]) & 15) return PMG_ERR_MISALIGNED;
  }
  return 0;
}

// Calls f(std::integral_constant<int, R>()) with R = nranks (1 to PMG_MAX_RANKS): the
// kernels take the rank count as a template parameter, so that their loops over ranks unroll.
template <typename F>
void with_ranks(int nranks, F &&f) {
  switch (nranks) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    case 8: f(std::integral_constant<int, 8>()); break;
  }
}

// Calls f(T()) with T the element type of dtype: f's return, or PMG_ERR_UNSUPPORTED_DTYPE.
template <typename F>
int with_dtype(int dtype, F &&f) {
  switch (dtype) {
    case PMG_FLOAT32: return f(float());
    case PMG_FLOAT16: return f(__half());
    case PMG_BFLOAT16: return f(__nv_bfloat16());
    default: return PMG_ERR_UNSUPPORTED_DTYPE;
  }
}

inline int launched() { return cudaGetLastError(); }

// Elements of [begin, begin + len) that lie below end.
inline size_t clipped(size_t begin, size_t len, size_t end) {
  return begin >= end ? 0 : min(len, end - begin);
}

}  // namespace
#endif
