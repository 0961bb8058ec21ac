// What the link between two GPUs gives each traffic pattern, and the two-shot kernels timed
// on the same buffers: the evidence behind the large-size algorithm (docs/DECISIONS.md,
// "Copy engines for large buffers").
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -DPMG_WITH_CUDA -Icsrc benchmarks/link_probe.cu \
//     $(ls csrc/*.cu | grep -v runtime) csrc/runtime.cu csrc/host_average.cpp csrc/nccl.cc -ldl -o /tmp/link_probe
//   /tmp/link_probe [MiB ...]            (default 256 1024)
//
// One process drives GPUs 0 and 1 with peer access enabled, so that one host clock times
// both GPUs. For the kernels a P2P mapping moves the same bytes as an IPC one (twoshot and
// push time the same here as in python -m pympgu.bench, and so does 'ce' since a PeerGroup's
// data starts on a page: benchmarks/probe_dma.py times the copies across processes). It
// links csrc's kernels so that the production kernels are timed as they are built.
#include "../csrc/pympgu.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "probe_check.h"

namespace {

__global__ void write_kernel(uint4 *dst, size_t nvec) {
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  for (size_t v = tid; v < nvec; v += nthreads) {
    const uint32_t x = uint32_t(v);
    __stcg(dst + v, make_uint4(x, x + 1, x + 2, x + 3));
  }
}

__global__ void read_kernel(const uint4 *src, size_t nvec, uint4 *sink) {
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  uint32_t acc = 0;
  for (size_t v = tid; v < nvec; v += nthreads * 4) {
    uint4 r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = v + u * nthreads < nvec ? __ldcg(src + v + u * nthreads) : uint4{};
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  if (acc == 0x9e3779b9u) sink[tid] = make_uint4(acc, 0, 0, 0);  // keeps the loads alive
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ms per call of fn (which queues work on both GPUs), median of 5 runs of `iters` calls.
double time_ms(const std::function<void()> &fn, int iters = 10) {
  for (int i = 0; i < 2; ++i) fn();
  std::vector<double> runs;
  for (int rep = 0; rep < 5; ++rep) {
    for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); }
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) fn();
    for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); }
    const auto t1 = std::chrono::steady_clock::now();
    runs.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count() / iters);
  }
  return median(runs);
}

}  // namespace

int main(int argc, char **argv) {
  std::vector<size_t> mibs;
  for (int i = 1; i < argc; ++i) mibs.push_back(std::strtoull(argv[i], nullptr, 10));
  if (mibs.empty()) mibs = {256, 1024};
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  if (ndev < 2) {
    std::fprintf(stderr, "link_probe needs 2 GPUs, found %d\n", ndev);
    return 2;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t max_bytes = *std::max_element(mibs.begin(), mibs.end()) << 20;
  void *data[2], *stage[2], *sink[2];
  pmg_signal *sig[2];
  cudaStream_t st[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    // One allocation, data then staging, as in a PeerGroup: 'ce' finds the staging area at
    // the same offset from the data on every rank.
    CK(cudaMalloc(&data[d], 2 * max_bytes));
    stage[d] = static_cast<char *>(data[d]) + max_bytes;
    CK(cudaMalloc(&sink[d], 64 << 20));
    CK(cudaMalloc(&sig[d], sizeof(pmg_signal)));
    CK(cudaMemset(sig[d], 0, sizeof(pmg_signal)));
    CK(cudaMemset(data[d], 1, max_bytes));
    CK(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking));
  }
  pmg_peers peers = {};
  for (int d = 0; d < 2; ++d) { peers.data[d] = data[d]; peers.signal[d] = sig[d]; }
  cudaStream_t copy[2];
  cudaEvent_t ev[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaStreamCreateWithFlags(&copy[d], cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&ev[d], cudaEventDisableTiming));
  }
  const uint64_t timeout = 10ull * 1000 * 1000 * 1000;

  std::printf("%-34s %8s %10s %9s\n", "pattern (GPU 0 and 1 at once)", "MiB", "ms", "GB/s");
  for (size_t mib : mibs) {
    const size_t bytes = mib << 20, nvec = bytes / 16, n = bytes / 4;
    auto row = [&](const char *name, double ms, double link_bytes) {
      std::printf("%-34s %8zu %10.3f %9.1f\n", name, mib, ms, link_bytes / ms / 1e6);
    };
    // Copy engines, one direction and both at once (bytes moved per direction).
    row("CE copy 1->0 only", time_ms([&] {
          CK(cudaSetDevice(0));
          CK(cudaMemcpyPeerAsync(stage[0], 0, data[1], 1, bytes, st[0]));
        }), bytes);
    row("CE copy both ways", time_ms([&] {
          for (int d = 0; d < 2; ++d) {
            CK(cudaSetDevice(d));
            CK(cudaMemcpyPeerAsync(stage[d], d, data[1 - d], 1 - d, bytes, st[d]));
          }
        }), bytes);
    // The same bytes as many copies on one stream, as 'ce' queues them: pushed (source here,
    // destination there) by cudaMemcpyAsync, whole and in 32 MiB pieces.
    for (size_t piece : {bytes, size_t(32) << 20}) {
      char name[64];
      std::snprintf(name, sizeof name, "CE push both ways, %zu MiB copies", piece >> 20);
      row(name, time_ms([&] {
            for (int d = 0; d < 2; ++d) {
              CK(cudaSetDevice(d));
              for (size_t at = 0; at < bytes; at += piece)
                CK(cudaMemcpyAsync(static_cast<char *>(stage[1 - d]) + at,
                                   static_cast<char *>(data[d]) + at, std::min(piece, bytes - at),
                                   cudaMemcpyDefault, copy[d]));
            }
          }), bytes);
    }
    for (int blocks : {sms, 2 * sms}) {
      char name[64];
      std::snprintf(name, sizeof name, "SM remote writes both ways @%d", blocks);
      row(name, time_ms([&] {
            for (int d = 0; d < 2; ++d) {
              CK(cudaSetDevice(d));
              write_kernel<<<blocks, 512, 0, st[d]>>>(static_cast<uint4 *>(stage[1 - d]), nvec);
            }
          }), bytes);
      std::snprintf(name, sizeof name, "SM remote reads both ways @%d", blocks);
      row(name, time_ms([&] {
            for (int d = 0; d < 2; ++d) {
              CK(cudaSetDevice(d));
              read_kernel<<<blocks, 512, 0, st[d]>>>(static_cast<const uint4 *>(data[1 - d]), nvec,
                                                    static_cast<uint4 *>(sink[d]));
            }
          }), bytes);
    }
    row("SM remote writes 0->1 only", time_ms([&] {
          CK(cudaSetDevice(0));
          write_kernel<<<2 * sms, 512, 0, st[0]>>>(static_cast<uint4 *>(stage[1]), nvec);
        }), bytes);
    // Copy engines and SM stores at once, each on its part of the bytes: whether the link
    // carries more than either alone, which a two-shot pushing by both would need to pass
    // DMA's 394 GB/s (1.2x NCCL at 1 GiB, as the copy engines alone give).
    for (int pct : {25, 50, 75}) {
      for (int blocks : {sms / 2, 2 * sms}) {
        const size_t dma = bytes / 100 * pct / 16 * 16;
        char name[64];
        std::snprintf(name, sizeof name, "CE %d%% + SM writes @%d, both ways", pct, blocks);
        row(name, time_ms([&] {
              for (int d = 0; d < 2; ++d) {
                CK(cudaSetDevice(d));
                CK(cudaMemcpyPeerAsync(stage[1 - d], 1 - d, data[d], d, dma, copy[d]));
                write_kernel<<<blocks, 512, 0, st[d]>>>(
                    reinterpret_cast<uint4 *>(static_cast<char *>(stage[1 - d]) + dma),
                    (bytes - dma) / 16);
              }
            }), bytes);
      }
    }
    // The averaging kernels: link bytes per direction are the buffer's bytes.
    for (int algo : {PMG_ALGO_ONESHOT, PMG_ALGO_TWOSHOT, PMG_ALGO_PUSH}) {
      for (int blocks : {32, sms, 2 * sms}) {
        char name[64];
        const char *algo_name[] = {"oneshot", "twoshot", "push"};
        std::snprintf(name, sizeof name, "%s @%d", algo_name[algo], blocks);
        row(name, time_ms([&] {
              for (int d = 0; d < 2; ++d) {
                CK(cudaSetDevice(d));
                CK(cudaError_t(pmg_allreduce_average(&peers, max_bytes, d, 2, n, PMG_FLOAT32, algo,
                                                     std::min(blocks, PMG_MAX_BLOCKS), timeout, st[d],
                                                     0, nullptr, nullptr)));
              }
            }), bytes);
      }
    }
    for (size_t chunk_mib : {4, 8, 16, 32}) {
      char name[64];
      std::snprintf(name, sizeof name, "ce, last chunks %zu MiB", chunk_mib);
      row(name, time_ms([&] {
            for (int d = 0; d < 2; ++d) {
              CK(cudaSetDevice(d));
              CK(cudaError_t(pmg_allreduce_average(&peers, max_bytes, d, 2, n, PMG_FLOAT32,
                                                   PMG_ALGO_CE, 2 * sms, timeout, st[d],
                                                   chunk_mib << 20, copy[d], ev[d])));
            }
          }), bytes);
    }
  }
  return 0;
}
