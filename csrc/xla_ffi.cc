// pympgu's average as XLA operations, so that a jitted JAX function can average a list of
// arrays with the other ranks in the middle of its own work: the pack, the all-reduce and
// the unpack are queued on XLA's stream by XLA's executor, with no DLPack export or import,
// no host wait and no Python on the way (pympgu/xla.py).
//
// "pympgu_average" takes N arrays of one dtype and returns N arrays of the same shapes (the
// Python side aliases each output to its input), all on XLA's stream.
//
// The overlapped pair lets XLA compute while the link works:
//   "pympgu_average_start" takes the N arrays and returns a token. It packs them on XLA's
//   stream (so XLA may reuse their memory as soon as the operation is behind it in stream
//   order), then queues the exchange (an all-reduce kernel, or the gather below) on the
//   group's high-priority side stream and returns.
//   "pympgu_average_done" takes the token and returns the N averages. It orders XLA's stream
//   after the side stream, then unpacks. Its outputs are written on XLA's stream only: XLA
//   may have given their memory to temporaries of the work between the two. Given N more
//   arrays (fresh), it returns fresh + (average - input) instead: the one-step-delayed
//   correction, in the same pass (the gather algorithm only).
// With PMG_ALGO_GATHER the side stream does no arithmetic at all: a barrier (every rank has
// packed), DMA copies of the peers' buffers into this rank's shadow, a barrier (every peer has
// copied ours). The copy engines leave every SM to XLA, whose matrix products lose a whole
// wave to a kernel that takes even a few SMs; the done operation then averages from the
// buffer and the shadow (pmg_mean_list).
// Python (pympgu.xla.average_during) places the work between them with optimization barriers.
// Every operation first orders XLA's stream after any all-reduce still on the side stream, so
// nothing packs into the buffer while it is being averaged.
//
// Attributes, fixed when the function is traced (the done operation takes group, algo,
// offsets and total):
//   group       id of a registered PeerGroup (pmg_xla_register);
//   algo        a pmg_algo code, resolved from 'auto' by the Python side;
//   max_blocks  the kernel's grid cap;
//   chunk_bytes the DMA chunk of PMG_ALGO_CE;
//   offsets     element offset of each array in the group's buffer (every rank the same);
//   total       elements averaged from the buffer's start: at least the last array's end, and
//               what an Exchanger's own path averages, so the two paths can take turns.
//
// The registry is built without XLA too; only the handler needs jaxlib's headers.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "pympgu.h"

namespace {

std::mutex registry_lock;
std::map<int64_t, pmg_group> registry;
int64_t next_id = 1;

bool lookup(int64_t id, pmg_group *out) {
  std::lock_guard<std::mutex> hold(registry_lock);
  auto it = registry.find(id);
  if (it == registry.end()) return false;
  *out = it->second;
  return true;
}

}  // namespace

extern "C" int pmg_xla_register(const pmg_group *group, int64_t *id) {
  if (!group || !id) return PMG_ERR_INVALID_ARGUMENT;
  std::lock_guard<std::mutex> hold(registry_lock);
  if (*id == 0) {
    *id = next_id++;
  } else if (!registry.count(*id)) {
    return PMG_ERR_INVALID_ARGUMENT;
  }
  registry[*id] = *group;
  return 0;
}

extern "C" int pmg_xla_unregister(int64_t id) {
  std::lock_guard<std::mutex> hold(registry_lock);
  return registry.erase(id) ? 0 : PMG_ERR_INVALID_ARGUMENT;
}

#ifndef PMG_WITH_XLA_FFI

extern "C" void *pmg_xla_handler(const char *) { return nullptr; }

#else

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// XLA reports the message as the exception's text: keep CUDA's own name and words in it.
ffi::Error failed(const char *op, const char *what, int status) {
  return ffi::Error::Internal(std::string(op) + ": " + what + ": " + pmg_error_name(status) +
                              ": " + pmg_error_string(status));
}

int dtype_code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return PMG_FLOAT32;
    case ffi::DataType::F16: return PMG_FLOAT16;
    case ffi::DataType::BF16: return PMG_BFLOAT16;
    default: return -1;
  }
}

// One operand or result as the checks need it.
struct Array {
  void *data;
  ffi::DataType type;
  size_t nbytes;
};

ffi::Error collect(ffi::RemainingArgs args, size_t count, std::vector<Array> *out) {
  for (size_t i = 0; i < count; ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    out->push_back({a->untyped_data(), a->element_type(), a->size_bytes()});
  }
  return ffi::Error::Success();
}

ffi::Error collect(ffi::RemainingRets rets, size_t count, std::vector<Array> *out) {
  for (size_t i = 0; i < count; ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (r.has_error()) return r.error();
    out->push_back({(*r)->untyped_data(), (*r)->element_type(), (*r)->size_bytes()});
  }
  return ffi::Error::Success();
}

// Where each array sits in the group's buffer (byte offsets), after checking that they are
// of one float dtype, in order, 16-byte aligned and within the buffer, and that `total`
// elements cover them without overrunning it.
ffi::Error place(const char *op, const pmg_group &g, const std::vector<Array> &arrays,
                 ffi::Span<const int64_t> offsets, int64_t total, std::vector<size_t> *at,
                 int *dtype) {
  if (offsets.size() != arrays.size())
    return ffi::Error::InvalidArgument(std::string(op) + ": needs one offset per array");
  size_t end = 0;
  *dtype = -1;
  for (size_t i = 0; i < arrays.size(); ++i) {
    const int code = dtype_code(arrays[i].type);
    if (code < 0 || (i && code != *dtype))
      return ffi::Error::InvalidArgument(
          std::string(op) + ": arrays must all be float32, all float16 or all bfloat16");
    *dtype = code;
    const size_t byte = size_t(offsets[i]) * pmg_dtype_size(code);
    if (offsets[i] < 0 || byte < end || (byte & 15) || byte + arrays[i].nbytes > g.nbytes)
      return ffi::Error::InvalidArgument(std::string(op) + ": array " + std::to_string(i) +
                                         " does not fit the group's " +
                                         std::to_string(g.nbytes) + "-byte buffer at its offset");
    end = byte + arrays[i].nbytes;
    at->push_back(byte);
  }
  const size_t bytes = size_t(total) * pmg_dtype_size(*dtype);
  if (total < 0 || bytes < end || bytes > g.nbytes)
    return ffi::Error::InvalidArgument(std::string(op) + ": total " + std::to_string(total) +
                                       " does not cover the arrays or overruns the buffer");
  return ffi::Error::Success();
}

// The copies between the arrays and the group's buffer: into it (pack) or out of it.
std::vector<pmg_copy> copies(const pmg_group &g, const std::vector<Array> &arrays,
                             const std::vector<size_t> &at, bool pack) {
  char *mine = static_cast<char *>(g.peers.data[g.rank]);
  std::vector<pmg_copy> list(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i)
    list[i] = pack ? pmg_copy{arrays[i].data, mine + at[i], arrays[i].nbytes}
                   : pmg_copy{mine + at[i], arrays[i].data, arrays[i].nbytes};
  return list;
}

// Makes the group's GPU current for the operation's lifetime (XLA's thread has its own),
// after checking that the arrays live there.
class OnGroupDevice {
 public:
  OnGroupDevice(const char *op, const pmg_group &g, const void *array) : device_(g.device) {
    int status = pmg_get_device(&before_);
    if (status) {
      error_ = failed(op, "cudaGetDevice", status);
      before_ = device_;
      return;
    }
    if (before_ != device_ && (status = pmg_set_device(device_))) {
      error_ = failed(op, "cudaSetDevice", status);
      before_ = device_;
      return;
    }
    int where = -1;
    if ((status = pmg_pointer_device(array, &where))) {
      error_ = failed(op, "cudaPointerGetAttributes", status);
    } else if (where != device_) {
      error_ = ffi::Error::InvalidArgument(
          std::string(op) + ": the arrays are on GPU " + std::to_string(where) + ", rank " +
          std::to_string(g.rank) + "'s PeerGroup on GPU " + std::to_string(device_));
    }
  }
  ~OnGroupDevice() {
    if (before_ != device_) pmg_set_device(before_);
  }
  const ffi::Error &error() const { return error_; }

 private:
  int device_, before_ = -1;
  ffi::Error error_ = ffi::Error::Success();
};

ffi::Error lookup_group(const char *op, int64_t id, pmg_group *g) {
  if (lookup(id, g)) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string(op) + ": PeerGroup " + std::to_string(id) +
      " is closed: a function traced with it must not run after its Exchanger or PeerGroup "
      "is closed");
}

int allreduce(const pmg_group &g, int algo, int max_blocks, int64_t chunk_bytes, size_t n,
              int dtype, cudaStream_t stream) {
  if (algo == PMG_ALGO_CE)
    return pmg_ce_allreduce_average(&g.peers, g.stage_offset, g.rank, g.nranks, n, dtype,
                                    size_t(chunk_bytes), max_blocks, g.timeout_ns, stream,
                                    g.copy_stream, g.event);
  return pmg_allreduce_average(&g.peers, g.stage_offset, g.rank, g.nranks, n, dtype, algo,
                               max_blocks, g.timeout_ns, stream);
}

// An all-reduce of the overlapped pair may still be running on the side stream: whatever
// touches the group's buffer on XLA's stream waits for it. A no-op when none was queued.
int after_side(const pmg_group &g, cudaStream_t stream) {
  return g.side_out ? pmg_stream_wait_event(stream, g.side_out) : 0;
}

// How every operation that reads arrays begins, on XLA's stream: wait for any exchange still
// on the side stream, then pack the arrays into the group's buffer.
ffi::Error pack(const char *op, const pmg_group &g, const std::vector<Array> &in,
                const std::vector<size_t> &at, cudaStream_t stream) {
  int status;
  if ((status = after_side(g, stream))) return failed(op, "wait for the side stream", status);
  if ((status = pmg_copy_list(copies(g, in, at, true).data(), int(in.size()), stream)))
    return failed(op, "pack", status);
  return ffi::Error::Success();
}

// The gather algorithm averages float32 only (pmg_mean_list), from a registered shadow.
ffi::Error gather_ready(const char *op, const pmg_group &g, int32_t algo, int dtype) {
  if (algo != PMG_ALGO_GATHER || (dtype == PMG_FLOAT32 && (g.shadow || g.nranks == 1)))
    return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) +
                                     ": the gather algorithm needs float32 arrays and a shadow");
}

// Elements each shadow slot holds: total rounded up to 64 (within the buffer), so that the
// slots stay 16-byte aligned for pmg_mean_list's vector loads.
size_t gather_elems(const pmg_group &g, int64_t total) {
  const size_t rounded = (size_t(total) + 63) / 64 * 64;
  return std::min(rounded, g.nbytes / sizeof(float));
}

constexpr const char *kAverage = "pympgu_average";
constexpr const char *kStart = "pympgu_average_start";
constexpr const char *kDone = "pympgu_average_done";

ffi::Error average(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   int64_t group, int32_t algo, int32_t max_blocks, int64_t chunk_bytes,
                   ffi::Span<const int64_t> offsets, int64_t total) {
  pmg_group g;
  if (auto e = lookup_group(kAverage, group, &g); e.failure()) return e;
  if (rets.size() != args.size())
    return ffi::Error::InvalidArgument("pympgu_average: needs as many outputs as inputs");
  if (algo == PMG_ALGO_GATHER)
    return ffi::Error::InvalidArgument("pympgu_average: gather is for the overlapped pair only");
  if (args.size() == 0) return ffi::Error::Success();
  std::vector<Array> in, out;
  std::vector<size_t> at;
  int dtype;
  if (auto e = collect(args, args.size(), &in); e.failure()) return e;
  if (auto e = collect(rets, rets.size(), &out); e.failure()) return e;
  if (auto e = place(kAverage, g, in, offsets, total, &at, &dtype); e.failure()) return e;
  OnGroupDevice on(kAverage, g, in[0].data);
  if (on.error().failure()) return on.error();
  if (auto e = pack(kAverage, g, in, at, stream); e.failure()) return e;
  int status;
  if ((status = allreduce(g, algo, max_blocks, chunk_bytes, size_t(total), dtype, stream)))
    return failed(kAverage, "average", status);
  if ((status = pmg_copy_list(copies(g, out, at, false).data(), int(out.size()), stream)))
    return failed(kAverage, "unpack", status);
  return ffi::Error::Success();
}

ffi::Error average_start(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                         int64_t group, int32_t algo, int32_t max_blocks, int64_t chunk_bytes,
                         ffi::Span<const int64_t> offsets, int64_t total) {
  pmg_group g;
  if (auto e = lookup_group(kStart, group, &g); e.failure()) return e;
  if (!g.side || !g.side_in || !g.side_out)
    return ffi::Error::InvalidArgument("pympgu_average_start: the group has no side stream");
  if (args.size() == 0) return ffi::Error::Success();
  std::vector<Array> in;
  std::vector<size_t> at;
  int dtype;
  if (auto e = collect(args, args.size(), &in); e.failure()) return e;
  if (auto e = place(kStart, g, in, offsets, total, &at, &dtype); e.failure()) return e;
  if (auto e = gather_ready(kStart, g, algo, dtype); e.failure()) return e;
  OnGroupDevice on(kStart, g, in[0].data);
  if (on.error().failure()) return on.error();
  if (auto e = pack(kStart, g, in, at, stream); e.failure()) return e;
  int status;
  if ((status = pmg_event_record(g.side_in, stream)) ||
      (status = pmg_stream_wait_event(g.side, g.side_in)))
    return failed(kStart, "order the side stream after the pack", status);
  if (algo == PMG_ALGO_GATHER) {
    if ((status = pmg_device_barrier(&g.peers, g.rank, g.nranks, g.timeout_ns, g.side)) ||
        (status = pmg_gather_peers(&g.peers, g.rank, g.nranks, g.shadow, gather_elems(g, total),
                                   dtype, g.side)) ||
        (status = pmg_device_barrier(&g.peers, g.rank, g.nranks, g.timeout_ns, g.side)))
      return failed(kStart, "gather", status);
  } else if ((status = allreduce(g, algo, max_blocks, chunk_bytes, size_t(total), dtype, g.side))) {
    return failed(kStart, "average", status);
  }
  if ((status = pmg_event_record(g.side_out, g.side)))
    return failed(kStart, "record the average's end", status);
  return ffi::Error::Success();
}

ffi::Error average_done(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        int64_t group, int32_t algo, ffi::Span<const int64_t> offsets,
                        int64_t total) {
  pmg_group g;
  if (auto e = lookup_group(kDone, group, &g); e.failure()) return e;
  if (rets.size() == 0) return ffi::Error::Success();
  // args: the token (it only orders this operation after its start), then fresh, if any.
  const size_t nfresh = args.size() - 1;
  if (nfresh && nfresh != rets.size())
    return ffi::Error::InvalidArgument("pympgu_average_done: needs one fresh array per output");
  if (nfresh && algo != PMG_ALGO_GATHER)
    return ffi::Error::InvalidArgument(
        "pympgu_average_done: the fused correction needs the gather algorithm");
  std::vector<Array> out, fresh;
  std::vector<size_t> at;
  int dtype;
  if (auto e = collect(rets, rets.size(), &out); e.failure()) return e;
  if (auto e = place(kDone, g, out, offsets, total, &at, &dtype); e.failure()) return e;
  if (auto e = gather_ready(kDone, g, algo, dtype); e.failure()) return e;
  for (size_t i = 0; i < nfresh; ++i) {
    auto a = args.get<ffi::AnyBuffer>(i + 1);
    if (a.has_error()) return a.error();
    if (a->element_type() != out[i].type || a->size_bytes() != out[i].nbytes)
      return ffi::Error::InvalidArgument("pympgu_average_done: fresh array " +
                                         std::to_string(i) + " differs from its output");
    fresh.push_back({a->untyped_data(), a->element_type(), a->size_bytes()});
  }
  OnGroupDevice on(kDone, g, out[0].data);
  if (on.error().failure()) return on.error();
  int status;
  if ((status = after_side(g, stream))) return failed(kDone, "wait for the side stream", status);
  if (algo == PMG_ALGO_GATHER) {
    std::vector<pmg_mean> list(out.size());
    const size_t esize = pmg_dtype_size(dtype);
    for (size_t i = 0; i < out.size(); ++i)
      list[i] = {nfresh ? static_cast<const float *>(fresh[i].data) : nullptr,
                 static_cast<float *>(out[i].data), at[i] / esize, out[i].nbytes / esize};
    status = pmg_mean_list(list.data(), int(list.size()),
                           static_cast<const float *>(g.peers.data[g.rank]),
                           static_cast<const float *>(g.shadow), gather_elems(g, total), g.rank,
                           g.nranks, stream);
    if (status) return failed(kDone, "average", status);
  } else if ((status = pmg_copy_list(copies(g, out, at, false).data(), int(out.size()), stream))) {
    return failed(kDone, "unpack", status);
  }
  return ffi::Error::Success();
}

}  // namespace

// Neither is marked command-buffer compatible: XLA runs them as thunks, at each execution,
// which the side stream's fork and join need (a captured graph would replay them without it).
#define PMG_AVERAGE_ATTRS                        \
  .Attr<int64_t>("group")                        \
      .Attr<int32_t>("algo")                     \
      .Attr<int32_t>("max_blocks")               \
      .Attr<int64_t>("chunk_bytes")              \
      .Attr<ffi::Span<const int64_t>>("offsets") \
      .Attr<int64_t>("total")

XLA_FFI_DEFINE_HANDLER_SYMBOL(pmg_xla_average, average,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets() PMG_AVERAGE_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(pmg_xla_average_start, average_start,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets() PMG_AVERAGE_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(pmg_xla_average_done, average_done,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("group")
                                  .Attr<int32_t>("algo")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<int64_t>("total"));

extern "C" void *pmg_xla_handler(const char *name) {
  const std::string n = name ? name : "";
  if (n == kAverage) return reinterpret_cast<void *>(pmg_xla_average);
  if (n == kStart) return reinterpret_cast<void *>(pmg_xla_average_start);
  if (n == kDone) return reinterpret_cast<void *>(pmg_xla_average_done);
  return nullptr;
}

#endif
