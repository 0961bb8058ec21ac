// NCCL, loaded at run time: pympgu builds and imports without it, and uses the library that
// the process already has (JAX's CUDA plugin brings the nvidia-nccl wheel) or the system's.
// Only the calls below are declared, from NCCL's stable C ABI; the communicator's config is
// the 2.14 prefix of ncclConfig_t, which later versions read by its size and version fields
// (the fields after it keep NCCL's defaults).
#include <dlfcn.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <thread>

#include "pympgu.h"

namespace {

typedef int nccl_result;  // ncclResult_t
typedef void *nccl_comm;  // ncclComm_t
typedef void *nccl_stream;  // cudaStream_t

constexpr int kInProgress = 7;  // ncclInProgress
constexpr int kFloat32 = 7, kFloat16 = 6, kBfloat16 = 9;  // ncclFloat32, ncclFloat16, ncclBfloat16
constexpr int kSum = 0, kAvg = 4;  // ncclSum, ncclAvg

struct nccl_config {  // ncclConfig_t as of NCCL 2.14: NCCL copies `size` bytes of it
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cga_cluster_size;
  int min_ctas;
  int max_ctas;
  const char *net_name;
};

struct Api {
  void *handle = nullptr;
  nccl_result (*get_version)(int *);
  nccl_result (*get_unique_id)(void *);
  nccl_result (*init_rank_config)(nccl_comm *, int, pmg_nccl_id, int, nccl_config *);
  nccl_result (*get_async_error)(nccl_comm, nccl_result *);
  nccl_result (*abort)(nccl_comm);
  nccl_result (*finalize)(nccl_comm);
  nccl_result (*destroy)(nccl_comm);
  nccl_result (*all_reduce)(const void *, void *, size_t, int, int, nccl_comm, nccl_stream);
  const char *(*error_string)(nccl_result);
  const char *(*last_error)(nccl_comm);
};

Api api;

int status(nccl_result r) { return r == 0 ? 0 : PMG_ERR_NCCL + r; }

template <typename F>
bool find(void *handle, const char *name, F *fn, char *why, size_t len) {
  *fn = reinterpret_cast<F>(dlsym(handle, name));
  if (*fn == nullptr) std::snprintf(why, len, "it has no %s", name);
  return *fn != nullptr;
}

int dtype_of(int dtype) {
  switch (dtype) {
    case PMG_FLOAT32: return kFloat32;
    case PMG_FLOAT16: return kFloat16;
    case PMG_BFLOAT16: return kBfloat16;
    default: return -1;
  }
}

}  // namespace

extern "C" {

int pmg_nccl_load(const char *path, char *why, size_t len) {
  if (api.handle != nullptr) return 0;
  if (path == nullptr || why == nullptr || len == 0) return PMG_ERR_INVALID_ARGUMENT;
  why[0] = '\0';
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char *e = dlerror();
    std::snprintf(why, len, "%s", e ? e : "dlopen failed");
    return PMG_ERR_NCCL_MISSING;
  }
  Api a;
  a.handle = h;
  // Non-blocking communicators, ncclCommGetAsyncError, ncclCommAbort and ncclCommFinalize
  // together: NCCL 2.14 or later (docs/DECISIONS.md, "NCCL between nodes").
  bool ok = find(h, "ncclGetVersion", &a.get_version, why, len) &&
            find(h, "ncclGetUniqueId", &a.get_unique_id, why, len) &&
            find(h, "ncclCommInitRankConfig", &a.init_rank_config, why, len) &&
            find(h, "ncclCommGetAsyncError", &a.get_async_error, why, len) &&
            find(h, "ncclCommAbort", &a.abort, why, len) &&
            find(h, "ncclCommFinalize", &a.finalize, why, len) &&
            find(h, "ncclCommDestroy", &a.destroy, why, len) &&
            find(h, "ncclAllReduce", &a.all_reduce, why, len) &&
            find(h, "ncclGetErrorString", &a.error_string, why, len) &&
            find(h, "ncclGetLastError", &a.last_error, why, len);
  int v = 0;
  if (ok && (a.get_version(&v) != 0 || v < PMG_NCCL_MIN_VERSION)) {
    std::snprintf(why, len, "it is version %d, and pympgu needs %d or later", v,
                  PMG_NCCL_MIN_VERSION);
    ok = false;
  }
  if (!ok) {
    dlclose(h);
    return PMG_ERR_NCCL_MISSING;
  }
  api = a;
  return 0;
}

int pmg_nccl_loaded(void) { return api.handle != nullptr; }

int pmg_nccl_version(int *version) {
  if (api.handle == nullptr) return PMG_ERR_NCCL_MISSING;
  if (version == nullptr) return PMG_ERR_INVALID_ARGUMENT;
  return status(api.get_version(version));
}

int pmg_nccl_unique_id(pmg_nccl_id *id) {
  if (api.handle == nullptr) return PMG_ERR_NCCL_MISSING;
  if (id == nullptr) return PMG_ERR_INVALID_ARGUMENT;
  return status(api.get_unique_id(id));
}

int pmg_nccl_init(void **comm, int nranks, int rank, const pmg_nccl_id *id) {
  if (api.handle == nullptr) return PMG_ERR_NCCL_MISSING;
  if (comm == nullptr || id == nullptr || nranks < 1 || rank < 0 || rank >= nranks)
    return PMG_ERR_INVALID_ARGUMENT;
  // Non-blocking: a peer that never comes cannot hang this process; the caller polls
  // pmg_nccl_state against its own deadline and aborts.
  nccl_config c = {sizeof(nccl_config), 0xcafebeef, PMG_NCCL_MIN_VERSION, 0, INT_MIN,
                   INT_MIN, INT_MIN, nullptr};
  *comm = nullptr;
  nccl_result r = api.init_rank_config(comm, nranks, *id, rank, &c);
  return r == kInProgress ? 0 : status(r);
}

int pmg_nccl_state(void *comm) {
  if (api.handle == nullptr) return PMG_ERR_NCCL_MISSING;
  if (comm == nullptr) return PMG_ERR_INVALID_ARGUMENT;
  nccl_result async = 0;
  nccl_result r = api.get_async_error(comm, &async);
  return status(r != 0 ? r : async);
}

int pmg_nccl_allreduce(void *comm, const void *send, void *recv, size_t count, int dtype,
                       int average, uint64_t timeout_ns, void *stream) {
  if (api.handle == nullptr) return PMG_ERR_NCCL_MISSING;
  int t = dtype_of(dtype);
  if (t < 0) return PMG_ERR_UNSUPPORTED_DTYPE;
  if (comm == nullptr || (count > 0 && (send == nullptr || recv == nullptr)))
    return PMG_ERR_INVALID_ARGUMENT;
  int s = status(api.all_reduce(send, recv, count, t, average ? kAvg : kSum, comm, stream));
  // A non-blocking communicator may still be queueing the call: what follows on the stream
  // must be queued after it.
  const auto start = std::chrono::steady_clock::now();
  while (s == PMG_ERR_NCCL + kInProgress) {
    if (uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - start).count()) > timeout_ns)
      return PMG_ERR_TIMEOUT;
    std::this_thread::yield();
    s = pmg_nccl_state(comm);
  }
  return s;
}

int pmg_nccl_finalize(void *comm) {
  if (api.handle == nullptr) return PMG_ERR_NCCL_MISSING;
  if (comm == nullptr) return PMG_ERR_INVALID_ARGUMENT;
  nccl_result r = api.finalize(comm);
  return r == kInProgress ? 0 : status(r);
}

int pmg_nccl_destroy(void *comm) {
  if (api.handle == nullptr) return PMG_ERR_NCCL_MISSING;
  return comm == nullptr ? 0 : status(api.destroy(comm));
}

int pmg_nccl_abort(void *comm) {
  if (api.handle == nullptr) return PMG_ERR_NCCL_MISSING;
  return comm == nullptr ? 0 : status(api.abort(comm));
}

const char *pmg_nccl_last_error(void *comm) {
  if (api.handle == nullptr) return "";
  const char *s = api.last_error(comm);
  return s ? s : "";
}

const char *pmg_nccl_status_name(int s) {
  static const char *names[] = {"ncclSuccess",       "ncclUnhandledCudaError",
                                "ncclSystemError",   "ncclInternalError",
                                "ncclInvalidArgument", "ncclInvalidUsage",
                                "ncclRemoteError",   "ncclInProgress",
                                "ncclTimeout"};
  if (s == PMG_ERR_NCCL_MISSING) return "pmgErrorNcclMissing";
  if (s < PMG_ERR_NCCL || s >= PMG_ERR_NCCL + 100) return nullptr;
  int r = s - PMG_ERR_NCCL;
  return r < int(sizeof(names) / sizeof(names[0])) ? names[r] : "ncclUnknownError";
}

const char *pmg_nccl_status_string(int s) {
  if (s == PMG_ERR_NCCL_MISSING) return "NCCL is not loaded (pympgu.cuda.nccl_load says why)";
  if (s < PMG_ERR_NCCL || s >= PMG_ERR_NCCL + 100) return nullptr;
  if (api.handle != nullptr) return api.error_string(s - PMG_ERR_NCCL);
  return "NCCL error";
}

}  // extern "C"
