// Which host calls wait while a stream waits at a stream memory operation
// (cuStreamWaitValue32) for a flag that nobody writes yet: what a stream barrier's watchdog
// may call, and what a barrier's own later operations cost the host thread that queues them
// (docs/DECISIONS.md, "Stream barriers").
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -DPMG_WITH_CUDA -Icsrc benchmarks/probe_stream_wait.cu \
//        csrc/host_average.cpp -o /tmp/probe_stream_wait
//   /tmp/probe_stream_wait [release_ms]     (default 1500)
//
// GPU 0's stream waits for a flag, in GPU 0's memory (written by GPU 1 over P2P, as a peer's
// barrier does) or in page-locked host memory (written by the host); or, third, a kernel
// spins on it (as a barrier kernel waiting for a late peer does, or a resident exchange).
// A thread releases it after release_ms: through a kernel already running on GPU 1 that
// polls host memory, or by a plain store, so that the release needs no CUDA call on the
// host. Meanwhile the main thread times one call after another; a call that took about
// release_ms was held until the release: under CUDA's default lazy module loading, the
// first launch of a kernel not loaded yet, or the first copy to the host on a fresh stream,
// is held behind such a wait. So a release must need no CUDA call.
//
// Last, barriers back to back between the two GPUs: by such operations, with the flags in
// GPU memory or in host memory, and by pympgu's barrier kernel.
#include <cuda.h>

#include "../csrc/barriers.cu"  // pmg_device_barrier and the memory operations, as built

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>

#include "probe_check.h"

namespace {
// The driver's stream memory operations, as pympgu finds them (average.cu's mem_ops).
StreamValue32 write_value, wait_value;

void CU(CUresult r, const char *what) {
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "%s failed: %d\n", what, int(r));
    std::exit(1);
  }
}

// On GPU 1: wait until the host says so, then write GPU 0's flag over P2P.
__global__ void releaser(const volatile unsigned *trigger, volatile unsigned *flag) {
  while (*trigger == 0) {
  }
  __threadfence_system();
  *flag = 1;
}

__global__ void nothing() {}
// A kernel of its own for each case's first launch, which CUDA loads lazily by default.
template <int K>
__global__ void first() {}

// On GPU 0, in the third case: a kernel that spins (as a barrier kernel waiting for a late
// peer does, or a resident exchange) until the host says so.
__global__ void spin(const volatile unsigned *trigger) {
  while (*trigger == 0) {
  }
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// what: 'd' the stream waits for a flag in GPU 0's memory, 'h' in host memory, 'k' a kernel
// spins on the stream in place of the wait.
void probe(char what, void (*first_launch)(), int release_ms) {
  const bool on_device = what == 'd', spinning = what == 'k';
  std::printf("\n%s\n", on_device  ? "the flag in GPU 0's memory, written by GPU 1 over P2P"
                        : spinning ? "a kernel spinning on the stream in place of the wait"
                                   : "the flag in page-locked host memory, written by the host");
  CK(cudaSetDevice(0));
  unsigned *flag = nullptr, *own, *trigger_host, *trigger_dev = nullptr, *peer;
  void *src, *dst, *host_buf;
  const size_t copy_bytes = 1 << 20;
  unsigned *flag_host = nullptr;
  if (on_device) {
    CK(cudaMalloc(&flag, 4));
    CK(cudaMemset(flag, 0, 4));
  } else if (!spinning) {
    CK(cudaHostAlloc(&flag_host, 4, cudaHostAllocMapped | cudaHostAllocPortable));
    *flag_host = 0;
    CK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&flag), flag_host, 0));
  }
  CK(cudaMalloc(&own, 4));
  CK(cudaMemset(own, 0, 4));
  CK(cudaMalloc(&src, copy_bytes));
  CK(cudaHostAlloc(&host_buf, 64, cudaHostAllocDefault));
  CK(cudaHostAlloc(reinterpret_cast<void **>(&trigger_host), 4,
                   cudaHostAllocMapped | cudaHostAllocPortable));
  *trigger_host = 0;
  CK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&trigger_dev), trigger_host, 0));
  cudaStream_t s, other, reader, s1;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&reader, cudaStreamNonBlocking));
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CK(cudaSetDevice(1));
  CK(cudaMalloc(&peer, 4));
  CK(cudaMalloc(&dst, copy_bytes));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  if (on_device) releaser<<<1, 1, 0, s1>>>(trigger_dev, flag);
  CK(cudaGetLastError());
  CK(cudaSetDevice(0));
  nothing<<<1, 1, 0, s>>>();  // loaded now: only first_launch is loaded behind the wait
  CK(cudaDeviceSynchronize());

  if (spinning)
    spin<<<1, 1, 0, s>>>(trigger_dev);
  else
    CU(wait_value(s, reinterpret_cast<CUdeviceptr>(flag), 1, CU_STREAM_WAIT_VALUE_GEQ), "wait");
  CK(cudaGetLastError());
  std::atomic<bool> released{false};
  const auto t_release = std::chrono::steady_clock::now();
  std::thread releasing([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(release_ms));
    released = true;
    // A plain store either way: the release needs the CUDA driver for nothing.
    if (on_device || spinning)
      *reinterpret_cast<volatile unsigned *>(trigger_host) = 1;
    else
      *reinterpret_cast<volatile unsigned *>(flag_host) = 1;
  });

  auto timed = [&](const char *what, const std::function<void()> &call) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    const double ms = ms_since(t0);
    std::printf("  %-62s %9.3f ms%s\n", what, ms, ms > 0.5 * release_ms ? "  (held)" : "");
  };
  auto dptr = [](const void *p) { return reinterpret_cast<CUdeviceptr>(p); };
  timed("cuStreamWriteValue32 on the stream, to GPU 1's memory", [&] {
    CU(write_value(s, dptr(peer), 1, CU_STREAM_WRITE_VALUE_DEFAULT), "write peer");
  });
  timed("cuStreamWriteValue32 on the stream, to its own GPU's memory", [&] {
    CU(write_value(s, dptr(own), 1, CU_STREAM_WRITE_VALUE_DEFAULT), "write own");
  });
  timed("a second cuStreamWaitValue32 on the stream", [&] {
    CU(wait_value(s, dptr(own), 1, CU_STREAM_WAIT_VALUE_GEQ), "wait own");
  });
  timed("cudaMemcpyAsync of 1 MiB to GPU 1 on the stream", [&] {
    CK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDefault, s));
  });
  timed("cudaEventRecord on the stream", [&] { CK(cudaEventRecord(ev, s)); });
  timed("cudaStreamWaitEvent: another stream waits for it", [&] {
    CK(cudaStreamWaitEvent(other, ev, 0));
  });
  timed("the first launch of a kernel, on the other stream, after its event wait", [&] {
    first_launch<<<1, 1, 0, other>>>();
  });
  timed("an empty kernel on the stream", [&] { nothing<<<1, 1, 0, s>>>(); });
  timed("cudaEventQuery", [&] { (void)cudaEventQuery(ev); });
  timed("4 bytes to the host on a third stream, and its synchronize", [&] {
    CK(cudaMemcpyAsync(host_buf, own, 4, cudaMemcpyDeviceToHost, reader));
    CK(cudaStreamSynchronize(reader));
  });
  timed("4 bytes to the device on the third stream, and its synchronize", [&] {
    CK(cudaMemcpyAsync(own, host_buf, 4, cudaMemcpyHostToDevice, reader));
    CK(cudaStreamSynchronize(reader));
  });
  timed("20,000 empty kernels on the stream", [&] {
    for (int i = 0; i < 20000; ++i) nothing<<<1, 1, 0, s>>>();
  });
  timed("cudaStreamSynchronize of the stream", [&] { CK(cudaStreamSynchronize(s)); });
  std::printf("  (released %.3f ms after the wait was queued: %s)\n", ms_since(t_release),
              released ? "yes" : "no");
  releasing.join();
  CK(cudaDeviceSynchronize());
  CK(cudaSetDevice(1));
  CK(cudaDeviceSynchronize());
  CK(cudaFree(peer));
  CK(cudaFree(dst));
  CK(cudaStreamDestroy(s1));
  CK(cudaSetDevice(0));
  if (on_device)
    CK(cudaFree(flag));
  else if (flag_host)
    CK(cudaFreeHost(flag_host));
  CK(cudaFree(own));
  CK(cudaFree(src));
  CK(cudaFreeHost(host_buf));
  CK(cudaFreeHost(trigger_host));
  CK(cudaEventDestroy(ev));
  for (cudaStream_t x : {s, other, reader}) CK(cudaStreamDestroy(x));
}

// Barriers back to back between the two GPUs, each GPU on its own stream: by stream memory
// operations (each writes i into the other's flag, then waits for its own to reach i; the
// branch's pmg_stream_barrier), with the flags in each waiter's GPU memory or in host
// memory, and by pympgu's barrier kernel (pmg_device_barrier, what main runs).
void barriers(const char *form, int rounds) {
  const bool kernel = form[0] == 'k', on_device = form[0] == 'd';
  unsigned *flag[2], *host = nullptr;
  pmg_peers peers{};
  cudaStream_t st[2];
  if (form[0] == 'h') {
    CK(cudaHostAlloc(reinterpret_cast<void **>(&host), 256,
                     cudaHostAllocMapped | cudaHostAllocPortable));
    host[0] = host[32] = 0;  // a line apart
  }
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    if (kernel) {
      CK(cudaMalloc(&peers.signal[d], sizeof(pmg_signal)));
      CK(cudaMemset(peers.signal[d], 0, sizeof(pmg_signal)));
      CK(cudaMalloc(&peers.data[d], 256));
    } else if (on_device) {
      CK(cudaMalloc(&flag[d], 4));
      CK(cudaMemset(flag[d], 0, 4));
    } else {
      CK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&flag[d]), host + 32 * d, 0));
    }
    CK(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking));
    CK(cudaDeviceSynchronize());
  }
  auto at = [](unsigned *p) { return reinterpret_cast<CUdeviceptr>(p); };
  auto one = [&](unsigned i) {
    for (int d = 0; d < 2; ++d) {
      if (kernel) {
        CK(cudaSetDevice(d));
        if (int err = pmg_device_barrier(&peers, d, 2, 10000000000ull, st[d])) {
          std::fprintf(stderr, "pmg_device_barrier: %d\n", err);
          std::exit(1);
        }
      } else {
        CU(write_value(st[d], at(flag[1 - d]), i, CU_STREAM_WRITE_VALUE_DEFAULT), "write");
        CU(wait_value(st[d], at(flag[d]), i, CU_STREAM_WAIT_VALUE_GEQ), "wait");
      }
    }
  };
  one(1);  // loads the kernel, outside the timing
  for (int d = 0; d < 2; ++d) CK(cudaStreamSynchronize(st[d]));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 2; i < rounds + 2; ++i) one(unsigned(i));
  for (int d = 0; d < 2; ++d) CK(cudaStreamSynchronize(st[d]));
  const double ms = ms_since(t0);
  std::printf("  %-52s %8.2f us a barrier (%d back to back)\n",
              kernel    ? "barrier kernel (pmg_device_barrier):"
              : on_device ? "stream operations, flags in GPU memory:"
                          : "stream operations, flags in host memory:",
              1e3 * ms / rounds, rounds);
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaStreamDestroy(st[d]));
    if (kernel) {
      CK(cudaFree(peers.signal[d]));
      CK(cudaFree(peers.data[d]));
    } else if (on_device) {
      CK(cudaFree(flag[d]));
    }
  }
  if (host) CK(cudaFreeHost(host));
  CK(cudaSetDevice(0));
}
}  // namespace

int main(int argc, char **argv) {
  const int release_ms = argc > 1 ? std::atoi(argv[1]) : 1500;
  int n = 0, ok01 = 0, ok10 = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::fprintf(stderr, "needs two GPUs, found %d\n", n);
    return 1;
  }
  CK(cudaDeviceCanAccessPeer(&ok01, 0, 1));
  CK(cudaDeviceCanAccessPeer(&ok10, 1, 0));
  if (!ok01 || !ok10) {
    std::fprintf(stderr, "GPUs 0 and 1 have no peer access\n");
    return 1;
  }
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  CK(cudaSetDevice(1));
  CK(cudaDeviceEnablePeerAccess(0, 0));
  if (const int err = mem_ops().status) {
    std::fprintf(stderr, "no stream memory operations: %s\n",
                 cudaGetErrorString(cudaError_t(err)));
    return 1;
  }
  write_value = mem_ops().write;
  wait_value = mem_ops().wait;
  std::printf("host calls while GPU 0's stream waits (cuStreamWaitValue32, or a spinning "
              "kernel), released after %d ms\n", release_ms);
  probe('d', first<0>, release_ms);
  probe('h', first<1>, release_ms);
  probe('k', first<2>, release_ms);
  std::printf("\nbarriers between GPU 0 and GPU 1\n");
  for (int k = 0; k < 2; ++k)
    for (const char *form : {"device", "host", "kernel"}) barriers(form, 2000);
  return 0;
}
