// Two-shot with the copy engines, for large buffers: every byte crosses the link by DMA, in
// chunks that halve towards the end, a chunk's average beside the next one's copies.
#include "kernels.cuh"
#include "methods.h"

extern "C" {

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

}  // extern "C"

namespace {

// One exchange's copies by the copy engines: chunk bounds, and where a rank's slice and its
// peers' staging slots lie.
struct CeCopies {
  const pmg_call &call;
  const size_t esize, slice, lo, hi;
  const size_t *bounds;

  char *data(int r, size_t elem) const {
    return static_cast<char *>(call.peers->data[r]) + elem * esize;
  }
  char *stage(int dst, int src, size_t elem) const {
    return data(dst, 0) + call.stage_offset + (staged_slot(src, dst) * slice + elem) * esize;
  }
  // Chunk c of every peer's slice of our replica, into that peer's staging slot for us.
  cudaError_t push(int c) const {
    const size_t at = bounds[c], len = bounds[c + 1] - at;
    for (int j = 1; j < call.nranks; ++j) {
      const int dst = (call.rank + j) % call.nranks;  // rotated: ranks do not all hit rank 0
      const size_t m = clipped(dst * slice + at, len, min(call.n, (dst + 1) * slice));
      if (!m) continue;
      if (cudaError_t e = cudaMemcpyAsync(stage(dst, call.rank, at),
                                          data(call.rank, dst * slice + at), m * esize,
                                          cudaMemcpyDefault, call.copy_stream))
        return e;
    }
    return cudaSuccess;
  }
  // Chunk c of our slice, averaged, from our replica into every peer's.
  cudaError_t write_back(int c) const {
    const size_t at = bounds[c], m = clipped(lo + at, bounds[c + 1] - at, hi);
    for (int j = 1; j < call.nranks && m; ++j) {
      const int dst = (call.rank + j) % call.nranks;
      if (cudaError_t e = cudaMemcpyAsync(data(dst, lo + at), data(call.rank, lo + at),
                                          m * esize, cudaMemcpyDefault, call.copy_stream))
        return e;
    }
    return cudaSuccess;
  }
  // Chunk c of our slice averaged on the compute stream, from our replica and the staging
  // slots every peer pushed into.
  int average(int c) const {
    pmg_tensor d = {};
    const size_t at = bounds[c];
    d.n = clipped(lo + at, bounds[c + 1] - at, hi);
    if (!d.n) return 0;
    for (int r = 0; r < call.nranks; ++r)
      d.inputs[r] = r == call.rank ? data(call.rank, lo + at) : stage(call.rank, r, at);
    d.out = data(call.rank, lo + at);
    return pmg_launch_local_average(d, call.nranks, call.dtype, call.max_blocks, call.stream);
  }
};

}  // namespace

int pmg_launch_ce(const pmg_call &call) {
  const size_t esize = pmg_dtype_size(call.dtype);
  if (!esize) return PMG_ERR_UNSUPPORTED_DTYPE;
  if ((call.stage_offset & 15) || call.chunk_bytes < 16 || call.max_blocks < 1)
    return PMG_ERR_INVALID_ARGUMENT;
  if (call.nranks == 1 || call.n == 0) return 0;
  if (!call.copy_stream || !call.event) return PMG_ERR_INVALID_ARGUMENT;
  cudaStream_t stream = call.stream, copy_stream = call.copy_stream;
  cudaEvent_t event = call.event;
  // Every rank cuts the same chunks (the schedule depends on n, not on the rank), so every
  // rank crosses the same sequence of barriers.
  size_t bounds[PMG_CE_MAX_CHUNKS + 1];
  int nchunks = 0;
  if (int err = pmg_ce_chunks(call.nranks, call.n, call.dtype, call.chunk_bytes, bounds, &nchunks))
    return err;
  const size_t slice = bounds[nchunks], lo = size_t(call.rank) * slice;
  const CeCopies copies{call, esize, slice, lo, min(call.n, lo + slice), bounds};
  cudaError_t err;
  // Every byte crosses the link by DMA, the pushes and the write-backs alike: the copy
  // engines carry more than SM stores, alone or beside them (docs/DECISIONS.md, "Copy
  // engines for large buffers"). On copy_stream: push 0, push 1, write-back 0, push 2,
  // write-back 1, ...: push c + 1 crosses while chunk c's barrier and average run, so the
  // copy engines never wait for the SMs as long as that push outlasts them. The chunks halve
  // towards the end (pmg_ce_chunks): an average reads and writes HBM several times faster
  // than the link carries, so push c + 1 outlasts chunk c's average at half its size; few
  // chunks mean few copies (each costs the copy engines a few µs), and a small last chunk
  // leaves little average that nothing hides. On stream, chunk c's barrier waits for our
  // push c (and write-back c - 1) and returns once every rank's has landed. The one event
  // is recorded and waited for in turn; a wait takes the record made last before it.
  if ((err = cudaEventRecord(event, stream)) || (err = cudaStreamWaitEvent(copy_stream, event, 0)))
    return err;
  for (int c = 0; c <= nchunks; ++c) {
    if (c < nchunks && (err = copies.push(c))) return err;
    // Chunk c - 1's average is done (the event's last record), so it may go out; peers
    // overwrite our replica's chunk c - 1 of their slices only after their barrier c - 1,
    // so after our push c - 1 has read it.
    if (c > 0 && ((err = cudaStreamWaitEvent(copy_stream, event, 0)) ||
                  (err = copies.write_back(c - 1))))
      return err;
    if ((err = cudaEventRecord(event, copy_stream)) || (err = cudaStreamWaitEvent(stream, event, 0)))
      return err;
    if (int status = pmg_device_barrier(call.peers, call.rank, call.nranks, call.timeout_ns, stream))
      return status;
    // The last barrier: every peer's write-backs into our replica have landed, and every
    // peer has averaged from its staging area, so the next exchange may push into it.
    if (c == nchunks) break;
    if (int status = copies.average(c)) return status;
    if ((err = cudaEventRecord(event, stream))) return err;
  }
  return 0;
}
