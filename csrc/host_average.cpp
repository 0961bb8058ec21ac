// Host (CPU) averaging with the device kernels' arithmetic: fp32 accumulation in rank order,
// one IEEE division by R, round-to-nearest-even back to the storage type. CPU-only runs use
// it, and the tests use it as the reference that the GPU must match bit for bit.
// Built without CUDA headers so that the host part installs on a machine with no toolkit.
#include <algorithm>
#include <cstring>

#include "host_threads.h"
#include "pympgu.h"

namespace {

// Conversions written out (no compiler intrinsics) so the host needs no fp16 support.
inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t b = float_to_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40);  // quiet NaN
  b += 0x7fffu + ((b >> 16) & 1u);  // round to nearest, ties to even
  return uint16_t(b >> 16);
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // Subnormal half: value = man * 2^-24, exact in fp32.
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_half(float f) {
  uint32_t b = float_to_bits(f);
  uint16_t sign = uint16_t((b >> 16) & 0x8000u);
  uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // nan
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to inf (>= 65520)
  if (a < 0x38800000u) {
    // Result is subnormal or zero: scale to units of 2^-24 and round to nearest even.
    // The product is exact in fp32 and the conversion rounds in the current (nearest) mode.
    float v = bits_to_float(a) * 16777216.0f;
    uint32_t q = uint32_t(v);
    float r = v - float(q);
    if (r > 0.5f || (r == 0.5f && (q & 1u))) q++;
    return uint16_t(sign | q);
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even.
  uint32_t m = a - 0x38000000u;  // exponent bias 127 -> 15
  m += 0xfffu + ((m >> 13) & 1u);
  return uint16_t(sign | (m >> 13));
}

struct F32 {
  using storage = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
struct F16 {
  using storage = uint16_t;
  static float load(uint16_t x) { return half_to_float(x); }
  static uint16_t store(float x) { return float_to_half(x); }
};
struct BF16 {
  using storage = uint16_t;
  static float load(uint16_t x) { return bf16_to_float(x); }
  static uint16_t store(float x) { return float_to_bf16(x); }
};

// The mean of R inputs into every one of nouts outputs, in blocks that stay in L1: the sums
// go to a local block first, so that the loop over elements has no store that may alias an
// input (an output may be one) and vectorises, and each block is then stored into every
// output. Per element the arithmetic is unchanged: x0 + x1 + ... in rank order, divided once.
constexpr size_t kBlock = 2048;

template <typename K, int R>
void average_into(const void *const *inputs, void *const *outs, int nouts, size_t n) {
  using S = typename K::storage;
  const S *in[R];
  for (int r = 0; r < R; ++r) in[r] = static_cast<const S *>(inputs[r]);
  const float denom = float(R);
  float mean[kBlock];
  for (size_t lo = 0; lo < n; lo += kBlock) {
    const size_t m = n - lo < kBlock ? n - lo : kBlock;
    for (size_t i = 0; i < m; ++i) {
      float acc = K::load(in[0][lo + i]);  // from x0, not 0.0f, so -0.0 survives like NCCL
      for (int r = 1; r < R; ++r) acc += K::load(in[r][lo + i]);
      mean[i] = acc / denom;
    }
    for (int o = 0; o < nouts; ++o) {
      S *out = static_cast<S *>(outs[o]) + lo;
      for (size_t i = 0; i < m; ++i) out[i] = K::store(mean[i]);
    }
  }
}

template <typename K>
void average(const void *const *inputs, int nranks, void *const *outs, int nouts, size_t n) {
  switch (nranks) {  // the rank count a constant of the inner loop
    case 1: average_into<K, 1>(inputs, outs, nouts, n); break;
    case 2: average_into<K, 2>(inputs, outs, nouts, n); break;
    case 3: average_into<K, 3>(inputs, outs, nouts, n); break;
    case 4: average_into<K, 4>(inputs, outs, nouts, n); break;
    case 5: average_into<K, 5>(inputs, outs, nouts, n); break;
    case 6: average_into<K, 6>(inputs, outs, nouts, n); break;
    case 7: average_into<K, 7>(inputs, outs, nouts, n); break;
    default: average_into<K, 8>(inputs, outs, nouts, n); break;
  }
}

template <typename K>
void delta(const float *x, const float *ref, void *wire, size_t n) {
  auto *w = static_cast<typename K::storage *>(wire);
  for (size_t i = 0; i < n; ++i) w[i] = K::store(x[i] - ref[i]);
}

template <typename K>
void accumulate(float *ref, const void *avg, size_t n) {
  const auto *a = static_cast<const typename K::storage *>(avg);
  for (size_t i = 0; i < n; ++i) ref[i] += K::load(a[i]);
}

}  // namespace

extern "C" {

const char *pmg_status_name(int status) {
  switch (status) {
    case PMG_SUCCESS: return "pmgSuccess";
    case PMG_ERR_INVALID_ARGUMENT: return "pmgErrorInvalidArgument";
    case PMG_ERR_UNSUPPORTED_DTYPE: return "pmgErrorUnsupportedDtype";
    case PMG_ERR_BAD_RANK_COUNT: return "pmgErrorBadRankCount";
    case PMG_ERR_MISALIGNED: return "pmgErrorMisaligned";
    case PMG_ERR_NO_CUDA: return "pmgErrorNoCuda";
    case PMG_ERR_TIMEOUT: return "pmgErrorTimeout";
    case PMG_ERR_NOT_RUNNING: return "pmgErrorNotRunning";
    default: return nullptr;
  }
}

const char *pmg_status_string(int status) {
  switch (status) {
    case PMG_SUCCESS: return "no error";
    case PMG_ERR_INVALID_ARGUMENT: return "invalid argument (null pointer or bad size)";
    case PMG_ERR_UNSUPPORTED_DTYPE: return "unsupported dtype (float32, float16, bfloat16 only)";
    case PMG_ERR_BAD_RANK_COUNT: return "rank count must be 1 to 8 and rank within it";
    case PMG_ERR_MISALIGNED: return "buffer not aligned to 16 bytes";
    case PMG_ERR_NO_CUDA: return "pympgu was built without CUDA";
    case PMG_ERR_TIMEOUT: return "timed out waiting for the GPU";
    case PMG_ERR_NOT_RUNNING: return "the resident exchange kernel is not running";
    default: return nullptr;
  }
}

size_t pmg_dtype_size(int dtype) {
  switch (dtype) {
    case PMG_FLOAT32: return 4;
    case PMG_FLOAT16: return 2;
    case PMG_BFLOAT16: return 2;
    default: return 0;
  }
}

int pmg_host_average(const void *const *inputs, int nranks, void *const *outs, int nouts,
                     size_t n, int dtype) {
  if (nranks < 1 || nranks > PMG_MAX_RANKS) return PMG_ERR_BAD_RANK_COUNT;
  if (!inputs || !outs || nouts < 1 || nouts > PMG_MAX_RANKS) return PMG_ERR_INVALID_ARGUMENT;
  for (int r = 0; r < nranks; ++r)
    if (!inputs[r] && n) return PMG_ERR_INVALID_ARGUMENT;
  for (int o = 0; o < nouts; ++o)
    if (!outs[o] && n) return PMG_ERR_INVALID_ARGUMENT;
  void (*run)(const void *const *, int, void *const *, int, size_t);
  switch (dtype) {
    case PMG_FLOAT32: run = average<F32>; break;
    case PMG_FLOAT16: run = average<F16>; break;
    case PMG_BFLOAT16: run = average<BF16>; break;
    default: return PMG_ERR_UNSUPPORTED_DTYPE;
  }
  // Whole blocks a part: an element's result does not depend on how the range is cut.
  const size_t esize = pmg_dtype_size(dtype);
  const size_t blocks = (n + kBlock - 1) / kBlock;
  const int parts = int(std::min<size_t>(pmg::parts_for(n * esize * (nranks + nouts)),
                                         blocks ? blocks : 1));
  pmg::parallel(parts, [&](int p) {
    const size_t lo = blocks * size_t(p) / size_t(parts) * kBlock;
    const size_t hi = std::min(n, blocks * size_t(p + 1) / size_t(parts) * kBlock);
    if (lo >= hi) return;
    const void *in[PMG_MAX_RANKS];
    void *out[PMG_MAX_RANKS];
    for (int r = 0; r < nranks; ++r) in[r] = static_cast<const char *>(inputs[r]) + lo * esize;
    for (int o = 0; o < nouts; ++o) out[o] = static_cast<char *>(outs[o]) + lo * esize;
    run(in, nranks, out, nouts, hi - lo);
  });
  return 0;
}

int pmg_host_delta(const float *x, const float *ref, void *wire, size_t n, int wire_dtype) {
  if (n && (!x || !ref || !wire)) return PMG_ERR_INVALID_ARGUMENT;
  switch (wire_dtype) {
    case PMG_FLOAT16: delta<F16>(x, ref, wire, n); return 0;
    case PMG_BFLOAT16: delta<BF16>(x, ref, wire, n); return 0;
    default: return PMG_ERR_UNSUPPORTED_DTYPE;  // a float32 wire needs no delta
  }
}

int pmg_host_accumulate(float *ref, const void *avg, size_t n, int wire_dtype) {
  if (n && (!ref || !avg)) return PMG_ERR_INVALID_ARGUMENT;
  switch (wire_dtype) {
    case PMG_FLOAT16: accumulate<F16>(ref, avg, n); return 0;
    case PMG_BFLOAT16: accumulate<BF16>(ref, avg, n); return 0;
    default: return PMG_ERR_UNSUPPORTED_DTYPE;
  }
}

}  // extern "C"
