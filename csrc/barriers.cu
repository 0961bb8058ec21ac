// The GPU-side barriers alone: a one-block kernel, or the stream's own memory operations
// (no SM held), for exchanges that move their bytes by copies.
#include <cuda.h>  // the driver's types only: its functions are looked up at run time

#include "kernels.cuh"

namespace {

__global__ void barrier_kernel(pmg_peers p, int rank, int nranks, uint64_t timeout_ns) {
  block_barrier(p, rank, nranks, timeout_ns);
}

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

extern "C" {

int pmg_device_barrier(const pmg_peers *peers, int rank, int nranks, uint64_t timeout_ns,
                       cudaStream_t stream) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (int err = check_peers(peers, nranks)) return err;
  barrier_kernel<<<1, 32, 0, stream>>>(*peers, rank, nranks, timeout_ns);
  return launched();
}

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

}  // extern "C"
