/* pympgu's C API: the CUDA runtime calls pympgu uses, the averaging kernels, and the
 * host (CPU) averaging that follows the same summation order.
 *
 * Conventions, stated once:
 *  - Every function returns an int status: 0 on success, a cudaError_t value for a CUDA
 *    failure, or one of the PMG_ERR_* codes below (all >= 10000) for a bad argument.
 *    pmg_error_name / pmg_error_string turn any status into text.
 *  - Nothing here prints, aborts or exits: the caller decides what a failure means.
 *  - Results come back through out-pointers; pointers are plain device (UVA) addresses.
 *  - Averages are summed in rank order 0..R-1 in fp32 and divided by R (IEEE division),
 *    so every rank, and the host implementation, produce the same bits.
 */
#ifndef PYMPGU_H
#define PYMPGU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PMG_MAX_RANKS 8
#define PMG_MAX_HOST_THREADS 64 /* pmg_host_set_threads */
#define PMG_MAX_BLOCKS 512
#define PMG_IPC_HANDLE_BYTES 64

enum pmg_dtype { PMG_FLOAT32 = 0, PMG_FLOAT16 = 1, PMG_BFLOAT16 = 2 };

/* The all-reduce methods inside a node, each a file of csrc/ and an entry of the table in
 * csrc/methods.cu, which pmg_allreduce_average runs (pympgu/methods.py holds what each can
 * do). PMG_ALGO_GATHER is no method of that table: it exists only in the XLA start/done pair
 * (csrc/xla_ffi.cc), where every rank's arrays reach every other rank's shadow by DMA beside
 * XLA's work, and pmg_mean_list averages. */
enum pmg_algo {
  PMG_ALGO_ONESHOT = 0,
  PMG_ALGO_TWOSHOT = 1,
  PMG_ALGO_PUSH = 2,
  PMG_ALGO_CE = 3,
  PMG_ALGO_GATHER = 4,
  /* For small buffers, whose exchange costs round trips rather than bytes (after NCCL's
   * protocol of that name): every rank stores its values into every peer's mailbox, each
   * 8 bytes beside two copies of the call's sequence number, then averages from its own
   * mailboxes as the numbers show the values have landed. One crossing of the link and no
   * barrier, where ONESHOT waits for four crossings in a row (a barrier, the loads' round
   * trip, another barrier). Buffers of up to PMG_LL_MAX_BYTES. */
  PMG_ALGO_LL = 5
};

/* The LL algorithm's limit: twice its bytes cross the link (the sequence numbers), so
 * beyond some size the other algorithms win (pympgu.cuda.ll_max_bytes says where). */
#define PMG_LL_MAX_BYTES (256 * 1024)

enum pmg_status {
  PMG_SUCCESS = 0,
  PMG_ERR_INVALID_ARGUMENT = 10001,
  PMG_ERR_UNSUPPORTED_DTYPE = 10002,
  PMG_ERR_BAD_RANK_COUNT = 10003,
  PMG_ERR_MISALIGNED = 10004,
  PMG_ERR_NO_CUDA = 10005,
  PMG_ERR_TIMEOUT = 10006,
  PMG_ERR_NOT_RUNNING = 10007,
  PMG_ERR_NCCL_MISSING = 10008,
  /* PMG_ERR_NCCL + r: NCCL's ncclResult_t r (csrc/nccl.cc) */
  PMG_ERR_NCCL = 20000
};

/* Peer-visible control block at the start of every registered (IPC-shared) allocation.
 * flags[b][r]: the last barrier value that rank r announced to this rank's block b.
 * counter[b]: this rank's own count of barriers crossed by block b (never written by peers).
 * ll_seq: the sequence number of this rank's last LL call, ll_arrived: its blocks that have
 * finished the current one, resident_command: see pmg_resident_start (all this rank's own).
 * The LL mailboxes follow the block, pmg_ll_bytes(nranks) of them, before the data. */
typedef struct pmg_signal {
  uint32_t flags[PMG_MAX_BLOCKS][PMG_MAX_RANKS];
  uint32_t counter[PMG_MAX_BLOCKS];
  uint32_t ll_seq, ll_arrived;
  uint64_t resident_command; /* the resident kernel's block 0 relays the host's command here */
} pmg_signal;

/* The R replicas as this process sees them: data[r] and signal[r] are local pointers for
 * r == rank and IPC/P2P mappings of the peers' allocations otherwise. Passed by value to
 * kernels (128 bytes). */
typedef struct pmg_peers {
  void *data[PMG_MAX_RANKS];
  pmg_signal *signal[PMG_MAX_RANKS];
} pmg_peers;

/* One entry of a multi-tensor table: out[i] = mean over r < nranks of inputs[r][i], i < n. */
typedef struct pmg_tensor {
  const void *inputs[PMG_MAX_RANKS];
  void *out;
  uint64_t n;
} pmg_tensor;

/* One entry of a copy list: nbytes from src to dst, both device (UVA) addresses. */
typedef struct pmg_copy {
  const void *src;
  void *dst;
  uint64_t nbytes;
} pmg_copy;

/* One entry of pmg_mean_list: n float32 values, this rank's at own and every peer's at
 * element `at` of its shadow slot; their mean over the ranks stored at out, or with fresh,
 * out = fresh + (mean - own). */
typedef struct pmg_mean {
  const float *fresh; /* NULL: store the mean itself */
  const float *own;   /* may alias out */
  float *out;         /* may alias fresh */
  uint64_t at;
  uint64_t n;
} pmg_mean;

/* ---- pympgu's own statuses (host-only: NULL for a code that is not PMG_*) ---- */
const char *pmg_status_name(int status);
const char *pmg_status_string(int status);
size_t pmg_dtype_size(int dtype); /* 0 for an unknown dtype */
/* Bytes of LL mailboxes that follow pmg_signal in every registered allocation of a group of
 * nranks: two slots (a call's and the next's) of one mailbox per sender, each a 16-byte line
 * per 8 bytes of data. */
size_t pmg_ll_bytes(int nranks);

/* ---- host averaging (csrc/host_average.cpp; builds without CUDA) ---- */
/* The mean of nranks inputs (summed in rank order in fp32, divided once) stored into each of
 * nouts outputs, which may be among the inputs. */
int pmg_host_average(const void *const *inputs, int nranks, void *const *outs, int nouts,
                     size_t n, int dtype);

/* The process's helper threads for the host copies and averages (csrc/host_threads.cpp):
 * n in all, the caller's included (1, the default: none). Made in the calling thread's CPU
 * set. */
int pmg_host_set_threads(int n);
int pmg_host_threads(void);
/* count copies of nbytes[i] bytes from srcs[i] to dsts[i], shared out among the threads. */
int pmg_host_copy(const void *const *srcs, void *const *dsts, const size_t *nbytes, int count);

/* A low-precision wire for fp32 parameters. Every rank keeps ref, the fp32 result of the
 * last exchange (identical on every rank). It sends wire[i] = round(x[i] - ref[i]) in
 * wire_dtype (float16 or bfloat16, round to nearest even), the replicas average the wire
 * buffers, and every rank then adds the averaged wire back: ref[i] += avg[i] in fp32. The
 * rounding error is relative to the change since the last exchange, not to the parameter,
 * and ref stays bit-identical across ranks. The device versions below match bit for bit. */
int pmg_host_delta(const float *x, const float *ref, void *wire, size_t n, int wire_dtype);
int pmg_host_accumulate(float *ref, const void *avg, size_t n, int wire_dtype);

/* ---- one node's CPU workers meeting in shared memory (csrc/host_barrier.cpp) ---- */
/* Bytes of a barrier's words, 64-byte aligned, zeroed before the first use. */
#define PMG_HOST_BARRIER_BYTES 1024
/* Arrive at the barrier as rank of nranks: 1 if this rank was the last (every rank is
 * released), else 0 and *generation is what pmg_host_barrier_wait waits to see change. */
int pmg_host_barrier_arrive(void *words, int nranks, int rank, uint32_t *generation);
/* Wait up to timeout_ns (after spins polls) for the barrier of generation to release:
 * 1 released, 0 not yet (arrive is not repeated: wait again with the same generation). */
int pmg_host_barrier_wait(void *words, uint32_t generation, int64_t timeout_ns, int spins);
/* How many barriers rank has arrived at. */
uint32_t pmg_host_barrier_arrivals(const void *words, int rank);

#ifdef PMG_WITH_CUDA
#include <cuda_runtime_api.h>
/* ---- runtime (csrc/runtime.cu) ---- */
/* Any status, CUDA's or pympgu's, as text. */
const char *pmg_error_name(int status);
const char *pmg_error_string(int status);
/* Clears CUDA's last (non-sticky) error, so that one failure is not reported twice. */
void pmg_clear_last_error(void);
int pmg_runtime_version(int *version);
int pmg_driver_version(int *version);
int pmg_get_device_count(int *count);
int pmg_get_device(int *device);
int pmg_set_device(int device);
int pmg_device_name(int device, char *name, size_t len);
int pmg_device_sm_count(int device, int *count);
int pmg_device_synchronize(void);
int pmg_pointer_device(const void *ptr, int *device); /* the GPU that holds ptr; -1 if host */
int pmg_can_access_peer(int device, int peer, int *can);
int pmg_enable_peer_access(int peer); /* already enabled counts as success */
int pmg_malloc(void **ptr, size_t nbytes);
int pmg_free(void *ptr);
int pmg_host_alloc(void **ptr, size_t nbytes); /* page-locked, for truly async uploads */
int pmg_host_free(void *ptr);
/* Page-lock nbytes at ptr (page-aligned) and map them for every device; *device_ptr is where
 * the current device sees them. pmg_host_unregister undoes it. */
int pmg_host_register(void *ptr, size_t nbytes, void **device_ptr);
int pmg_host_unregister(void *ptr);
int pmg_memset_async(void *ptr, int value, size_t nbytes, cudaStream_t stream);
int pmg_memcpy_async(void *dst, const void *src, size_t nbytes, cudaStream_t stream);
int pmg_memcpy_peer_async(void *dst, int dst_device, const void *src, int src_device,
                          size_t nbytes, cudaStream_t stream);
int pmg_ipc_get_handle(void *base, void *handle /* 64 bytes */);
int pmg_ipc_open_handle(const void *handle, void **ptr);
int pmg_ipc_close_handle(void *ptr);
/* high_priority: the device's highest stream priority, so that the blocks of a kernel queued
 * there are scheduled before those of kernels already waiting on other streams. */
int pmg_stream_create(cudaStream_t *stream, int high_priority);
int pmg_stream_destroy(cudaStream_t stream);
int pmg_stream_synchronize(cudaStream_t stream);
int pmg_event_create(cudaEvent_t *event, int timing);
int pmg_event_destroy(cudaEvent_t event);
int pmg_event_record(cudaEvent_t event, cudaStream_t stream);
int pmg_event_synchronize(cudaEvent_t event);
/* stream's later work waits for event's last record (none yet: no wait). */
int pmg_stream_wait_event(cudaStream_t stream, cudaEvent_t event);
int pmg_event_elapsed_ms(cudaEvent_t start, cudaEvent_t end, float *ms);
/* Make consumer's later work wait for everything queued on producer so far, without
 * blocking the host: the DLPack stream handshake. */
int pmg_stream_wait(cudaStream_t consumer, cudaStream_t producer);

/* ---- kernels (csrc: local.cu, methods.cu and a file a method, node.cu, barriers.cu,
 * copy.cu) ---- */
/* out = mean of inputs[0..nranks-1], one launch, no barrier: for replicas that one process
 * can address (one GPU, or P2P between GPUs of one process). out may alias an input. */
int pmg_average(const void *const *inputs, int nranks, void *out, size_t n, int dtype,
                cudaStream_t stream);
/* Many tensors in one launch. table points to ntensors entries in DEVICE memory; max_n is
 * the largest entry's n (it sizes the grid). nranks == 1 makes this a multi-tensor copy,
 * which is how the exchanger packs parameters into its buffer. */
int pmg_multi_average(const pmg_tensor *table, int ntensors, int nranks, uint64_t max_n,
                      int dtype, cudaStream_t stream);
/* pmg_host_delta over a table in one launch: entry t has inputs[0] = fp32 x, inputs[1] =
 * fp32 ref, out = the wire slot (wire_dtype); max_n sizes the grid. */
int pmg_multi_delta(const pmg_tensor *table, int ntensors, uint64_t max_n, int wire_dtype,
                    cudaStream_t stream);
/* Many device-to-device copies, one launch per 32 entries. The list is in HOST memory and
 * travels as kernel parameters: nothing is uploaded, so a caller that cannot wait (XLA's
 * executor thread) can pack and unpack a list of tensors without a staging table. */
int pmg_copy_list(const pmg_copy *list, int count, cudaStream_t stream);
/* pmg_host_accumulate on the device: ref[i] += avg[i] (avg in wire_dtype), i < n. */
int pmg_accumulate(float *ref, const void *avg, size_t n, int wire_dtype, cudaStream_t stream);
/* All-reduce-average, in place in peers->data[*], by the method algo (csrc/methods.cu holds
 * their table): every rank calls it with the same n, dtype, algo, max_blocks and
 * chunk_bytes. The kernels' GPU-side barriers go through the signal blocks (or LL's
 * mailboxes); timeout_ns bounds each barrier wait, past which the kernel traps (a peer never
 * arrived). The staged methods (PUSH, CE) need every rank's staging area at stage_offset
 * bytes after its data (see pmg_stage_bytes); CE also copy_stream and event (a scratch event
 * on the streams' device) and chunk_bytes (pmg_ce_chunks); the others ignore them. */
int pmg_allreduce_average(const pmg_peers *peers, size_t stage_offset, int rank, int nranks,
                          size_t n, int dtype, int algo, int max_blocks, uint64_t timeout_ns,
                          cudaStream_t stream, size_t chunk_bytes, cudaStream_t copy_stream,
                          cudaEvent_t event);
/* The name of method algo as pympgu/methods.py knows it, or NULL for no method. */
const char *pmg_method_name(int algo);
/* The average across nodes, float32 (docs/DECISIONS.md, "NCCL between nodes"): this node's
 * nranks replicas are summed into rank k's slice of its own replica (rank order), nccl_comm
 * (one communicator of every node's local rank k) sums that slice across the nodes, and
 * rank k stores it divided by world into every replica of the node. Every rank of every node
 * ends with the same bits. Returns once all three are queued on stream. */
int pmg_node_average(const pmg_peers *peers, int rank, int nranks, size_t n, void *nccl_comm,
                     int world, int max_blocks, uint64_t timeout_ns, cudaStream_t stream);
/* Bytes of the staging area that PMG_ALGO_PUSH and pmg_ce_allreduce_average need on every
 * rank for buffers of up to nbytes: one slot per peer, each a 1/nranks slice of the buffer
 * rounded up to 16 bytes. */
size_t pmg_stage_bytes(int nranks, size_t nbytes);
/* The most chunks pmg_ce_chunks cuts a slice into. */
#define PMG_CE_MAX_CHUNKS 64
/* The chunks of a rank's slice (of n elements of dtype over nranks ranks) that
 * pmg_ce_allreduce_average pipelines: the last two hold chunk_bytes each (rounded down to
 * whole 16-byte vectors, at least one), each chunk before them twice the one after it, but
 * the first, which takes what is left (up to one chunk_bytes more than its size). Writes
 * *count chunks' bounds, in elements from the slice's start, first to last, into
 * bounds[0..*count] (bounds[*count] is the slice's length); bounds holds
 * PMG_CE_MAX_CHUNKS + 1 entries. Host code only. */
int pmg_ce_chunks(int nranks, size_t n, int dtype, size_t chunk_bytes, size_t *bounds,
                  int *count);
/* PMG_ALGO_CE, two-shot with the copy engines, for large buffers: on NVLink, DMA carries
 * more bytes than SM loads or stores (docs/DECISIONS.md, "Copy engines for large buffers").
 * Each rank's slice is cut into the chunks of pmg_ce_chunks; per chunk, every rank copies
 * the other ranks' slices of its replica into their staging slots by DMA (on copy_stream);
 * after a GPU barrier a kernel on stream averages its own slice from its replica and its
 * staging area (rank order, as every kernel here) into its replica, and the copy engines
 * then copy that mean into every peer's replica. Chunk c + 1's push crosses the link while
 * chunk c is averaged, so no byte crosses by SM. The result is bit-identical to the
 * kernels'. */
/* The mean of every rank's float32 values for each entry: this rank's at the entry's own,
 * peer r's at shadow + slot(r) * slot_elems + at, where slot(r) counts the ranks other than
 * this one before r (pmg_gather_peers's layout). Summed in rank order, then divided by
 * nranks, as every kernel here; with an entry's fresh, out = fresh + (mean - own) (the
 * one-step-delayed correction of an overlapped exchange) in the same pass. */
int pmg_mean_list(const pmg_mean *list, int count, const float *shadow, size_t slot_elems,
                  int rank, int nranks, cudaStream_t stream);
/* The other half of the shadow's protocol, by stores instead of loads: copy each of count
 * local arrays (src[i], nbytes[i] bytes) by DMA into every peer's shadow, at byte at[i] of
 * this rank's slot there. Peer p's shadow starts shadow_offset bytes after its data (the
 * same on every rank) and has nranks - 1 slots of slot_bytes, in rank order without p. Only
 * queues the copies: the caller fences them with GPU barriers (csrc/xla_ffi.cc). */
int pmg_push_peers(const pmg_peers *peers, size_t shadow_offset, size_t slot_bytes, int rank,
                   int nranks, const void *const *src, const size_t *at, const size_t *nbytes,
                   int count, cudaStream_t stream);
/* ---- the resident exchange ----
 * A launched exchange costs a launch and a wait on its stream, even when the kernel waits
 * for nobody (docs/DECISIONS.md, "The resident exchange").
 * pmg_resident_start instead leaves a kernel of `blocks` blocks running on the device that
 * polls a doorbell in page-locked host memory; each command rung there makes it average the
 * group's data as PMG_ALGO_LL does (same mailboxes, same bits), and it writes the command's
 * count into the doorbell when done, where the host polls. While it runs, no other LL call
 * may run on the group, and anything that waits for the whole device (cudaDeviceSynchronize,
 * cudaFree) waits for it: only pmg_resident_stop ends it. Every block must fit on the
 * device at once beside other work (blocks <= SM count; each takes 512 threads of an SM,
 * not the whole SM). */
typedef struct pmg_doorbell {
  uint64_t ring;    /* host to GPU: the last command; the GPU never writes it */
  uint64_t pad0[7]; /* each line has one writer: the host's stores never evict the GPU's */
  uint64_t done;    /* GPU to host: the count of the last command done */
  uint64_t pad1[7];
} pmg_doorbell;
/* Page-locked, mapped into every device's address space, zeroed. */
int pmg_doorbell_alloc(pmg_doorbell **bell);
int pmg_doorbell_free(pmg_doorbell *bell);
/* Every rank of the group starts its own; timeout_ns bounds each wait for a peer's values,
 * past which the kernel traps, as the barriers do. */
int pmg_resident_start(const pmg_peers *peers, int rank, int nranks, int blocks,
                       uint64_t timeout_ns, pmg_doorbell *bell, cudaStream_t stream);
/* Command number `count` (1, 2, ... after the start; each only after the last is done):
 * average the first n elements of dtype (at most PMG_LL_MAX_BYTES). Every rank rings the
 * same commands. The data must be written (its kernels finished) before the ring. */
int pmg_resident_ring(pmg_doorbell *bell, uint32_t count, size_t n, int dtype);
/* Wait on the host until command `count` is done: 0, or the kernel's own error if it ended
 * (a trap: a peer never sent), PMG_ERR_NOT_RUNNING if it ended cleanly, or PMG_ERR_TIMEOUT
 * some seconds past timeout_ns, when the kernel may still run (stop it). `stream` is the
 * kernel's. */
int pmg_resident_wait(pmg_doorbell *bell, uint32_t count, uint64_t timeout_ns,
                      cudaStream_t stream);
/* Ring the stop as command `count` (the kernel takes a stop whatever its number, as after a
 * timed-out wait), and wait for the kernel to end: its status. It leaves the signal block's
 * LL sequence number where launched LL calls continue from. */
int pmg_resident_stop(pmg_doorbell *bell, uint32_t count, cudaStream_t stream);
/* A GPU-side barrier alone (one block), for methods that move data with copies. */
int pmg_device_barrier(const pmg_peers *peers, int rank, int nranks, uint64_t timeout_ns,
                       cudaStream_t stream);
/* The same barrier without a kernel, by stream memory operations (the driver's
 * cuStreamWriteValue32 and cuStreamWaitValue32). flags[r] is rank r's array of
 * PMG_MAX_RANKS flags as this GPU addresses it: flags[r][p], for a peer p, is the last
 * barrier p announced to r; flags[r][r], the last one r's own stream reached. The barrier
 * writes seq into flags[r][rank] for every rank r, this one's included, and holds stream
 * until every peer p has written seq, or later, into flags[rank][p]. The GPU's front end
 * waits, so no SM is held (a barrier kernel spins on one, beside XLA's matrix products).
 * seq must grow by one per call, alike on every rank. The flags lie in page-locked host
 * memory that the ranks share (PeerGroup's flags segment), so that a watchdog can read and
 * release them with plain loads and stores: a CUDA call could wait behind the barrier
 * itself (docs/DECISIONS.md, "Stream barriers"). The barrier has no timeout of its own; the
 * watchdog gives it the group's (pmg_stream_sync). */
int pmg_stream_barrier(uint32_t *const *flags, int rank, int nranks, uint32_t seq,
                       cudaStream_t stream);
/* 0 when pmg_stream_barrier can run (the driver has stream memory operations), else why not. */
int pmg_stream_barrier_available(void);
/* The seed's method, in two parts. pmg_gather_peers copies every peer's replica (n elements)
 * into shadow, nranks-1 slots in rank order skipping this rank, by DMA over P2P.
 * pmg_shadow_average then averages [own or shadow slot] in rank order, in place in own.
 * Peers must not change their replicas during the gather, and nobody may overwrite its own
 * replica before every peer's gather has finished: pmg_copy_average fences both with GPU
 * barriers; without peer access the caller puts host barriers between the two parts. */
int pmg_gather_peers(const pmg_peers *peers, int rank, int nranks, void *shadow, size_t n,
                     int dtype, cudaStream_t stream);
int pmg_shadow_average(const pmg_peers *peers, int rank, int nranks, const void *shadow,
                       size_t n, int dtype, cudaStream_t stream);
int pmg_copy_average(const pmg_peers *peers, int rank, int nranks, void *shadow, size_t n,
                     int dtype, uint64_t timeout_ns, cudaStream_t stream);

/* ---- NCCL, loaded at run time (csrc/nccl.cc) ----
 * pmg_nccl_load dlopens the library at path once a process (later calls succeed at once) and
 * refuses one without non-blocking communicators and ncclCommAbort, saying why in `why`.
 * Communicators are non-blocking: pmg_nccl_init and pmg_nccl_finalize return at once, and
 * pmg_nccl_state says when they are ready (0), still busy (PMG_ERR_NCCL + 7) or broken. */
#define PMG_NCCL_MIN_VERSION 21400
typedef struct pmg_nccl_id { char internal[128]; } pmg_nccl_id;
int pmg_nccl_load(const char *path, char *why, size_t len);
int pmg_nccl_loaded(void);
int pmg_nccl_version(int *version);
int pmg_nccl_unique_id(pmg_nccl_id *id);
int pmg_nccl_init(void **comm, int nranks, int rank, const pmg_nccl_id *id);
int pmg_nccl_state(void *comm);
/* recv[i] = the sum (average: its mean, ncclAvg) over the communicator's ranks of send[i],
 * queued on stream (a cudaStream_t); returns once queued, PMG_ERR_TIMEOUT if NCCL has not
 * queued it within timeout_ns. */
int pmg_nccl_allreduce(void *comm, const void *send, void *recv, size_t count, int dtype,
                       int average, uint64_t timeout_ns, void *stream);
int pmg_nccl_finalize(void *comm);
int pmg_nccl_destroy(void *comm);
int pmg_nccl_abort(void *comm);
const char *pmg_nccl_last_error(void *comm);
const char *pmg_nccl_status_name(int status);   /* NULL for a code that is not NCCL's */
const char *pmg_nccl_status_string(int status);

/* ---- the average as an XLA operation (csrc/xla_ffi.cc) ----
 * The points of an exchange through the start/done pair that a timeline marks: on XLA's
 * stream, the (first) start, the last part's start, the done's arrival and its end; on the
 * side stream, the moment the copies may begin (after the first barrier), the end of the
 * first part's copies, the moment every rank's first part has landed (a barrier), the end
 * of the last part's copies, and the end of the exchange (after the last barrier). A start
 * in one part marks both parts' points. "pympgu_average_wait" marks the done's two points
 * where XLA's stream reaches it and passes it. */
enum pmg_mark {
  PMG_MARK_START = 0,
  PMG_MARK_SIDE_BEGIN = 1,
  PMG_MARK_FIRST_SENT = 2,
  PMG_MARK_LAST_START = 3,
  PMG_MARK_FIRST_LANDED = 4,
  PMG_MARK_LAST_SENT = 5,
  PMG_MARK_LANDED = 6,
  PMG_MARK_DONE = 7,
  PMG_MARK_AVERAGED = 8,
  PMG_MARKS = 9
};
/* A group's stream barriers, shared by the XLA operations (on XLA's thread) and the
 * PeerGroup's watchdog thread: how many were queued, and late_rank + 1 once the watchdog
 * found this rank's stream waiting longer than the group's timeout for rank late_rank (it
 * then lets the stream go on, and every later start fails with an error naming that rank). */
typedef struct pmg_stream_sync {
  uint32_t queued;
  int32_t late_rank_plus_one;
} pmg_stream_sync;

/* A registered group is everything the operation needs of a PeerGroup; the operation names
 * it by the id that pmg_xla_register returns (ids are never reused, so a function traced
 * with a closed group fails with an error instead of touching freed memory). */
typedef struct pmg_group {
  pmg_peers peers;
  size_t stage_offset; /* from data to staging, as for pmg_allreduce_average */
  size_t nbytes;       /* capacity of every rank's data buffer */
  int rank, nranks, device;
  uint64_t timeout_ns;
  cudaStream_t copy_stream; /* for PMG_ALGO_CE; NULL without staging */
  cudaEvent_t event;
  /* The start/done pair ("pympgu_average_start" and "_done") runs its exchange on side, a
   * high-priority stream of the group's own: side_in orders it after XLA's work so far
   * (the arrays, or their pack), side_out orders XLA's stream after it. When a start comes
   * in two parts, side_first marks the moment every rank's first part has landed, so that
   * XLA averages those arrays while the last part crosses the link. */
  cudaStream_t side;
  cudaEvent_t side_in, side_out, side_first;
  void *shadow; /* PMG_ALGO_GATHER's: nranks - 1 slots of nbytes; NULL until it is needed */
  /* Nonzero when the shadow lies in the shared block, shadow_offset bytes after the data on
   * every rank: then peers push into it (pmg_push_peers) and no pack is needed. Zero: the
   * shadow is private, and each rank pulls the peers' packed buffers (pmg_gather_peers). */
  size_t shadow_offset;
  /* Non-NULL: the pair's barriers are stream barriers (pmg_stream_barrier), counted here;
   * NULL: barrier kernels (PeerGroup's stream_barriers off, or a driver without them). */
  pmg_stream_sync *stream_sync;
  uint32_t *stream_flags[PMG_MAX_RANKS]; /* pmg_stream_barrier's flags, with stream_sync */
  /* Timing events that the pair records at each point of an exchange (pmg_mark), or all
   * NULL: PeerGroup.xla_timeline reads the last exchange's (PeerGroup.record_timeline). */
  cudaEvent_t marks[PMG_MARKS];
  /* Non-NULL: every average is one across nodes (pmg_node_average: this NCCL communicator
   * and world ranks in all; with nccl_flat, the communicator holds every rank and NCCL
   * averages alone); NULL: inside this node. */
  void *nccl_comm;
  int world;
  int nccl_flat;
} pmg_group;
/* The average of a group's buffers from byte `from` on (n elements of dtype), on whatever
 * road the group takes: NCCL alone (nccl_flat), the node's kernels around NCCL (nccl_comm,
 * float32), or method algo inside the node (pmg_allreduce_average). The one dispatch that
 * PeerGroup and the XLA operations share. */
int pmg_group_average(const pmg_group *g, size_t from, size_t n, int dtype, int algo,
                      int max_blocks, size_t chunk_bytes, cudaStream_t stream);
/* *id == 0: register group under a new id, returned in *id. Otherwise replace the entry of
 * the registered id *id (the group gained a shadow). */
int pmg_xla_register(const pmg_group *group, int64_t *id);
int pmg_xla_unregister(int64_t id);
/* The XLA FFI handler (an XLA_FFI_Handler *) of the operation named: "pympgu_average", or
 * the pair "pympgu_average_start" and "pympgu_average_done", or "pympgu_average_wait"
 * (see xla_ffi.cc).
 * NULL for another name, or when pympgu was built without jaxlib's FFI headers. */
void *pmg_xla_handler(const char *name);
#endif

#ifdef __cplusplus
}
#endif
#endif
