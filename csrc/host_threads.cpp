// Helper threads for the host copies and averages of CPU workers' exchanges: a worker's XLA
// pool computes the step, and during the exchange the worker's other cores would sit idle
// while one thread streams the state through memory (docs/DECISIONS.md, "CPU workers'
// copies on every core of theirs"). The threads are made by pmg_host_set_threads in the
// worker after it is pinned, so they run on its cores; between calls they sleep on a
// futex.
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "host_threads.h"
#include "pympgu.h"

namespace pmg {
namespace {

#ifdef __linux__
void sleep_on(std::atomic<uint32_t> *word, uint32_t seen) {
  syscall(SYS_futex, reinterpret_cast<uint32_t *>(word), FUTEX_WAIT_PRIVATE, seen, nullptr,
          nullptr, 0);
}
void wake_all(std::atomic<uint32_t> *word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t *>(word), FUTEX_WAKE_PRIVATE, INT32_MAX,
          nullptr, nullptr, 0);
}
#else
void sleep_on(std::atomic<uint32_t> *, uint32_t) { std::this_thread::yield(); }
void wake_all(std::atomic<uint32_t> *) {}
#endif

// A helper done with its part looks for the next call this long before it sleeps: an
// exchange's copies and average come within microseconds of each other, a step's compute
// (which the spinning would slow) only after the exchange.
constexpr auto kSpin = std::chrono::microseconds(30);

// The caller publishes a call by bumping `round_` (waking the helpers that sleep on it),
// takes parts itself, and spins until every helper has finished: no lock on the way, as
// a condition variable's would hand the wake-ups over one helper at a time.
class Pool {
 public:
  static Pool &get() {
    static Pool pool;
    return pool;
  }

  int size() {
    std::lock_guard<std::mutex> lk(call_);
    forked();
    return int(workers_.size()) + 1;
  }

  void resize(int n) {
    std::lock_guard<std::mutex> lk(call_);
    forked();
    stop_all();
    stop_.store(false);
    // Each helper starts from the round now, not from whatever it reads once it runs: a
    // call may come before that.
    const uint32_t now = round_.load();
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, now] { serve(now); });
  }

  void run(int parts, const std::function<void(int)> &f) {
    std::lock_guard<std::mutex> lk(call_);
    forked();
    if (workers_.empty()) {
      for (int i = 0; i < parts; ++i) f(i);
      return;
    }
    task_ = &f;
    parts_ = parts;
    next_.store(0, std::memory_order_relaxed);
    busy_.store(int(workers_.size()), std::memory_order_relaxed);
    round_.fetch_add(1, std::memory_order_seq_cst);  // publishes the three above
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_all(&round_);
    take(f, parts);
    while (busy_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    task_ = nullptr;
  }

  ~Pool() { stop_all(); }

 private:
  void take(const std::function<void(int)> &f, int parts) {
    for (int i = next_.fetch_add(1); i < parts; i = next_.fetch_add(1)) f(i);
  }

  void serve(uint32_t seen) {
    for (;;) {
      uint32_t now;
      auto start = std::chrono::steady_clock::now();
      while ((now = round_.load(std::memory_order_acquire)) == seen && !stop_.load()) {
        if (std::chrono::steady_clock::now() - start < kSpin) {
          std::this_thread::yield();  // (a core shared with the caller goes to it)
          continue;
        }
        // Counted before the last look: a caller that bumps the round after it wakes us.
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (round_.load(std::memory_order_seq_cst) == seen && !stop_.load())
          sleep_on(&round_, seen);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        start = std::chrono::steady_clock::now();
      }
      if (stop_.load()) return;
      seen = now;
      take(*task_, parts_);
      busy_.fetch_sub(1, std::memory_order_release);
    }
  }

  // A child forked from a process with threads has none of them: it forgets them and runs
  // on its caller's thread until told otherwise.
  void forked() {
    if (owner_ == getpid()) return;
    for (auto &t : workers_) t.detach();
    workers_.clear();
    owner_ = getpid();
  }

  void stop_all() {
    stop_.store(true);
    round_.fetch_add(1, std::memory_order_seq_cst);
    wake_all(&round_);
    for (auto &t : workers_) t.join();
    workers_.clear();
  }

  std::mutex call_;  // one run or resize at a time
  std::vector<std::thread> workers_;
  const std::function<void(int)> *task_ = nullptr;
  int parts_ = 0;
  std::atomic<int> next_{0}, busy_{0}, sleepers_{0};
  std::atomic<uint32_t> round_{0};
  std::atomic<bool> stop_{false};
  pid_t owner_ = getpid();
};

}  // namespace

void parallel(int parts, const std::function<void(int)> &f) {
  if (parts <= 1) {
    if (parts == 1) f(0);
    return;
  }
  Pool::get().run(parts, f);
}

int parts_for(size_t bytes) {
  const size_t most = bytes / kMinPartBytes;
  const int threads = Pool::get().size();
  return most < size_t(threads) ? (most ? int(most) : 1) : threads;
}

}  // namespace pmg

extern "C" {

int pmg_host_set_threads(int n) {
  if (n < 1 || n > PMG_MAX_HOST_THREADS) return PMG_ERR_INVALID_ARGUMENT;
  pmg::Pool::get().resize(n);
  return 0;
}

int pmg_host_threads(void) { return pmg::Pool::get().size(); }

int pmg_host_copy(const void *const *srcs, void *const *dsts, const size_t *nbytes, int count) {
  if (count < 0 || (count && (!srcs || !dsts || !nbytes))) return PMG_ERR_INVALID_ARGUMENT;
  size_t total = 0;
  for (int i = 0; i < count; ++i) {
    if (nbytes[i] && (!srcs[i] || !dsts[i])) return PMG_ERR_INVALID_ARGUMENT;
    total += nbytes[i];
  }
  // Part p copies bytes [p * total / parts, (p + 1) * total / parts) of the entries laid
  // end to end, whichever entries those fall in.
  const int parts = pmg::parts_for(2 * total);
  pmg::parallel(parts, [&](int p) {
    const size_t lo = total * size_t(p) / size_t(parts);
    const size_t hi = total * size_t(p + 1) / size_t(parts);
    size_t at = 0;
    for (int i = 0; i < count && at < hi; at += nbytes[i], ++i) {
      const size_t a = lo > at ? lo - at : 0;
      const size_t b = hi - at < nbytes[i] ? hi - at : nbytes[i];
      if (a < b)
        std::memcpy(static_cast<char *>(dsts[i]) + a, static_cast<const char *>(srcs[i]) + a,
                    b - a);
    }
  });
  return 0;
}

}  // extern "C"
