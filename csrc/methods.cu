// The one table of the all-reduce methods inside a node, and the one dispatch over every
// road an average takes: NCCL alone (method nccl), the node's kernels around NCCL (across
// nodes), or a method of the table (docs/DECISIONS.md, "Extension points").
#include "kernels.cuh"
#include "methods.h"

namespace {

const pmg_method kMethods[] = {
    // algo             name       launch              staged  copy engines  most bytes
    {PMG_ALGO_LL, "ll", pmg_launch_ll, 0, 0, PMG_LL_MAX_BYTES},
    {PMG_ALGO_ONESHOT, "oneshot", pmg_launch_oneshot, 0, 0, 0},
    {PMG_ALGO_TWOSHOT, "twoshot", pmg_launch_twoshot, 0, 0, 0},
    {PMG_ALGO_PUSH, "push", pmg_launch_push, 1, 0, 0},
    {PMG_ALGO_CE, "ce", pmg_launch_ce, 1, 1, 0},
};

}  // namespace

const pmg_method *pmg_find_method(int algo) {
  for (const pmg_method &m : kMethods)
    if (m.algo == algo) return &m;
  return nullptr;
}

extern "C" {

const char *pmg_method_name(int algo) {
  const pmg_method *m = pmg_find_method(algo);
  return m ? m->name : nullptr;
}

int pmg_allreduce_average(const pmg_peers *peers, size_t stage_offset, int rank, int nranks,
                          size_t n, int dtype, int algo, int max_blocks, uint64_t timeout_ns,
                          cudaStream_t stream, size_t chunk_bytes, cudaStream_t copy_stream,
                          cudaEvent_t event) {
  if (int err = check_ranks(rank, nranks)) return err;
  if (int err = check_peers(peers, nranks)) return err;
  const pmg_method *m = pmg_find_method(algo);
  const size_t esize = pmg_dtype_size(dtype);
  if (!esize) return PMG_ERR_UNSUPPORTED_DTYPE;
  if (!m || (m->max_bytes && n * esize > m->max_bytes)) return PMG_ERR_INVALID_ARGUMENT;
  if (m->staged && (stage_offset & 15)) return PMG_ERR_MISALIGNED;
  if (max_blocks < 1 || max_blocks > PMG_MAX_BLOCKS) return PMG_ERR_INVALID_ARGUMENT;
  return m->launch({peers, stage_offset, rank, nranks, n, dtype, max_blocks, timeout_ns, stream,
                    chunk_bytes, copy_stream, event});
}

int pmg_group_average(const pmg_group *g, size_t from, size_t n, int dtype, int algo,
                      int max_blocks, size_t chunk_bytes, cudaStream_t stream) {
  if (!g) return PMG_ERR_INVALID_ARGUMENT;
  // The arrays from byte `from` on; the staging area stays where it is, after the data.
  pmg_peers peers = g->peers;
  for (int r = 0; r < g->nranks; ++r) peers.data[r] = static_cast<char *>(peers.data[r]) + from;
  const size_t stage_offset = g->stage_offset - from;
  if (g->nccl_comm && g->nccl_flat)
    return pmg_nccl_allreduce(g->nccl_comm, peers.data[g->rank], peers.data[g->rank], n, dtype,
                              1, g->timeout_ns, stream);
  if (g->nccl_comm)
    return dtype != PMG_FLOAT32 ? int(PMG_ERR_UNSUPPORTED_DTYPE)
                                : pmg_node_average(&peers, g->rank, g->nranks, n, g->nccl_comm,
                                                   g->world, max_blocks, g->timeout_ns, stream);
  return pmg_allreduce_average(&peers, stage_offset, g->rank, g->nranks, n, dtype, algo,
                               max_blocks, g->timeout_ns, stream, chunk_bytes, g->copy_stream,
                               g->event);
}

}  // extern "C"
