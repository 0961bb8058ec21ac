// A barrier of one node's CPU workers in shared memory: they meet here at each exchange
// instead of through the launcher's sockets (docs/DECISIONS.md, "CPU workers meet in shared
// memory"). Sense by generation: the last to arrive resets the count and bumps the
// generation; the others spin briefly, then sleep on a futex of the generation word. A wait
// is bounded, so that the caller can look for the launcher's STOP between waits.
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <ctime>

#include "pympgu.h"

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

namespace {

struct alignas(64) Barrier {
  std::atomic<uint32_t> count;
  alignas(64) std::atomic<uint32_t> generation;
  alignas(64) std::atomic<uint32_t> arrivals[PMG_MAX_RANKS];  // each rank's barriers begun
};
static_assert(sizeof(Barrier) <= PMG_HOST_BARRIER_BYTES, "PMG_HOST_BARRIER_BYTES too small");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "a process-shared atomic");

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// Sleep until *word may differ from seen, or ns pass (spurious wakes are fine).
void sleep_on(std::atomic<uint32_t> *word, uint32_t seen, int64_t ns) {
#ifdef __linux__
  timespec t{time_t(ns / 1000000000), long(ns % 1000000000)};
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t *>(word), FUTEX_WAIT, seen, &t, nullptr, 0);
#else
  (void)word; (void)seen; (void)ns;
  sched_yield();
#endif
}

void wake_all(std::atomic<uint32_t> *word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t *>(word), FUTEX_WAKE, INT32_MAX, nullptr,
          nullptr, 0);
#else
  (void)word;
#endif
}

inline bool aligned(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }

}  // namespace

extern "C" {

int pmg_host_barrier_arrive(void *words, int nranks, int rank, uint32_t *generation) {
  if (!words || !aligned(words) || !generation || nranks < 1 || nranks > PMG_MAX_RANKS ||
      rank < 0 || rank >= nranks)
    return PMG_ERR_INVALID_ARGUMENT;
  auto *b = static_cast<Barrier *>(words);
  b->arrivals[rank].fetch_add(1, std::memory_order_relaxed);
  const uint32_t gen = b->generation.load(std::memory_order_acquire);
  *generation = gen;
  // acq_rel: what this rank wrote before arriving is seen by whoever passes after it.
  if (b->count.fetch_add(1, std::memory_order_acq_rel) + 1 == uint32_t(nranks)) {
    b->count.store(0, std::memory_order_relaxed);  // before the release below
    b->generation.store(gen + 1, std::memory_order_release);
    wake_all(&b->generation);
    return 1;
  }
  return 0;
}

int pmg_host_barrier_wait(void *words, uint32_t generation, int64_t timeout_ns, int spins) {
  if (!words || !aligned(words) || timeout_ns < 0 || spins < 0) return PMG_ERR_INVALID_ARGUMENT;
  auto *b = static_cast<Barrier *>(words);
  for (int i = 0; i < spins; ++i)
    if (b->generation.load(std::memory_order_acquire) != generation) return 1;
  const int64_t deadline = now_ns() + timeout_ns;
  for (;;) {
    if (b->generation.load(std::memory_order_acquire) != generation) return 1;
    const int64_t left = deadline - now_ns();
    if (left <= 0) return 0;
    sleep_on(&b->generation, generation, left);
  }
}

uint32_t pmg_host_barrier_arrivals(const void *words, int rank) {
  if (!words || !aligned(words) || rank < 0 || rank >= PMG_MAX_RANKS) return 0;
  return static_cast<const Barrier *>(words)->arrivals[rank].load(std::memory_order_relaxed);
}

}  // extern "C"
