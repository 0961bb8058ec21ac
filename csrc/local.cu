// Averages of replicas that this process addresses directly (one GPU, or peers mapped into
// it), the low-precision wire's delta and accumulation, and lists of copies and means: the
// kernels with no barrier, which the exchanges build on.
#include "kernels.cuh"
#include "methods.h"

namespace {

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

}  // namespace

// One average_tensor launch of d's dtype on at most max_blocks blocks.
int pmg_launch_local_average(const pmg_tensor &d, int nranks, int dtype, int max_blocks,
                             cudaStream_t stream) {
  const unsigned blocks = grid_for(d.n / 4 + 1, kThreads, max_blocks);
  if (int err = with_dtype(dtype, [&](auto t) {
        single_average_kernel<decltype(t)><<<blocks, kThreads, 0, stream>>>(d, nranks);
        return 0;
      }))
    return err;
  return launched();
}

extern "C" {

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
  return pmg_launch_local_average(d, nranks, dtype, kPlainMaxBlocks, stream);
}

int pmg_multi_average(const pmg_tensor *table, int ntensors, int nranks, uint64_t max_n,
                      int dtype, cudaStream_t stream) {
  if (nranks < 1 || nranks > PMG_MAX_RANKS) return PMG_ERR_BAD_RANK_COUNT;
  if (ntensors < 0 || (ntensors > 0 && !table)) return PMG_ERR_INVALID_ARGUMENT;
  if (ntensors == 0 || max_n == 0) return 0;
  unsigned blocks = grid_for(max_n / 4 + 1, kThreads, kPlainMaxBlocks);
  if (int err = with_dtype(dtype, [&](auto t) {
        multi_average_kernel<decltype(t)><<<blocks, kThreads, 0, stream>>>(table, ntensors,
                                                                           nranks);
        return 0;
      }))
    return err;
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

}  // extern "C"
