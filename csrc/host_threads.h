// Helper threads of one process for the host copies and averages of CPU workers'
// exchanges (csrc/host_threads.cpp). Internal to the host code: the C API is pympgu.h's.
#pragma once
#include <cstddef>
#include <functional>

namespace pmg {

// Runs f(part) for part in [0, parts) on the pool's threads and the caller's, and returns
// when every part is done. One call at a time; with a pool of one thread (the default), on
// the caller's alone.
void parallel(int parts, const std::function<void(int)> &f);

// How many parts a job of `bytes` bytes of memory traffic is worth: one per thread, but
// no part under kMinPartBytes (waking a thread costs about what copying that takes).
int parts_for(size_t bytes);

constexpr size_t kMinPartBytes = size_t(256) << 10;

}  // namespace pmg
