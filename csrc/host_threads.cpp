// Helper threads for the host copies and averages of CPU workers' exchanges: a worker's XLA
// pool computes the step, and during the exchange the worker's other cores would sit idle
// while one thread streams the state through memory (docs/DECISIONS.md, "CPU workers'
// copies on every core of theirs"). The threads are made by pmg_host_set_threads in the
// worker after it is pinned, so they run on its cores; between calls they sleep on a
// condition variable.
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#include "host_threads.h"
#include "pympgu.h"

namespace pmg {
namespace {

class Pool {
 public:
  static Pool &get() {
    static Pool pool;
    return pool;
  }

  int size() {
    std::lock_guard<std::mutex> lk(m_);
    forked();
    return int(workers_.size()) + 1;
  }

  void resize(int n) {
    std::lock_guard<std::mutex> call(call_);
    {
      std::lock_guard<std::mutex> lk(m_);
      forked();
    }
    stop_all();
    std::lock_guard<std::mutex> lk(m_);
    stop_ = false;
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { serve(); });
  }

  void run(int parts, const std::function<void(int)> &f) {
    std::lock_guard<std::mutex> call(call_);
    size_t helpers;
    {
      std::lock_guard<std::mutex> lk(m_);
      forked();
      helpers = workers_.size();
      if (helpers) {
        task_ = &f;
        parts_ = parts;
        next_.store(0);
        busy_ = int(helpers);
        ++round_;
      }
    }
    if (!helpers) {
      for (int i = 0; i < parts; ++i) f(i);
      return;
    }
    wake_.notify_all();
    take(f, parts);
    std::unique_lock<std::mutex> lk(m_);
    done_.wait(lk, [this] { return busy_ == 0; });
    task_ = nullptr;
  }

  ~Pool() { stop_all(); }

 private:
  void take(const std::function<void(int)> &f, int parts) {
    for (int i = next_.fetch_add(1); i < parts; i = next_.fetch_add(1)) f(i);
  }

  void serve() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      wake_.wait(lk, [&] { return stop_ || round_ != seen; });
      if (stop_) return;
      seen = round_;
      const std::function<void(int)> *f = task_;
      const int parts = parts_;
      lk.unlock();
      take(*f, parts);
      lk.lock();
      if (--busy_ == 0) done_.notify_one();
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
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto &t : workers_) t.join();
    workers_.clear();
  }

  std::mutex call_;  // one run or resize at a time
  std::mutex m_;     // what follows
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)> *task_ = nullptr;
  int parts_ = 0;
  std::atomic<int> next_{0};
  int busy_ = 0;
  uint64_t round_ = 0;
  bool stop_ = false;
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
