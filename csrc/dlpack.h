/* The DLPack 0.x ABI (data structures only), as pympgu exports and imports it.
 * Written from the DLPack specification; the layout is fixed by that specification. */
#ifndef PYMPGU_DLPACK_H
#define PYMPGU_DLPACK_H
#include <stdint.h>

typedef enum { kDLCPU = 1, kDLCUDA = 2 } DLDeviceType;
typedef enum { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4 } DLDataTypeCode;

typedef struct {
  int32_t device_type;
  int32_t device_id;
} DLDevice;

typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
#endif
