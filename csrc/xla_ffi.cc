// pympgu's average as XLA operations, so that a jitted JAX function can average a list of
// arrays with the other ranks in the middle of its own work: the pack, the all-reduce and
// the unpack are queued on XLA's stream by XLA's executor, with no DLPack export or import,
// no host wait and no Python on the way (pympgu/xla/ops.py).
//
// "pympgu_average" takes N arrays of one dtype and returns N arrays of the same shapes (the
// Python side aliases each output to its input), all on XLA's stream.
//
// The start/done pair lets XLA compute while the link works:
//   "pympgu_average_start" takes N arrays and returns a token. It queues the exchange on the
//   group's high-priority side stream and returns.
//   "pympgu_average_done" takes the token and the same N arrays and returns their averages.
//   It orders XLA's stream after the side stream, then writes its outputs, on XLA's stream
//   only: XLA may have given their memory to temporaries of the work between the two. Given
//   N more arrays (fresh), it returns fresh + (average - input) instead: the one-step-delayed
//   correction of an overlapped step, in the same pass (the gather algorithm only).
// With PMG_ALGO_GATHER (float32) the side stream does no arithmetic at all, and the done
// operation averages the arrays and the shadow in one pass (pmg_mean_list). The copy engines
// leave every SM to XLA, whose matrix products lose a whole wave to a kernel that takes even
// a few SMs. The side stream runs a barrier (every rank is done reading its shadow), DMA
// copies, and a barrier (every copy has landed). The copies go one of two ways:
//   - push, when the group's shadow lies in the shared block: each array goes from XLA's
//     memory straight into every peer's shadow (pmg_push_peers). Nothing is packed. A start
//     may then come in two parts (attribute "phase"), so that the arrays computed first
//     cross the link while XLA computes the rest (pympgu.xla.average_results). The second
//     part takes the first's token as its first operand: XLA would drop an operation whose
//     token nothing uses. Its done comes in two parts too: the first part's arrays are
//     averaged as soon as they have landed, while the last part crosses the link;
//   - pull, with a private shadow: the start packs the arrays into the group's buffer on
//     XLA's stream, and each rank copies the peers' buffers into its shadow.
// Other algorithms pack, run the all-reduce kernel on the side stream, and unpack in the done.
// Their start may come in two parts too: each part packs its arrays on the side stream and
// averages their stretch of the buffer there, and its done unpacks them, the first part's
// as soon as its kernel has ended (pympgu.xla.average_gradients above
// PYMPGU_SPLIT_MAX_RANKS ranks, whose update reads the mean gradients so unpacked).
// Python (pympgu.xla) places the work between them with optimization barriers.
//   "pympgu_average_wait" takes the token and any other operands, and returns one of them
//   (aliased, untouched): it only orders XLA's stream after the side stream. With it, XLA
//   reads the shared shadow itself (an argument of the jitted function; pympgu.xla.
//   correct_during's shadow=), and averages and corrects inside its own update of each
//   array, with no pass of pympgu's. The other operands are what that update needs (its
//   gradients): XLA runs an operation once its operands exist, so the wait then stalls
//   XLA's stream no earlier than the update would. The one returned is one the update
//   reads, so that XLA keeps the wait. After a start in two parts, a wait may take the
//   first part only (attribute "part", as a done's), so that XLA's update of those arrays
//   reads the peers' values while the last part crosses (pympgu.xla.average_gradients,
//   whose update reads the peers' gradients there).
// Every operation that packs first orders XLA's stream after any exchange still on the side
// stream, so nothing packs into the buffer while it is being averaged.
//
// Attributes, fixed when the function is traced (the done operation takes group, algo,
// offsets and total):
//   group       id of a registered PeerGroup (pmg_xla_register);
//   algo        a pmg_algo code, resolved from 'auto' by the Python side;
//   max_blocks  the kernel's grid cap;
//   chunk_bytes the DMA chunk of PMG_ALGO_CE;
//   offsets     element offset of each array in the group's buffer (every rank the same);
//   total       elements averaged from the buffer's start: at least the last array's end, and
//               what an Exchanger's own path averages, so the two paths can take turns;
//   phase       (start only) kFirst, kLast or both (below);
//   part        (done only) the whole exchange, or the first or last part's arrays (below).
//
// The registry is built without XLA too; only the handler needs jaxlib's headers.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <initializer_list>
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

ffi::Error collect(ffi::RemainingArgs args, size_t from, size_t count, std::vector<Array> *out) {
  for (size_t i = from; i < from + count; ++i) {
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

// The all-reduce of n elements of every rank's buffer from byte `from` on (16-byte aligned):
// the kernels see each buffer from there, and the staging area where it is.
int allreduce(const pmg_group &g, int algo, int max_blocks, int64_t chunk_bytes, size_t n,
              int dtype, cudaStream_t stream, size_t from = 0) {
  return pmg_group_average(&g, from, n, dtype, algo, max_blocks, size_t(chunk_bytes), stream);
}

// An all-reduce of the overlapped pair may still be running on the side stream: whatever
// touches the group's buffer on XLA's stream waits for it. A no-op when none was queued.
int after_side(const pmg_group &g, cudaStream_t stream) {
  return g.side_out ? pmg_stream_wait_event(stream, g.side_out) : 0;
}

// Records the timeline's points `which` (pmg_mark) on stream, when the group keeps a
// timeline (PeerGroup.xla_timeline); a no-op otherwise.
int mark(const pmg_group &g, std::initializer_list<int> which, cudaStream_t stream) {
  for (int w : which)
    if (g.marks[w])
      if (int status = pmg_event_record(g.marks[w], stream)) return status;
  return 0;
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
// Pushed (`pushed`: straight into the peers' shared shadow), it only moves bytes, and XLA's
// own arithmetic may read any float dtype there (pympgu.xla.average_gradients' half-precision
// wire); a done operation then never averages them.
ffi::Error gather_ready(const char *op, const pmg_group &g, int32_t algo, int dtype,
                        bool pushed = false) {
  if (algo == PMG_ALGO_GATHER && g.nccl_comm)
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": the gather algorithm works inside one node");
  if (algo != PMG_ALGO_GATHER || (pushed && g.shadow_offset) ||
      (dtype == PMG_FLOAT32 && (g.shadow || g.nranks == 1)))
    return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) +
                                     ": the gather algorithm needs float32 arrays and a shadow");
}

// Elements of esize bytes each shadow slot holds: total rounded up to 64 (within the
// buffer), so that the slots stay 16-byte aligned for pmg_mean_list's vector loads.
size_t gather_elems(const pmg_group &g, int64_t total, size_t esize = sizeof(float)) {
  const size_t rounded = (size_t(total) + 63) / 64 * 64;
  return std::min(rounded, g.nbytes / esize);
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
  if (auto e = collect(args, 0, args.size(), &in); e.failure()) return e;
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

// The phases of a start (its attribute "phase"): the barrier before it (every rank is done
// reading its shadow), the barrier after it (every rank's arrays have reached every shadow),
// or both. A start in two parts lets the arrays that are ready first cross the link while
// XLA computes the rest (pympgu.xla.average_results).
constexpr int32_t kFirst = 1, kLast = 2, kWhole = kFirst | kLast;

// A barrier of the group on stream: stream memory operations where the group counts them
// (pmg_stream_barrier: no SM held while a peer is awaited), else a one-block kernel.
int barrier(const pmg_group &g, cudaStream_t stream) {
  if (g.stream_sync)  // XLA runs a device's operations from one thread at a time
    return pmg_stream_barrier(g.stream_flags, g.rank, g.nranks, ++g.stream_sync->queued, stream);
  return pmg_device_barrier(&g.peers, g.rank, g.nranks, g.timeout_ns, stream);
}

// An error once the watchdog has found a stream barrier that a peer never reached: the
// stream was let go without that peer's data, so no exchange may follow.
ffi::Error peers_in_step(const char *op, const pmg_group &g) {
  if (!g.stream_sync) return ffi::Error::Success();
  const int late = __atomic_load_n(&g.stream_sync->late_rank_plus_one, __ATOMIC_ACQUIRE) - 1;
  if (late < 0) return ffi::Error::Success();
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g", double(g.timeout_ns) / 1e9);
  return ffi::Error::Internal(std::string(op) + ": rank " + std::to_string(g.rank) + " of " +
                              std::to_string(g.nranks) + " waited more than " + seconds +
                              " s at an exchange's barrier for rank " + std::to_string(late) +
                              ", which died or stopped exchanging");
}

// Before the last part's copies: a barrier proves that every rank's first part has landed,
// and side_first tells XLA's stream, whose done operation then averages those arrays while
// the last part crosses the link. It runs after XLA has reached the last part (side_in), so
// that it never spins on an SM beside XLA's kernels; the copies behind it on the side
// stream would have waited for the first part's anyway.
int first_landed(const pmg_group &g) {
  int status;
  if ((status = barrier(g, g.side)) ||
      (status = pmg_event_record(g.side_first, g.side)))
    return status;
  return mark(g, {PMG_MARK_FIRST_LANDED}, g.side);
}

ffi::Error average_start(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                         int64_t group, int32_t algo, int32_t max_blocks, int64_t chunk_bytes,
                         ffi::Span<const int64_t> offsets, int64_t total, int32_t phase) {
  pmg_group g;
  if (auto e = lookup_group(kStart, group, &g); e.failure()) return e;
  if (auto e = peers_in_step(kStart, g); e.failure()) return e;
  if (!g.side || !g.side_in || !g.side_out)
    return ffi::Error::InvalidArgument("pympgu_average_start: the group has no side stream");
  // Peers push into a shadow in the shared block; without one, each rank pulls the peers'
  // packed buffers, which needs every array packed at once.
  const bool push = algo == PMG_ALGO_GATHER && g.shadow_offset && g.nranks > 1;
  // A kernel's part averages its own arrays' stretch of the buffer (they lie together).
  const bool kernel_part = algo != PMG_ALGO_GATHER && phase != kWhole;
  if (phase < 1 || phase > kWhole || (phase != kWhole && !push && !kernel_part))
    return ffi::Error::InvalidArgument(
        "pympgu_average_start: phase must be 1, 2 or 3, and a start in parts needs a kernel, "
        "or the gather algorithm and a group with a shared shadow");
  // The last part's first operand is the first part's token: it only orders the two.
  const size_t skip = phase == kLast ? 1 : 0;
  if (args.size() <= skip) return ffi::Error::Success();
  std::vector<Array> in;
  std::vector<size_t> at;
  int dtype;
  if (auto e = collect(args, skip, args.size() - skip, &in); e.failure()) return e;
  if (auto e = place(kStart, g, in, offsets, total, &at, &dtype); e.failure()) return e;
  if (auto e = gather_ready(kStart, g, algo, dtype, push); e.failure()) return e;
  OnGroupDevice on(kStart, g, in[0].data);
  if (on.error().failure()) return on.error();
  int status;
  const bool first = phase & kFirst, last = phase & kLast;
  if ((first && (status = mark(g, {PMG_MARK_START}, stream))) ||
      (last && (status = mark(g, {PMG_MARK_LAST_START}, stream))))
    return failed(kStart, "mark the timeline", status);
  if (!push && !kernel_part) {
    if (auto e = pack(kStart, g, in, at, stream); e.failure()) return e;
  }
  if ((status = pmg_event_record(g.side_in, stream)) ||
      (status = pmg_stream_wait_event(g.side, g.side_in)))
    return failed(kStart, "order the side stream after XLA's", status);
  if (push) {
    // Straight from XLA's arrays: they stay alive and unchanged until the done operation,
    // which takes them as operands and runs after the side stream.
    std::vector<const void *> src;
    std::vector<size_t> nbytes;
    for (const Array &a : in) src.push_back(a.data), nbytes.push_back(a.nbytes);
    const size_t esize = pmg_dtype_size(dtype), slot_bytes = gather_elems(g, total, esize) * esize;
    // Before any copy into a peer's shadow, every rank must be done reading its own.
    if ((first && (status = barrier(g, g.side))) ||
        (first && (status = mark(g, {PMG_MARK_SIDE_BEGIN}, g.side))) ||
        (phase == kLast && (status = first_landed(g))) ||
        (status = pmg_push_peers(&g.peers, g.shadow_offset, slot_bytes, g.rank, g.nranks,
                                 src.data(), at.data(), nbytes.data(), int(in.size()),
                                 g.side)) ||
        (first && (status = mark(g, {PMG_MARK_FIRST_SENT}, g.side))) ||
        (last && (status = mark(g, {PMG_MARK_LAST_SENT}, g.side))) ||
        (last && (status = barrier(g, g.side))))
      return failed(kStart, "push", status);
  } else if (algo == PMG_ALGO_GATHER) {
    if ((status = barrier(g, g.side)) ||
        (status = mark(g, {PMG_MARK_SIDE_BEGIN}, g.side)) ||
        (status = pmg_gather_peers(&g.peers, g.rank, g.nranks, g.shadow, gather_elems(g, total),
                                   dtype, g.side)) ||
        (status = mark(g, {PMG_MARK_FIRST_SENT, PMG_MARK_LAST_SENT}, g.side)) ||
        (status = barrier(g, g.side)))
      return failed(kStart, "gather", status);
  } else if (kernel_part) {
    // Packed on the side stream, beside XLA's work: the arrays stay alive and unchanged
    // until the done operation, which takes them as operands and runs after it. The side
    // stream already follows whatever touched the buffer before (side_in), and the kernels
    // order every peer's use of it, as between two launched exchanges.
    const size_t from = at.front(), esize = pmg_dtype_size(dtype);
    const size_t n = (at.back() + in.back().nbytes - from) / esize;
    if ((first && (status = mark(g, {PMG_MARK_SIDE_BEGIN}, g.side))) ||
        (status = pmg_copy_list(copies(g, in, at, true).data(), int(in.size()), g.side)) ||
        (status = allreduce(g, algo, max_blocks, chunk_bytes, n, dtype, g.side, from)) ||
        (first && (status = mark(g, {PMG_MARK_FIRST_SENT, PMG_MARK_FIRST_LANDED}, g.side))) ||
        (first && (status = pmg_event_record(g.side_first, g.side))) ||
        (last && (status = mark(g, {PMG_MARK_LAST_SENT}, g.side))))
      return failed(kStart, "average a part", status);
  } else if ((status = mark(g, {PMG_MARK_SIDE_BEGIN}, g.side)) ||
             (status = allreduce(g, algo, max_blocks, chunk_bytes, size_t(total), dtype, g.side)) ||
             (status = mark(g, {PMG_MARK_FIRST_SENT, PMG_MARK_LAST_SENT}, g.side))) {
    return failed(kStart, "average", status);
  }
  // Whole, the exchange's first part lands with its last.
  const bool whole = phase == kWhole;
  if ((whole && (status = mark(g, {PMG_MARK_FIRST_LANDED}, g.side))) ||
      (whole && (status = pmg_event_record(g.side_first, g.side))) ||
      (last && (status = mark(g, {PMG_MARK_LANDED}, g.side))) ||
      (status = pmg_event_record(g.side_out, g.side)))
    return failed(kStart, "record the exchange's end", status);
  return ffi::Error::Success();
}

// What a done operation averages (its attribute "part"): the whole exchange, or, after a
// start in two parts, the first part's arrays (once they have landed, while the last part
// crosses the link) or the last part's (once everything has landed). Python orders the two
// dones of one exchange, first part first.
constexpr int32_t kDoneWhole = 0, kDoneFirst = 1, kDoneLast = 2;

ffi::Error average_done(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        int64_t group, int32_t algo, ffi::Span<const int64_t> offsets,
                        int64_t total, int32_t part) {
  pmg_group g;
  if (auto e = lookup_group(kDone, group, &g); e.failure()) return e;
  if (part < kDoneWhole || part > kDoneLast)
    return ffi::Error::InvalidArgument("pympgu_average_done: part must be 0, 1 or 2");
  if (rets.size() == 0) return ffi::Error::Success();
  // args: the token (it only orders this operation after its start), the arrays the start
  // took (this rank's own values), then fresh, if any.
  const size_t n = rets.size();
  if (args.size() != 1 + n && args.size() != 1 + 2 * n)
    return ffi::Error::InvalidArgument(
        "pympgu_average_done: takes the token, the averaged arrays and optionally one fresh "
        "array per output");
  const bool correct = args.size() == 1 + 2 * n;
  if (correct && algo != PMG_ALGO_GATHER)
    return ffi::Error::InvalidArgument(
        "pympgu_average_done: the fused correction needs the gather algorithm");
  std::vector<Array> out, own, fresh;
  std::vector<size_t> at;
  int dtype;
  if (auto e = collect(rets, n, &out); e.failure()) return e;
  if (auto e = place(kDone, g, out, offsets, total, &at, &dtype); e.failure()) return e;
  if (auto e = gather_ready(kDone, g, algo, dtype); e.failure()) return e;
  for (size_t i = 0; i < args.size() - 1; ++i) {
    auto a = args.get<ffi::AnyBuffer>(i + 1);
    if (a.has_error()) return a.error();
    if (a->element_type() != out[i % n].type || a->size_bytes() != out[i % n].nbytes)
      return ffi::Error::InvalidArgument("pympgu_average_done: operand " + std::to_string(i + 1) +
                                         " differs from its output");
    (i < n ? own : fresh).push_back({a->untyped_data(), a->element_type(), a->size_bytes()});
  }
  OnGroupDevice on(kDone, g, out[0].data);
  if (on.error().failure()) return on.error();
  int status;
  if (part != kDoneLast && (status = mark(g, {PMG_MARK_DONE}, stream)))
    return failed(kDone, "mark the timeline", status);
  if ((status = part == kDoneFirst ? pmg_stream_wait_event(stream, g.side_first)
                                   : after_side(g, stream)))
    return failed(kDone, "wait for the side stream", status);
  if (algo == PMG_ALGO_GATHER) {
    std::vector<pmg_mean> list(n);
    const size_t esize = pmg_dtype_size(dtype);
    for (size_t i = 0; i < n; ++i)
      list[i] = {correct ? static_cast<const float *>(fresh[i].data) : nullptr,
                 static_cast<const float *>(own[i].data), static_cast<float *>(out[i].data),
                 at[i] / esize, out[i].nbytes / esize};
    status = pmg_mean_list(list.data(), int(n), static_cast<const float *>(g.shadow),
                           gather_elems(g, total), g.rank, g.nranks, stream);
    if (status) return failed(kDone, "average", status);
  } else if ((status = pmg_copy_list(copies(g, out, at, false).data(), int(n), stream))) {
    return failed(kDone, "unpack", status);
  }
  if (part != kDoneFirst && (status = mark(g, {PMG_MARK_AVERAGED}, stream)))
    return failed(kDone, "mark the timeline", status);
  return ffi::Error::Success();
}

// Records DONE and AVERAGED where XLA's stream reaches it: from there XLA's own update
// reads the shadow. Its "part" is a done's: after a start in two parts, the first part's
// wait lets XLA read that part's arrays as soon as they have landed (DONE marks it), and the
// last part's waits for everything (AVERAGED marks it).
constexpr const char *kWait = "pympgu_average_wait";

ffi::Error average_wait(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        int64_t group, int32_t part) {
  pmg_group g;
  if (auto e = lookup_group(kWait, group, &g); e.failure()) return e;
  if (part < kDoneWhole || part > kDoneLast)
    return ffi::Error::InvalidArgument("pympgu_average_wait: part must be 0, 1 or 2");
  auto token = args.get<ffi::AnyBuffer>(0);
  if (token.has_error()) return token.error();
  OnGroupDevice on(kWait, g, token->untyped_data());
  if (on.error().failure()) return on.error();
  int status;
  if ((part != kDoneLast && (status = mark(g, {PMG_MARK_DONE}, stream))) ||
      (status = part == kDoneFirst ? pmg_stream_wait_event(stream, g.side_first)
                                   : after_side(g, stream)) ||
      (part != kDoneFirst && (status = mark(g, {PMG_MARK_AVERAGED}, stream))))
    return failed(kWait, "wait for the side stream", status);
  return ffi::Error::Success();
}

}  // namespace

// None is marked command-buffer compatible: XLA runs them as thunks, at each execution,
// which the side stream's fork and join need (a captured graph would replay them without it).
// Every operation takes XLA's stream, any number of operands and results, and attributes.
#define PMG_BIND \
  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().RemainingArgs().RemainingRets()
#define PMG_AVERAGE_ATTRS                        \
  .Attr<int64_t>("group")                        \
      .Attr<int32_t>("algo")                     \
      .Attr<int32_t>("max_blocks")               \
      .Attr<int64_t>("chunk_bytes")              \
      .Attr<ffi::Span<const int64_t>>("offsets") \
      .Attr<int64_t>("total")

XLA_FFI_DEFINE_HANDLER_SYMBOL(pmg_xla_average, average, PMG_BIND PMG_AVERAGE_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(pmg_xla_average_start, average_start,
                              PMG_BIND PMG_AVERAGE_ATTRS.Attr<int32_t>("phase"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pmg_xla_average_done, average_done,
                              PMG_BIND.Attr<int64_t>("group")
                                  .Attr<int32_t>("algo")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<int64_t>("total")
                                  .Attr<int32_t>("part"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pmg_xla_average_wait, average_wait,
                              PMG_BIND.Attr<int64_t>("group").Attr<int32_t>("part"));

extern "C" void *pmg_xla_handler(const char *name) {
  const std::string n = name ? name : "";
  if (n == kAverage) return reinterpret_cast<void *>(pmg_xla_average);
  if (n == kStart) return reinterpret_cast<void *>(pmg_xla_average_start);
  if (n == kDone) return reinterpret_cast<void *>(pmg_xla_average_done);
  if (n == kWait) return reinterpret_cast<void *>(pmg_xla_average_wait);
  return nullptr;
}

#endif
