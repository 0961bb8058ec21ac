// The averaging kernels. Every kernel sums the replicas in rank order 0..R-1 in fp32 and
// divides once by R with IEEE rounding (__fdiv_rn, matching the host's '/'), so every rank
// writes the same bits and the host implementation is an exact reference.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda.h>  // the driver's types only: its functions are looked up at run time
#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <type_traits>

#include "pympgu.h"

static_assert(sizeof(pmg_signal) == PMG_MAX_BLOCKS * PMG_MAX_RANKS * 4 + PMG_MAX_BLOCKS * 4 + 16,
              "pmg_signal is shared between processes: its layout is part of the ABI");
static_assert(sizeof(pmg_peers) == 128, "pmg_peers is a kernel parameter: keep it small");
static_assert(sizeof(pmg_tensor) == 80, "pmg_tensor is uploaded as raw bytes from Python");

namespace {

constexpr int kThreads = 512;
// One-shot rounds: vectors per thread loaded before the round's barrier.
constexpr int kOneShotVecs = 2;

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
__device__ void block_barrier(const pmg_peers &p, int rank, int nranks, uint64_t timeout_ns) {
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

__global__ void barrier_kernel(pmg_peers p, int rank, int nranks, uint64_t timeout_ns) {
  block_barrier(p, rank, nranks, timeout_ns);
}

// LL: every rank stores each 8 bytes of its values into every peer's mailbox as one 16-byte
// line {d0, seq, d1, seq}, and each 8-byte half lands whole (NCCL's LL protocol relies on
// the same), so a reader that sees the call's sequence number in both halves has the values
// beside them. No barrier is needed. Peers never read this rank's data, only its mailboxes,
// so it may write its mean as soon as it has read them. Two slots, by the sequence number's
// parity, keep one call's mailboxes clear of the next's: rank r stores call k + 2 into slot
// k % 2 only after finishing call k + 1, which took every peer's call k + 1 values, and a
// peer sends those only once its call k (its reads of that slot) is over. A line still
// holding an older call's values holds another number, unless it went unwritten for a
// multiple of 2^32 calls (the number is 32 bits, as each half's atomicity allows), which no
// training loop's steady sizes come near. One sequence number serves every
// block of a call, whatever its grid: per-block numbers would let a line that changed blocks
// between calls meet an old value with the number it waits for.
constexpr size_t kLLLines = PMG_LL_MAX_BYTES / 8;  // per mailbox: 8 data bytes a line

__device__ __forceinline__ uint4 *ll_line(const pmg_peers &p, int owner, int nranks, int slot,
                                          int sender, size_t c) {
  uint4 *box = reinterpret_cast<uint4 *>(reinterpret_cast<char *>(p.signal[owner]) +
                                         sizeof(pmg_signal));
  return box + (size_t(slot) * nranks + sender) * kLLLines + c;
}

__device__ __forceinline__ void ll_store(uint4 *line, uint2 v, uint32_t seq) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(line), "r"(v.x),
               "r"(seq), "r"(v.y), "r"(seq)
               : "memory");
}

// Spins on a line of this rank's own mailbox until both halves carry seq; traps after
// timeout_ns (the sender never came), as block_barrier does.
__device__ __forceinline__ uint2 ll_load(const uint4 *line, uint32_t seq, uint64_t timeout_ns) {
  uint32_t d0, s0, d1, s1;
  uint64_t start = 0;
  while (true) {
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d0), "=r"(s0), "=r"(d1), "=r"(s1)
                 : "l"(line)
                 : "memory");
    if (s0 == seq && s1 == seq) return make_uint2(d0, d1);
    const uint64_t now = globaltimer();
    if (start == 0) {
      start = now;
    } else if (now - start > timeout_ns) {
      __trap();
    }
  }
}

// Chunk c (8 bytes) of a replica of n elements; past n it reads and writes nothing. Loads
// bypass L1 (ld.global.cg): a resident kernel (below) reads the same buffer again after
// other kernels rewrote it, and an SM's L1 is not kept coherent with their stores.
template <typename T>
__device__ __forceinline__ uint2 load_chunk(const T *x, size_t c, size_t n) {
  constexpr int E = 8 / sizeof(T);
  if ((c + 1) * E <= n) return __ldcg(reinterpret_cast<const uint2 *>(x) + c);
  using Bits = std::conditional_t<sizeof(T) == 4, unsigned int, unsigned short>;
  uint2 v = make_uint2(0, 0);
  Bits *e = reinterpret_cast<Bits *>(&v);
  for (int i = 0; i < E && c * E + i < n; ++i) e[i] = __ldcg(reinterpret_cast<const Bits *>(x) + c * E + i);
  return v;
}

template <typename T>
__device__ __forceinline__ void store_chunk(T *x, size_t c, size_t n, uint2 v) {
  constexpr int E = 8 / sizeof(T);
  if ((c + 1) * E <= n) {
    reinterpret_cast<uint2 *>(x)[c] = v;
    return;
  }
  const T *e = reinterpret_cast<const T *>(&v);
  for (int i = 0; i < E && c * E + i < n; ++i) x[c * E + i] = e[i];
}

// One LL call with sequence number seq over chunks first, first + stride, ... of this
// rank's n elements: the launched kernel's body and the resident kernel's.
template <typename T, int R>
__device__ __forceinline__ void ll_exchange(const pmg_peers &p, int rank, size_t n, uint32_t seq,
                                            uint64_t timeout_ns, size_t first, size_t stride) {
  constexpr int E = 8 / sizeof(T);
  const int slot = seq & 1;
  const size_t chunks = (n + E - 1) / E;
  T *own = static_cast<T *>(p.data[rank]);
  for (size_t c = first; c < chunks; c += stride) {
    const uint2 v = load_chunk(own, c, n);
#pragma unroll
    for (int j = 1; j < R; ++j) {
      const int to = (rank + j) % R;  // rotated, so that ranks do not all store to rank 0 first
      ll_store(ll_line(p, to, R, slot, rank, c), v, seq);
    }
  }
  for (size_t c = first; c < chunks; c += stride) {
    float acc[E];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint2 v = r == rank ? load_chunk(own, c, n)
                                : ll_load(ll_line(p, rank, R, slot, r, c), seq, timeout_ns);
      const T *e = reinterpret_cast<const T *>(&v);
#pragma unroll
      for (int i = 0; i < E; ++i) acc[i] = r == 0 ? Elem<T>::load(e[i]) : acc[i] + Elem<T>::load(e[i]);
    }
    uint2 out;
    T *e = reinterpret_cast<T *>(&out);
#pragma unroll
    for (int i = 0; i < E; ++i) e[i] = Elem<T>::store(__fdiv_rn(acc[i], float(R)));
    store_chunk(own, c, n, out);
  }
}

// Called by thread 0 of every block when the block is done with a call: true in the last
// block to get here, which may then move the call's state on (every other block has read
// it), after which the count starts again from zero for the next call.
__device__ __forceinline__ bool last_block_out(pmg_signal *self) {
  __threadfence();
  if (atomicAdd(&self->ll_arrived, 1u) != gridDim.x - 1) return false;
  self->ll_arrived = 0;
  return true;
}

template <typename T, int R>
__global__ void __launch_bounds__(kThreads)
    ll_kernel(pmg_peers p, int rank, size_t n, uint64_t timeout_ns) {
  pmg_signal *self = p.signal[rank];
  // Every block reads the number before any block can move it on (below).
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(&self->ll_seq) + 1;
  ll_exchange<T, R>(p, rank, n, seq, timeout_ns, size_t(blockIdx.x) * blockDim.x + threadIdx.x,
                    size_t(gridDim.x) * blockDim.x);
  // The block that finishes last moves the number on: by then every block has read it, and
  // the next call, queued behind this kernel, reads the new one.
  __syncthreads();
  if (threadIdx.x == 0 && last_block_out(self)) self->ll_seq = seq;
}

// The doorbell's command word, read in one 8-byte load: the command's count (32 bits), its
// dtype (4 bits: a pmg_dtype, or kRingStop) and its element count (28 bits; LL's limit
// needs 18).
constexpr int kRingStop = 15;
constexpr uint64_t kRingMaxN = (uint64_t(1) << 28) - 1;
__host__ __device__ constexpr uint64_t ring_word(uint32_t count, uint64_t n, int dtype) {
  return (uint64_t(count) << 32) | (uint64_t(dtype & 15) << 28) | (n & kRingMaxN);
}
__host__ __device__ constexpr uint32_t ring_count(uint64_t w) { return uint32_t(w >> 32); }
__host__ __device__ constexpr int ring_dtype(uint64_t w) { return int((w >> 28) & 15); }
__host__ __device__ constexpr size_t ring_n(uint64_t w) { return size_t(w & kRingMaxN); }

__device__ __forceinline__ uint64_t ld_volatile64(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys64(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The resident kernel: LL calls without a launch each. Thread 0 of block 0 polls the
// doorbell in page-locked host memory (one PCIe read at a time) for command `count` and
// relays it into the signal block, where thread 0 of every other block polls in L2: every
// block polling the host over PCIe was several times slower, and slowed the work beside it
// (docs/DECISIONS.md, "The resident exchange"). Each block runs the command, and the last block out
// writes the count into the doorbell's done line, where the host polls. The host rings
// command k + 1 only after command k is done, so every block has finished reading a call's
// mailboxes before any block of this rank sends the next: the launched kernels' ordering,
// which the slots' argument above needs. The sequence numbers go on from the signal
// block's, which no launched LL call moves while this runs, and are written back when it
// stops, so that launched calls may follow.
template <int R>
__global__ void __launch_bounds__(kThreads)
    resident_kernel(pmg_peers p, int rank, uint64_t timeout_ns, pmg_doorbell *bell) {
  __shared__ uint64_t command;
  pmg_signal *self = p.signal[rank];
  const uint32_t seq0 = *reinterpret_cast<volatile uint32_t *>(&self->ll_seq);
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (uint32_t count = 1;; ++count) {
    if (threadIdx.x == 0) {
      uint64_t w;
      // A stop counts whatever its number: a host that gave up waiting for a command the
      // kernel never saw rings the stop past it, and must not wait for it forever.
      if (blockIdx.x == 0) {
        while (ring_count(w = ld_volatile64(&bell->ring)) != count && ring_dtype(w) != kRingStop) {
        }
        __threadfence_system();  // one fence a command, not one a poll
        *reinterpret_cast<volatile uint64_t *>(&self->resident_command) = w;
      } else {
        while (ring_count(w = ld_volatile64(&self->resident_command)) != count &&
               ring_dtype(w) != kRingStop) {
        }
      }
      command = w;
    }
    __syncthreads();
    const uint64_t w = command;
    __syncthreads();  // thread 0 overwrites `command` only after every thread has read it
    const int dtype = ring_dtype(w);
    if (dtype == kRingStop) {
      if (threadIdx.x == 0 && last_block_out(self)) {
        self->ll_seq = seq0 + count - 1;
        __threadfence_system();
        st_release_sys64(&bell->done, count);
      }
      return;
    }
    const size_t n = ring_n(w);
    const uint32_t seq = seq0 + count;
    if (dtype == PMG_FLOAT32)
      ll_exchange<float, R>(p, rank, n, seq, timeout_ns, first, stride);
    else if (dtype == PMG_FLOAT16)
      ll_exchange<__half, R>(p, rank, n, seq, timeout_ns, first, stride);
    else
      ll_exchange<__nv_bfloat16, R>(p, rank, n, seq, timeout_ns, first, stride);
    // Every thread's stores are ordered before thread 0's fence by the barrier, and the
    // last block's release to the host covers every block's (the fence before each count).
    __syncthreads();
    if (threadIdx.x == 0 && last_block_out(self)) {
      __threadfence_system();
      st_release_sys64(&bell->done, count);
    }
  }
}

// Local averaging of replicas this process addresses directly. An output that aliases an
// input is fine: each element is read and written by the same thread.
template <typename T>
__device__ void average_tensor(const pmg_tensor &d, int nranks) {
  constexpr int P = kPerVec<T>;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  const float denom = float(nranks);
  bool aligned = (reinterpret_cast<uintptr_t>(d.out) & 15) == 0;
  for (int r = 0; r < nranks; ++r) aligned &= (reinterpret_cast<uintptr_t>(d.inputs[r]) & 15) == 0;
  const size_t nvec = aligned ? d.n / P : 0;
  for (size_t v = tid; v < nvec; v += nthreads) {
    float acc[P];
    acc_first<T>(acc, __ldcg(static_cast<const uint4 *>(d.inputs[0]) + v));
    for (int r = 1; r < nranks; ++r) acc_add<T>(acc, __ldcg(static_cast<const uint4 *>(d.inputs[r]) + v));
    static_cast<uint4 *>(d.out)[v] = finish<T>(acc, denom);
  }
  for (size_t i = nvec * P + tid; i < d.n; i += nthreads) {
    float a = Elem<T>::load(static_cast<const T *>(d.inputs[0])[i]);
    for (int r = 1; r < nranks; ++r) a += Elem<T>::load(static_cast<const T *>(d.inputs[r])[i]);
    static_cast<T *>(d.out)[i] = Elem<T>::store(__fdiv_rn(a, denom));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) single_average_kernel(pmg_tensor d, int nranks) {
  average_tensor<T>(d, nranks);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    multi_average_kernel(const pmg_tensor *table, int ntensors, int nranks) {
  for (int t = 0; t < ntensors; ++t) {
    const pmg_tensor d = table[t];
    average_tensor<T>(d, nranks);
  }
}

// The low-precision wire (see pmg_host_delta). Four fp32 elements per thread and step: two
// 16-byte loads in, one 8-byte store out; __fsub_rn/__fadd_rn keep the host's rounding.
template <typename T>
struct Wire4 {
  T e[4];
};

template <typename T>
__device__ void delta_tensor(const pmg_tensor &d) {
  const float *x = static_cast<const float *>(d.inputs[0]);
  const float *ref = static_cast<const float *>(d.inputs[1]);
  T *out = static_cast<T *>(d.out);
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  const bool aligned = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(ref)) & 15) == 0 &&
                       (reinterpret_cast<uintptr_t>(out) & 7) == 0;
  const size_t nvec = aligned ? d.n / 4 : 0;
  for (size_t v = tid; v < nvec; v += nthreads) {
    const float4 a = __ldcg(reinterpret_cast<const float4 *>(x) + v);
    const float4 b = __ldcg(reinterpret_cast<const float4 *>(ref) + v);
    Wire4<T> w;
    w.e[0] = Elem<T>::store(__fsub_rn(a.x, b.x));
    w.e[1] = Elem<T>::store(__fsub_rn(a.y, b.y));
    w.e[2] = Elem<T>::store(__fsub_rn(a.z, b.z));
    w.e[3] = Elem<T>::store(__fsub_rn(a.w, b.w));
    reinterpret_cast<Wire4<T> *>(out)[v] = w;
  }
  for (size_t i = nvec * 4 + tid; i < d.n; i += nthreads) out[i] = Elem<T>::store(__fsub_rn(x[i], ref[i]));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    multi_delta_kernel(const pmg_tensor *table, int ntensors) {
  for (int t = 0; t < ntensors; ++t) {
    const pmg_tensor d = table[t];
    delta_tensor<T>(d);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) accumulate_kernel(float *ref, const T *avg, size_t n) {
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  const bool aligned = ((reinterpret_cast<uintptr_t>(ref) & 15) | (reinterpret_cast<uintptr_t>(avg) & 7)) == 0;
  const size_t nvec = aligned ? n / 4 : 0;
  for (size_t v = tid; v < nvec; v += nthreads) {
    float4 r = reinterpret_cast<const float4 *>(ref)[v];
    const Wire4<T> w = reinterpret_cast<const Wire4<T> *>(avg)[v];
    r.x = __fadd_rn(r.x, Elem<T>::load(w.e[0]));
    r.y = __fadd_rn(r.y, Elem<T>::load(w.e[1]));
    r.z = __fadd_rn(r.z, Elem<T>::load(w.e[2]));
    r.w = __fadd_rn(r.w, Elem<T>::load(w.e[3]));
    reinterpret_cast<float4 *>(ref)[v] = r;
  }
  for (size_t i = nvec * 4 + tid; i < n; i += nthreads) ref[i] = __fadd_rn(ref[i], Elem<T>::load(avg[i]));
}

// Copy lists travel by value: 32 entries are 768 bytes, well inside a kernel's parameters.
constexpr int kCopyBatch = 32;
struct CopyBatch {
  pmg_copy e[kCopyBatch];
};

// Vectors each thread loads before it stores: one 16-byte load in flight per thread left
// the copy at about half of HBM's bandwidth on an H200 (benchmarks/probe_xla.py).
constexpr int kCopyUnroll = 4;

// blockIdx.y picks the entry; the x blocks stride over it in 16-byte vectors when both ends
// are 16-byte aligned (XLA's buffers and the exchange buffer's slots are), else bytewise.
__global__ void __launch_bounds__(kThreads) copy_list_kernel(CopyBatch batch) {
  const pmg_copy c = batch.e[blockIdx.y];
  const char *src = static_cast<const char *>(c.src);
  char *dst = static_cast<char *>(c.dst);
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const size_t nvec = c.nbytes / 16;
    const uint4 *s = reinterpret_cast<const uint4 *>(src);
    uint4 *d = reinterpret_cast<uint4 *>(dst);
    const size_t round = nthreads * kCopyUnroll;
    size_t v = tid;
    for (; v + (kCopyUnroll - 1) * nthreads < nvec; v += round) {
      uint4 r[kCopyUnroll];
#pragma unroll
      for (int k = 0; k < kCopyUnroll; ++k) r[k] = s[v + k * nthreads];
#pragma unroll
      for (int k = 0; k < kCopyUnroll; ++k) d[v + k * nthreads] = r[k];
    }
    for (; v < nvec; v += nthreads) d[v] = s[v];
    done = nvec * 16;
  }
  for (size_t i = done + tid; i < c.nbytes; i += nthreads) dst[i] = src[i];
}

// pmg_mean_list's entries travel by value like copy lists (32 of 32 bytes).
struct MeanBatch {
  pmg_mean e[kCopyBatch];
};

// blockIdx.y picks the entry. Rank r's value of element i is at src[r] + i: this rank's own
// array, or its shadow slot. Four floats a thread when every pointer is 16-byte aligned.
__global__ void __launch_bounds__(kThreads)
    mean_list_kernel(MeanBatch batch, const float *shadow, size_t slot_elems, int rank,
                     int nranks) {
  const pmg_mean m = batch.e[blockIdx.y];
  const float *src[PMG_MAX_RANKS];
  uintptr_t bits = reinterpret_cast<uintptr_t>(m.out) | reinterpret_cast<uintptr_t>(m.fresh);
  for (int r = 0, slot = 0; r < nranks; ++r) {
    src[r] = r == rank ? m.own : shadow + size_t(slot++) * slot_elems + m.at;
    bits |= reinterpret_cast<uintptr_t>(src[r]);
  }
  const float denom = float(nranks);
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  const size_t nvec = (bits & 15) ? 0 : m.n / 4;
  for (size_t v = tid; v < nvec; v += nthreads) {
    float acc[4];
    // own may alias out: every load of element v comes before its store, in this thread.
    acc_first<float>(acc, __ldcs(reinterpret_cast<const uint4 *>(src[0]) + v));
    for (int r = 1; r < nranks; ++r) acc_add<float>(acc, __ldcs(reinterpret_cast<const uint4 *>(src[r]) + v));
    float4 out = make_float4(__fdiv_rn(acc[0], denom), __fdiv_rn(acc[1], denom),
                             __fdiv_rn(acc[2], denom), __fdiv_rn(acc[3], denom));
    if (m.fresh) {
      const float4 f = reinterpret_cast<const float4 *>(m.fresh)[v];
      const float4 o = reinterpret_cast<const float4 *>(src[rank])[v];
      out = make_float4(__fadd_rn(f.x, __fsub_rn(out.x, o.x)), __fadd_rn(f.y, __fsub_rn(out.y, o.y)),
                        __fadd_rn(f.z, __fsub_rn(out.z, o.z)), __fadd_rn(f.w, __fsub_rn(out.w, o.w)));
    }
    reinterpret_cast<float4 *>(m.out)[v] = out;
  }
  for (size_t i = nvec * 4 + tid; i < m.n; i += nthreads) {
    const float own = src[rank][i];
    float a = src[0][i];
    for (int r = 1; r < nranks; ++r) a += src[r][i];
    const float mean = __fdiv_rn(a, denom);
    m.out[i] = m.fresh ? __fadd_rn(m.fresh[i], __fsub_rn(mean, own)) : mean;
  }
}

unsigned grid_for(size_t work_items, size_t per_block, int max_blocks) {
  size_t b = (work_items + per_block - 1) / per_block;
  if (b < 1) b = 1;
  if (b > size_t(max_blocks)) b = max_blocks;
  return unsigned(b);
}

// Block count for plain (barrier-free) launches: enough to fill an H200 several times over.
constexpr int kPlainMaxBlocks = 1024;

int check_ranks(int rank, int nranks) {
  if (nranks < 1 || nranks > PMG_MAX_RANKS || rank < 0 || rank >= nranks)
    return PMG_ERR_BAD_RANK_COUNT;
  return 0;
}

int check_peers(const pmg_peers *peers, int nranks) {
  if (!peers) return PMG_ERR_INVALID_ARGUMENT;
  for (int r = 0; r < nranks; ++r) {
    if (!peers->data[r] || !peers->signal[r]) return PMG_ERR_INVALID_ARGUMENT;
    if (reinterpret_cast<uintptr_t>(peers->data[r]) & 15) return PMG_ERR_MISALIGNED;
  }
  return 0;
}

template <typename T, int R>
void launch_allreduce(const pmg_peers &p, size_t stage_offset, int rank, size_t n, int algo,
                      int max_blocks, uint64_t timeout_ns, cudaStream_t stream) {
  const size_t nvec = n / kPerVec<T>;
  if (algo == PMG_ALGO_LL) {
    unsigned blocks = grid_for((n * sizeof(T) + 7) / 8, kThreads, max_blocks);
    ll_kernel<T, R><<<blocks, kThreads, 0, stream>>>(p, rank, n, timeout_ns);
  } else if (algo == PMG_ALGO_ONESHOT) {
    unsigned blocks = grid_for(nvec, size_t(kThreads) * kOneShotVecs, max_blocks);
    oneshot_kernel<T, R><<<blocks, kThreads, 0, stream>>>(p, rank, n, timeout_ns);
  } else if (algo == PMG_ALGO_PUSH) {
    const size_t slice = staged_slice(R, n, sizeof(T)) / kPerVec<T>;
    unsigned blocks = grid_for(slice, size_t(kThreads) * kTwoShotUnroll<R>, max_blocks);
    push_kernel<T, R><<<blocks, kThreads, 0, stream>>>(p, stage_offset, rank, n, timeout_ns);
  } else {
    const size_t slice = (nvec + R - 1) / R;
    unsigned blocks = grid_for(slice, size_t(kThreads) * kTwoShotUnroll<R>, max_blocks);
    twoshot_kernel<T, R><<<blocks, kThreads, 0, stream>>>(p, rank, n, timeout_ns);
  }
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

template <typename T>
void dispatch_ranks(const pmg_peers &p, size_t so, int rank, int nranks, size_t n, int algo,
                    int max_blocks, uint64_t timeout_ns, cudaStream_t stream) {
  with_ranks(nranks, [&](auto r) {
    launch_allreduce<T, decltype(r)::value>(p, so, rank, n, algo, max_blocks, timeout_ns, stream);
  });
}

int launched() { return cudaGetLastError(); }

// Lists travel to their kernel by value, kCopyBatch entries a launch (blockIdx.y picks the
// entry). work(entry) is an entry's size (0: nothing to do), or -1 when the entry is
// invalid; launch(batch, k, most) queues k entries, the largest `most` in size.
template <typename Batch, typename Entry, typename Work, typename Launch>
int launch_in_batches(const Entry *list, int count, Work work, Launch launch) {
  if (count < 0 || (count > 0 && !list)) return PMG_ERR_INVALID_ARGUMENT;
  for (int at = 0; at < count; at += kCopyBatch) {
    Batch batch = {};
    const int k = min(kCopyBatch, count - at);
    int64_t most = 0;
    for (int i = 0; i < k; ++i) {
      batch.e[i] = list[at + i];
      const int64_t size = work(batch.e[i]);
      if (size < 0) return PMG_ERR_INVALID_ARGUMENT;
      most = max(most, size);
    }
    if (!most) continue;
    launch(batch, k, uint64_t(most));
    if (int err = launched()) return err;
  }
  return 0;
}

// Elements of [begin, begin + len) that lie below end.
size_t clipped(size_t begin, size_t len, size_t end) { return begin >= end ? 0 : min(len, end - begin); }

}  // namespace

extern "C" {

// One average_tensor launch of d's dtype on at most max_blocks blocks.
static int launch_average(const pmg_tensor &d, int nranks, int dtype, int max_blocks,
                          cudaStream_t stream) {
  const unsigned blocks = grid_for(d.n / 4 + 1, kThreads, max_blocks);
  switch (dtype) {
    case PMG_FLOAT32: single_average_kernel<float><<<blocks, kThreads, 0, stream>>>(d, nranks); break;
    case PMG_FLOAT16: single_average_kernel<__half><<<blocks, kThreads, 0, stream>>>(d, nranks); break;
    case PMG_BFLOAT16: single_average_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(d, nranks); break;
    default: return PMG_ERR_UNSUPPORTED_DTYPE;
  }
  return launched();
}

int pmg_average(const void *const *inputs, int nranks, void *out, size_t n, int dtype,
                cudaStream_t stream) {
  if (nranks < 1 || nranks > PMG_MAX_RANKS) return PMG_ERR_BAD_RANK_COUNT;
  if (!inputs || !out) return PMG_ERR_INVALID_ARGUMENT;
  pmg_tensor d = {};
  for (int r = 0; r < nranks; ++r) {
    if (!inputs[r]) return PMG_ERR_INVALID_ARGUMENT;
    d.inputs[r] = inputs[r];
  }
  d.out = out;
  d.n = n;
  if (n == 0) return 0;
  return launch_average(d, nranks, dtype, kPlainMaxBlocks, stream);
}

int pmg_multi_average(const pmg_tensor *table, int ntensors, int nranks, uint64_t max_n,
                      int dtype, cudaStream_t stream) {
  if (nranks < 1 || nranks > PMG_MAX_RANKS) return PMG_ERR_BAD_RANK_COUNT;
  if (ntensors < 0 || (ntensors > 0 && !table)) return PMG_ERR_INVALID_ARGUMENT;
  if (ntensors == 0 || max_n == 0) return 0;
  unsigned blocks = grid_for(max_n / 4 + 1, kThreads, kPlainMaxBlocks);
  switch (dtype) {
    case PMG_FLOAT32: multi_average_kernel<float><<<blocks, kThreads, 0, stream>>>(table, ntensors, nranks); break;
    case PMG_FLOAT16: multi_average_kernel<__half><<<blocks, kThreads, 0, stream>>>(table, ntensors, nranks); break;
    case PMG_BFLOAT16: multi_average_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(table, ntensors, nranks); break;
    default: return PMG_ERR_UNSUPPORTED_DTYPE;
  }
  return launched();
}

int pmg_multi_delta(const pmg_tensor *table, int ntensors, uint64_t max_n, int wire_dtype,
                    cudaStream_t stream) {
  if (ntensors < 0 || (ntensors > 0 && !table)) return PMG_ERR_INVALID_ARGUMENT;
  if (wire_dtype != PMG_FLOAT16 && wire_dtype != PMG_BFLOAT16) return PMG_ERR_UNSUPPORTED_DTYPE;
  if (ntensors == 0 || max_n == 0) return 0;
  unsigned blocks = grid_for(max_n / 4 + 1, kThreads, kPlainMaxBlocks);
  if (wire_dtype == PMG_FLOAT16)
    multi_delta_kernel<__half><<<blocks, kThreads, 0, stream>>>(table, ntensors);
  else
    multi_delta_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(table, ntensors);
  return launched();
}

int pmg_copy_list(const pmg_copy *list, int count, cudaStream_t stream) {
  return launch_in_batches<CopyBatch>(
      list, count,
      [](const pmg_copy &c) -> int64_t {
        return c.nbytes && (!c.src || !c.dst) ? -1 : int64_t(c.nbytes);
      },
      [&](const CopyBatch &batch, int k, uint64_t most) {
        const dim3 grid(grid_for(most / 16 + 1, size_t(kThreads) * kCopyUnroll, kPlainMaxBlocks), k);
        copy_list_kernel<<<grid, kThreads, 0, stream>>>(batch);
      });
}

int pmg_mean_list(const pmg_mean *list, int count, const float *shadow, size_t slot_elems,
                  int rank, int nranks, cudaStream_t stream) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (nranks > 1 && !shadow) return PMG_ERR_INVALID_ARGUMENT;
  return launch_in_batches<MeanBatch>(
      list, count,
      [&](const pmg_mean &m) -> int64_t {
        return (m.n && (!m.out || !m.own)) || m.at + m.n > slot_elems ? -1 : int64_t(m.n);
      },
      [&](const MeanBatch &batch, int k, uint64_t most) {
        const dim3 grid(grid_for(most / 4 + 1, kThreads, kPlainMaxBlocks), k);
        mean_list_kernel<<<grid, kThreads, 0, stream>>>(batch, shadow, slot_elems, rank, nranks);
      });
}

int pmg_accumulate(float *ref, const void *avg, size_t n, int wire_dtype, cudaStream_t stream) {
  if (wire_dtype != PMG_FLOAT16 && wire_dtype != PMG_BFLOAT16) return PMG_ERR_UNSUPPORTED_DTYPE;
  if (n == 0) return 0;
  if (!ref || !avg) return PMG_ERR_INVALID_ARGUMENT;
  unsigned blocks = grid_for(n / 4 + 1, kThreads, kPlainMaxBlocks);
  if (wire_dtype == PMG_FLOAT16)
    accumulate_kernel<__half><<<blocks, kThreads, 0, stream>>>(ref, static_cast<const __half *>(avg), n);
  else
    accumulate_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(ref, static_cast<const __nv_bfloat16 *>(avg), n);
  return launched();
}

size_t pmg_ll_bytes(int nranks) { return size_t(2) * nranks * kLLLines * sizeof(uint4); }

int pmg_allreduce_average(const pmg_peers *peers, size_t stage_offset, int rank, int nranks,
                          size_t n, int dtype, int algo, int max_blocks, uint64_t timeout_ns,
                          cudaStream_t stream) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (int err = check_peers(peers, nranks)) return err;
  if (algo != PMG_ALGO_ONESHOT && algo != PMG_ALGO_TWOSHOT && algo != PMG_ALGO_PUSH &&
      algo != PMG_ALGO_LL)
    return PMG_ERR_INVALID_ARGUMENT;
  if (algo == PMG_ALGO_LL && n * pmg_dtype_size(dtype) > PMG_LL_MAX_BYTES)
    return PMG_ERR_INVALID_ARGUMENT;
  if (algo == PMG_ALGO_PUSH && (stage_offset & 15)) return PMG_ERR_MISALIGNED;
  if (max_blocks < 1 || max_blocks > PMG_MAX_BLOCKS) return PMG_ERR_INVALID_ARGUMENT;
  const size_t so = stage_offset;
  switch (dtype) {
    case PMG_FLOAT32: dispatch_ranks<float>(*peers, so, rank, nranks, n, algo, max_blocks, timeout_ns, stream); break;
    case PMG_FLOAT16: dispatch_ranks<__half>(*peers, so, rank, nranks, n, algo, max_blocks, timeout_ns, stream); break;
    case PMG_BFLOAT16: dispatch_ranks<__nv_bfloat16>(*peers, so, rank, nranks, n, algo, max_blocks, timeout_ns, stream); break;
    default: return PMG_ERR_UNSUPPORTED_DTYPE;
  }
  return launched();
}

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

int pmg_doorbell_alloc(pmg_doorbell **bell) {
  if (!bell) return PMG_ERR_INVALID_ARGUMENT;
  // Mapped: the kernel reads and writes it in place, over PCIe, with no copy queued.
  cudaError_t err = cudaHostAlloc(reinterpret_cast<void **>(bell), sizeof(pmg_doorbell),
                                  cudaHostAllocMapped);
  if (err != cudaSuccess) return err;
  memset(*bell, 0, sizeof(pmg_doorbell));
  return 0;
}

int pmg_doorbell_free(pmg_doorbell *bell) { return bell ? cudaFreeHost(bell) : 0; }

int pmg_resident_start(const pmg_peers *peers, int rank, int nranks, int blocks,
                       uint64_t timeout_ns, pmg_doorbell *bell, cudaStream_t stream) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (int err = check_peers(peers, nranks)) return err;
  if (!bell || blocks < 1 || blocks > PMG_MAX_BLOCKS) return PMG_ERR_INVALID_ARGUMENT;
  pmg_doorbell *mapped = nullptr;
  if (cudaError_t err = cudaHostGetDevicePointer(reinterpret_cast<void **>(&mapped), bell, 0))
    return err;
  bell->ring = 0;  // count 0: the kernel waits for command 1
  bell->done = 0;
  const pmg_peers &p = *peers;
  // The relayed command of a kernel that ran before may hold this one's first count.
  if (cudaError_t err = cudaMemsetAsync(&p.signal[rank]->resident_command, 0, sizeof(uint64_t), stream))
    return err;
  with_ranks(nranks, [&](auto r) {
    resident_kernel<decltype(r)::value><<<blocks, kThreads, 0, stream>>>(p, rank, timeout_ns, mapped);
  });
  return launched();
}

int pmg_resident_ring(pmg_doorbell *bell, uint32_t count, size_t n, int dtype) {
  if (!bell) return PMG_ERR_INVALID_ARGUMENT;
  const size_t esize = pmg_dtype_size(dtype);
  if (!esize) return PMG_ERR_UNSUPPORTED_DTYPE;
  if (n * esize > PMG_LL_MAX_BYTES) return PMG_ERR_INVALID_ARGUMENT;
  // One 8-byte store, which the kernel reads whole: it never sees half a command.
  __atomic_store_n(&bell->ring, ring_word(count, n, dtype), __ATOMIC_RELEASE);
  return 0;
}

namespace {
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}
}  // namespace

// Polls the done line for count. Every 1024 polls (tens of microseconds) it asks whether
// the kernel still runs: a kernel that trapped (a peer never came, after timeout_ns) or
// ended leaves nothing to wait for, and its status says why. Past timeout_ns, and a margin
// for the kernel's own trap to land first, it gives up.
int pmg_resident_wait(pmg_doorbell *bell, uint32_t count, uint64_t timeout_ns,
                      cudaStream_t stream) {
  if (!bell) return PMG_ERR_INVALID_ARGUMENT;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::nanoseconds(timeout_ns) + std::chrono::seconds(5);
  for (uint64_t polls = 1;; ++polls) {
    if (uint32_t(__atomic_load_n(&bell->done, __ATOMIC_ACQUIRE)) == count) return 0;
    if (polls % 1024 == 0) {
      const cudaError_t state = cudaStreamQuery(stream);
      if (state != cudaErrorNotReady) {
        if (uint32_t(__atomic_load_n(&bell->done, __ATOMIC_ACQUIRE)) == count) return 0;
        return state != cudaSuccess ? int(state) : PMG_ERR_NOT_RUNNING;
      }
      if (std::chrono::steady_clock::now() > deadline) return PMG_ERR_TIMEOUT;
    }
    spin_pause();
  }
}

int pmg_resident_stop(pmg_doorbell *bell, uint32_t count, cudaStream_t stream) {
  if (!bell) return PMG_ERR_INVALID_ARGUMENT;
  __atomic_store_n(&bell->ring, ring_word(count, 0, kRingStop), __ATOMIC_RELEASE);
  // The kernel's end, or its error: a stream query would race the last block's exit.
  return cudaStreamSynchronize(stream);
}

int pmg_device_barrier(const pmg_peers *peers, int rank, int nranks, uint64_t timeout_ns,
                       cudaStream_t stream) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (int err = check_peers(peers, nranks)) return err;
  barrier_kernel<<<1, 32, 0, stream>>>(*peers, rank, nranks, timeout_ns);
  return launched();
}

namespace {
using StreamValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct MemOps {
  StreamValue32 write = nullptr, wait = nullptr;
  int status = 0;  // why they could not be found
};

// The driver's stream memory operations, found once through the runtime: pympgu links no
// libcuda, so that it imports on machines without a driver.
const MemOps &mem_ops() {
  static const MemOps ops = [] {
    MemOps m;
    const char *names[2] = {"cuStreamWriteValue32", "cuStreamWaitValue32"};
    StreamValue32 *found[2] = {&m.write, &m.wait};
    for (int i = 0; i < 2; ++i) {
      void *fn = nullptr;
      cudaDriverEntryPointQueryResult result;
      const cudaError_t err =
          cudaGetDriverEntryPointByVersion(names[i], &fn, 12000, cudaEnableDefault, &result);
      if (err != cudaSuccess || result != cudaDriverEntryPointSuccess || !fn) {
        m.status = err != cudaSuccess ? int(err) : int(cudaErrorSymbolNotFound);
        return m;
      }
      *found[i] = reinterpret_cast<StreamValue32>(fn);
    }
    return m;
  }();
  return ops;
}
}  // namespace

int pmg_stream_barrier(uint32_t *const *flags, int rank, int nranks, uint32_t seq,
                       cudaStream_t stream) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (!flags) return PMG_ERR_INVALID_ARGUMENT;
  for (int p = 0; p < nranks; ++p)
    if (!flags[p]) return PMG_ERR_INVALID_ARGUMENT;
  const MemOps &ops = mem_ops();
  if (ops.status) return ops.status;
  auto at = [](const uint32_t *flag) { return reinterpret_cast<CUdeviceptr>(flag); };
  // CUresult's codes are cudaError_t's for the errors these return (invalid value, not
  // supported, a sticky launch failure), so the runtime's message names them.
  for (int p = 0; p < nranks; ++p) {
    // Each with a memory fence before it: what this stream wrote before (the pushed arrays)
    // is visible to a peer that has seen the number.
    if (CUresult r = ops.write(stream, at(flags[p] + rank), seq, CU_STREAM_WRITE_VALUE_DEFAULT))
      return int(r);
  }
  for (int p = 0; p < nranks; ++p) {
    if (p == rank) continue;
    if (CUresult r = ops.wait(stream, at(flags[rank] + p), seq, CU_STREAM_WAIT_VALUE_GEQ))
      return int(r);
  }
  return 0;
}

int pmg_stream_barrier_available(void) { return mem_ops().status; }

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

size_t pmg_stage_bytes(int nranks, size_t nbytes) {
  if (nranks < 2) return 0;
  return size_t(nranks - 1) * staged_slice(nranks, nbytes, 1);
}

int pmg_ce_chunks(int nranks, size_t n, int dtype, size_t chunk_bytes, size_t *bounds,
                  int *count) {
  const size_t esize = pmg_dtype_size(dtype);
  if (!esize) return PMG_ERR_UNSUPPORTED_DTYPE;
  if (nranks < 1 || chunk_bytes < 16 || !bounds || !count) return PMG_ERR_INVALID_ARGUMENT;
  const size_t per_vec = 16 / esize;
  const size_t last = max(per_vec, chunk_bytes / esize / per_vec * per_vec);
  // Sizes from the last chunk back: last, last, 2 last, 4 last, ...; the first chunk takes
  // what is left, with any rest below `last` (a chunk that small would cost its copies and
  // a barrier for nothing). Every size is whole vectors (the slice is), and the sizes double
  // for each chunk back, so a slice below 2^62 chunks of `last` fits PMG_CE_MAX_CHUNKS.
  size_t sizes[PMG_CE_MAX_CHUNKS];
  int k = 0;
  for (size_t left = staged_slice(nranks, n, esize), size = last; left; ++k) {
    if (k == PMG_CE_MAX_CHUNKS) return PMG_ERR_INVALID_ARGUMENT;
    sizes[k] = left < size + last ? left : size;
    left -= sizes[k];
    if (k >= 1) size *= 2;
  }
  bounds[0] = 0;
  for (int c = 0; c < k; ++c) bounds[c + 1] = bounds[c] + sizes[k - 1 - c];
  *count = k;
  return 0;
}

int pmg_ce_allreduce_average(const pmg_peers *peers, size_t stage_offset, int rank, int nranks,
                             size_t n, int dtype, size_t chunk_bytes, int max_blocks,
                             uint64_t timeout_ns, cudaStream_t stream, cudaStream_t copy_stream,
                             cudaEvent_t event) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (int err = check_peers(peers, nranks)) return err;
  const size_t esize = pmg_dtype_size(dtype);
  if (!esize) return PMG_ERR_UNSUPPORTED_DTYPE;
  if ((stage_offset & 15) || chunk_bytes < 16 || max_blocks < 1) return PMG_ERR_INVALID_ARGUMENT;
  if (nranks == 1 || n == 0) return 0;
  if (!copy_stream || !event) return PMG_ERR_INVALID_ARGUMENT;
  // Every rank cuts the same chunks (the schedule depends on n, not on the rank), so every
  // rank crosses the same sequence of barriers.
  size_t bounds[PMG_CE_MAX_CHUNKS + 1];
  int nchunks = 0;
  if (int err = pmg_ce_chunks(nranks, n, dtype, chunk_bytes, bounds, &nchunks)) return err;
  const size_t slice = bounds[nchunks];
  auto data = [&](int r, size_t elem) { return static_cast<char *>(peers->data[r]) + elem * esize; };
  auto stage = [&](int dst, int src, size_t elem) {
    return data(dst, 0) + stage_offset + (staged_slot(src, dst) * slice + elem) * esize;
  };
  const size_t lo = size_t(rank) * slice;
  const size_t hi = min(n, lo + slice);
  cudaError_t err;
  // Chunk c of every peer's slice of our replica, into that peer's staging slot for us.
  auto push = [&](int c) -> cudaError_t {
    const size_t at = bounds[c], len = bounds[c + 1] - at;
    for (int j = 1; j < nranks; ++j) {
      const int dst = (rank + j) % nranks;  // rotated, so that ranks do not all hit rank 0
      const size_t m = clipped(dst * slice + at, len, min(n, (dst + 1) * slice));
      if (!m) continue;
      if (cudaError_t e = cudaMemcpyAsync(stage(dst, rank, at), data(rank, dst * slice + at),
                                          m * esize, cudaMemcpyDefault, copy_stream))
        return e;
    }
    return cudaSuccess;
  };
  // Chunk c of our slice, averaged, from our replica into every peer's.
  auto write_back = [&](int c) -> cudaError_t {
    const size_t at = bounds[c], m = clipped(lo + at, bounds[c + 1] - at, hi);
    for (int j = 1; j < nranks && m; ++j) {
      const int dst = (rank + j) % nranks;
      if (cudaError_t e = cudaMemcpyAsync(data(dst, lo + at), data(rank, lo + at), m * esize,
                                          cudaMemcpyDefault, copy_stream))
        return e;
    }
    return cudaSuccess;
  };
  // Every byte crosses the link by DMA, the pushes and the write-backs alike: the copy
  // engines carry more than SM stores, alone or beside them (docs/DECISIONS.md, "Copy
  // engines for large buffers"). On copy_stream: push 0, push 1, write-back 0, push 2, write-back 1, ...:
  // push c + 1 crosses while chunk c's barrier and average run, so the copy engines never
  // wait for the SMs as long as that push outlasts them. The chunks halve towards the end
  // (pmg_ce_chunks): an average reads and writes HBM several times faster than the link
  // carries, so push c + 1 outlasts chunk c's average at half its size; few chunks mean few
  // copies (each costs the copy engines a few µs), and a small last chunk leaves little
  // average that nothing hides. On stream, chunk c's barrier waits for our push c (and
  // write-back c - 1) and returns once every rank's has landed. The one event is recorded
  // and waited for in turn; a wait takes the record made last before it.
  if ((err = cudaEventRecord(event, stream)) || (err = cudaStreamWaitEvent(copy_stream, event, 0)))
    return err;
  for (int c = 0; c <= nchunks; ++c) {
    if (c < nchunks && (err = push(c))) return err;
    if (c > 0) {
      // Chunk c - 1's average is done (the event's last record), so it may go out; peers
      // overwrite our replica's chunk c - 1 of their slices only after their barrier c - 1,
      // so after our push c - 1 has read it.
      if ((err = cudaStreamWaitEvent(copy_stream, event, 0)) || (err = write_back(c - 1)))
        return err;
    }
    if ((err = cudaEventRecord(event, copy_stream)) || (err = cudaStreamWaitEvent(stream, event, 0)))
      return err;
    barrier_kernel<<<1, 32, 0, stream>>>(*peers, rank, nranks, timeout_ns);
    if ((err = cudaGetLastError())) return err;
    // The last barrier: every peer's write-backs into our replica have landed, and every
    // peer has averaged from its staging area, so the next exchange may push into it.
    if (c == nchunks) break;
    pmg_tensor d = {};
    const size_t at = bounds[c];
    d.n = clipped(lo + at, bounds[c + 1] - at, hi);
    if (d.n) {
      for (int r = 0; r < nranks; ++r) d.inputs[r] = r == rank ? data(rank, lo + at) : stage(rank, r, at);
      d.out = data(rank, lo + at);
      if (int status = launch_average(d, nranks, dtype, max_blocks, stream)) return status;
    }
    if ((err = cudaEventRecord(event, stream))) return err;
  }
  return 0;
}

}  // extern "C"
