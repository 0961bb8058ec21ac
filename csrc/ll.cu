// LL, for small buffers: every rank stores its values, flagged with the call's sequence
// number, into every peer's mailbox, and averages from its own; the resident kernel runs the
// same calls without a launch each.
#include <chrono>
#include <cstring>

#include "kernels.cuh"
#include "methods.h"

namespace {

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

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

int pmg_launch_ll(const pmg_call &c) {
  if (int err = with_dtype(c.dtype, [&](auto t) {
        using T = decltype(t);
        const unsigned blocks = grid_for((c.n * sizeof(T) + 7) / 8, kThreads, c.max_blocks);
        with_ranks(c.nranks, [&](auto r) {
          ll_kernel<T, decltype(r)::value><<<blocks, kThreads, 0, c.stream>>>(
              *c.peers, c.rank, c.n, c.timeout_ns);
        });
        return 0;
      }))
    return err;
  return launched();
}

extern "C" {

size_t pmg_ll_bytes(int nranks) { return size_t(2) * nranks * kLLLines * sizeof(uint4); }

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

}  // extern "C"
