// Thin wrappers over the CUDA runtime: each returns the cudaError_t as an int and never
// prints, so the Cython layer turns every failure into one pympgu.CudaError.
#include <cuda_runtime.h>

#include <cstring>

#include "pympgu.h"

extern "C" {

const char *pmg_error_name(int status) {
  const char *own = pmg_status_name(status);
  if (own == nullptr) own = pmg_nccl_status_name(status);
  return own ? own : cudaGetErrorName(static_cast<cudaError_t>(status));
}

const char *pmg_error_string(int status) {
  const char *own = pmg_status_string(status);
  if (own == nullptr) own = pmg_nccl_status_string(status);
  return own ? own : cudaGetErrorString(static_cast<cudaError_t>(status));
}

void pmg_clear_last_error(void) { (void)cudaGetLastError(); }

int pmg_runtime_version(int *version) { return cudaRuntimeGetVersion(version); }
int pmg_driver_version(int *version) { return cudaDriverGetVersion(version); }
int pmg_get_device_count(int *count) { return cudaGetDeviceCount(count); }
int pmg_get_device(int *device) { return cudaGetDevice(device); }
int pmg_set_device(int device) { return cudaSetDevice(device); }

int pmg_device_name(int device, char *name, size_t len) {
  cudaDeviceProp prop;
  cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) return err;
  if (len == 0) return PMG_ERR_INVALID_ARGUMENT;
  std::strncpy(name, prop.name, len - 1);
  name[len - 1] = '\0';
  return 0;
}

int pmg_device_sm_count(int device, int *count) {
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
}

int pmg_device_synchronize(void) { return cudaDeviceSynchronize(); }

int pmg_pointer_device(const void *ptr, int *device) {
  cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) return err;
  *device = (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) ? attr.device : -1;
  return 0;
}

int pmg_can_access_peer(int device, int peer, int *can) {
  return cudaDeviceCanAccessPeer(can, device, peer);
}

int pmg_enable_peer_access(int peer) {
  cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // this "error" is success for us: enabling is idempotent
    return 0;
  }
  return err;
}

int pmg_malloc(void **ptr, size_t nbytes) { return cudaMalloc(ptr, nbytes); }
int pmg_free(void *ptr) { return cudaFree(ptr); }
int pmg_host_alloc(void **ptr, size_t nbytes) { return cudaMallocHost(ptr, nbytes); }
int pmg_host_free(void *ptr) { return cudaFreeHost(ptr); }
int pmg_host_register(void *ptr, size_t nbytes, void **device_ptr) {
  // Portable: mapped for every context of this process, whichever device is current later.
  cudaError_t err =
      cudaHostRegister(ptr, nbytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (err == cudaSuccess && (err = cudaHostGetDevicePointer(device_ptr, ptr, 0)) != cudaSuccess)
    cudaHostUnregister(ptr);
  return err;
}
int pmg_host_unregister(void *ptr) { return cudaHostUnregister(ptr); }

int pmg_memset_async(void *ptr, int value, size_t nbytes, cudaStream_t stream) {
  return cudaMemsetAsync(ptr, value, nbytes, stream);
}

int pmg_memcpy_async(void *dst, const void *src, size_t nbytes, cudaStream_t stream) {
  return cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream);
}

int pmg_memcpy_peer_async(void *dst, int dst_device, const void *src, int src_device,
                          size_t nbytes, cudaStream_t stream) {
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, nbytes, stream);
}

int pmg_ipc_get_handle(void *base, void *handle) {
  cudaIpcMemHandle_t h;
  static_assert(sizeof(h) == PMG_IPC_HANDLE_BYTES, "CUDA IPC handles are 64 bytes");
  cudaError_t err = cudaIpcGetMemHandle(&h, base);
  if (err == cudaSuccess) std::memcpy(handle, &h, sizeof(h));
  return err;
}

int pmg_ipc_open_handle(const void *handle, void **ptr) {
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  // Lazy peer access: the mapping works whether or not this process enabled P2P itself.
  return cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
}

int pmg_ipc_close_handle(void *ptr) { return cudaIpcCloseMemHandle(ptr); }

int pmg_stream_create(cudaStream_t *stream, int high_priority) {
  // Non-blocking: the exchange must not serialise against other libraries' legacy stream.
  int least = 0, greatest = 0;
  if (high_priority) {
    if (cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest)) return err;
  }
  return cudaStreamCreateWithPriority(stream, cudaStreamNonBlocking, high_priority ? greatest : 0);
}
int pmg_stream_destroy(cudaStream_t stream) { return cudaStreamDestroy(stream); }
int pmg_stream_synchronize(cudaStream_t stream) { return cudaStreamSynchronize(stream); }

int pmg_event_create(cudaEvent_t *event, int timing) {
  return cudaEventCreateWithFlags(event, timing ? cudaEventDefault : cudaEventDisableTiming);
}
int pmg_event_destroy(cudaEvent_t event) { return cudaEventDestroy(event); }
int pmg_event_record(cudaEvent_t event, cudaStream_t stream) {
  return cudaEventRecord(event, stream);
}
int pmg_event_synchronize(cudaEvent_t event) { return cudaEventSynchronize(event); }
int pmg_stream_wait_event(cudaStream_t stream, cudaEvent_t event) {
  return cudaStreamWaitEvent(stream, event, 0);
}

int pmg_stream_wait(cudaStream_t consumer, cudaStream_t producer) {
  // A fresh event each time: cudaStreamWaitEvent captures the work recorded so far, and
  // destroying the event while the wait is pending is allowed (resources go when it fires).
  cudaEvent_t event;
  cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (err != cudaSuccess) return err;
  err = cudaEventRecord(event, producer);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(consumer, event, 0);
  cudaError_t destroyed = cudaEventDestroy(event);
  return err != cudaSuccess ? err : destroyed;
}
int pmg_event_elapsed_ms(cudaEvent_t start, cudaEvent_t end, float *ms) {
  return cudaEventElapsedTime(ms, start, end);
}

}  // extern "C"
