// pympgu's average as an XLA operation ("pympgu_average"), so that a jitted JAX function can
// average a list of arrays with the other ranks in the middle of its own work: the pack,
// the all-reduce and the unpack are queued on XLA's stream by XLA's executor, with no
// DLPack export or import, no host wait and no Python on the way (pympgu/xla.py).
//
// The operation takes N arrays of one dtype and returns N arrays of the same shapes (the
// Python side aliases each output to its input). Attributes, fixed when the function is traced:
//   group       id of a registered PeerGroup (pmg_xla_register);
//   algo        a pmg_algo code, resolved from 'auto' by the Python side;
//   max_blocks  the kernel's grid cap;
//   chunk_bytes the DMA chunk of PMG_ALGO_CE;
//   offsets     element offset of each array in the group's buffer (every rank the same);
//   total       elements averaged from the buffer's start: at least the last array's end, and
//               what an Exchanger's own path averages, so the two paths can take turns.
//
// The registry is built without XLA too; only the handler needs jaxlib's headers.
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
  *id = next_id++;
  registry[*id] = *group;
  return 0;
}

extern "C" int pmg_xla_unregister(int64_t id) {
  std::lock_guard<std::mutex> hold(registry_lock);
  return registry.erase(id) ? 0 : PMG_ERR_INVALID_ARGUMENT;
}

#ifndef PMG_WITH_XLA_FFI

extern "C" void *pmg_xla_handler(void) { return nullptr; }

#else

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// XLA reports the message as the exception's text: keep CUDA's own name and words in it.
ffi::Error failed(const char *what, int status) {
  return ffi::Error::Internal(std::string("pympgu_average: ") + what + ": " +
                              pmg_error_name(status) + ": " + pmg_error_string(status));
}

int dtype_code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return PMG_FLOAT32;
    case ffi::DataType::F16: return PMG_FLOAT16;
    case ffi::DataType::BF16: return PMG_BFLOAT16;
    default: return -1;
  }
}

ffi::Error average(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   int64_t group, int32_t algo, int32_t max_blocks, int64_t chunk_bytes,
                   ffi::Span<const int64_t> offsets, int64_t total) {
  pmg_group g;
  if (!lookup(group, &g))
    return ffi::Error::InvalidArgument(
        "pympgu_average: PeerGroup " + std::to_string(group) +
        " is closed: a function traced with it must not run after its Exchanger or PeerGroup "
        "is closed");
  const size_t count = args.size();
  if (rets.size() != count || offsets.size() != count)
    return ffi::Error::InvalidArgument("pympgu_average: needs as many outputs and offsets as inputs");
  if (count == 0) return ffi::Error::Success();
  std::vector<pmg_copy> in(count), out(count);
  char *mine = static_cast<char *>(g.peers.data[g.rank]);
  int dtype = -1;
  size_t end = 0;
  for (size_t i = 0; i < count; ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (r.has_error()) return r.error();
    const int code = dtype_code(a->element_type());
    if (code < 0 || (i && code != dtype))
      return ffi::Error::InvalidArgument(
          "pympgu_average: arrays must all be float32, all float16 or all bfloat16");
    dtype = code;
    const size_t esize = pmg_dtype_size(code);
    const size_t nbytes = a->size_bytes();
    const size_t at = size_t(offsets[i]) * esize;
    if (offsets[i] < 0 || at < end || (at & 15) || at + nbytes > g.nbytes)
      return ffi::Error::InvalidArgument(
          "pympgu_average: array " + std::to_string(i) + " does not fit the group's " +
          std::to_string(g.nbytes) + "-byte buffer at its offset");
    end = at + nbytes;
    in[i] = {a->untyped_data(), mine + at, nbytes};
    out[i] = {mine + at, (*r)->untyped_data(), nbytes};
  }
  const size_t n = size_t(total);
  if (total < 0 || n * pmg_dtype_size(dtype) < end || n * pmg_dtype_size(dtype) > g.nbytes)
    return ffi::Error::InvalidArgument("pympgu_average: total " + std::to_string(total) +
                                       " does not cover the arrays or overruns the buffer");
  // XLA's thread has its own current device; the kernels must launch on the group's.
  int before = -1, status;
  if ((status = pmg_get_device(&before))) return failed("cudaGetDevice", status);
  if (before != g.device && (status = pmg_set_device(g.device)))
    return failed("cudaSetDevice", status);
  int where = -1;
  if ((status = pmg_pointer_device(in[0].src, &where))) {
    if (before != g.device) pmg_set_device(before);
    return failed("cudaPointerGetAttributes", status);
  }
  if (where != g.device) {
    if (before != g.device) pmg_set_device(before);
    return ffi::Error::InvalidArgument(
        "pympgu_average: the arrays are on GPU " + std::to_string(where) + ", rank " +
        std::to_string(g.rank) + "'s PeerGroup on GPU " + std::to_string(g.device));
  }
  const char *step = "pack";
  status = pmg_copy_list(in.data(), int(count), stream);
  if (!status) {
    step = "average";
    status = algo == PMG_ALGO_CE
                 ? pmg_ce_allreduce_average(&g.peers, g.stage_offset, g.rank, g.nranks, n, dtype,
                                            size_t(chunk_bytes), max_blocks, g.timeout_ns, stream,
                                            g.copy_stream, g.event)
                 : pmg_allreduce_average(&g.peers, g.stage_offset, g.rank, g.nranks, n, dtype,
                                         algo, max_blocks, g.timeout_ns, stream);
  }
  if (!status) {
    step = "unpack";
    status = pmg_copy_list(out.data(), int(count), stream);
  }
  if (before != g.device) pmg_set_device(before);
  if (status) return failed(step, status);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(pmg_xla_average, average,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("group")
                                  .Attr<int32_t>("algo")
                                  .Attr<int32_t>("max_blocks")
                                  .Attr<int64_t>("chunk_bytes")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<int64_t>("total"));

extern "C" void *pmg_xla_handler(void) { return reinterpret_cast<void *>(pmg_xla_average); }

#endif
