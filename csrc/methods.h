// The all-reduce methods inside a node, each in a file of its own (oneshot.cu, twoshot.cu,
// push.cu, ll.cu, ce.cu), and the one table that names them (methods.cu). A new method is its
// file, an entry in that table, one in pympgu/methods.py, and its test case
// (docs/DECISIONS.md, "Extension points").
#ifndef PYMPGU_METHODS_H
#define PYMPGU_METHODS_H
#include <cuda_runtime.h>

#include "pympgu.h"

// What a method is asked: average the first n elements of dtype of every rank's data, in
// place, every rank calling alike. copy_stream and event: the copy engines' (ce alone).
struct pmg_call {
  const pmg_peers *peers;
  size_t stage_offset;  // from data to the staging area (staged methods)
  int rank, nranks;
  size_t n;
  int dtype, max_blocks;
  uint64_t timeout_ns;
  cudaStream_t stream;
  size_t chunk_bytes;
  cudaStream_t copy_stream;
  cudaEvent_t event;
};

using pmg_launcher = int (*)(const pmg_call &);

struct pmg_method {
  int algo;              // its pmg_algo
  const char *name;      // as pympgu/methods.py names it
  pmg_launcher launch;
  int staged;            // needs every rank's staging area (pmg_stage_bytes)
  int copy_engines;      // needs copy_stream and event
  size_t max_bytes;      // the most bytes it averages (0: any)
};

// The entry of algo, or NULL.
const pmg_method *pmg_find_method(int algo);

int pmg_launch_oneshot(const pmg_call &c);
int pmg_launch_twoshot(const pmg_call &c);
int pmg_launch_push(const pmg_call &c);
int pmg_launch_ll(const pmg_call &c);
int pmg_launch_ce(const pmg_call &c);

// local.cu's average of replicas this process addresses, on at most max_blocks blocks.
int pmg_launch_local_average(const pmg_tensor &d, int nranks, int dtype, int max_blocks,
                             cudaStream_t stream);
#endif
