// A fake CUDA runtime (libcudart.so.<FAKE_CUDART_MAJOR>, FAKE_CUDART) and
// driver (libcuda.so.1, FAKE_LIBCUDA) with just the entry points the
// clients' CUDA IPC export calls, so that its tests check signatures,
// struct layouts and logic without a GPU: canzona/_cuda.py through ctypes
// (tests/python/test_client.py) and client/lib/cuda_export.cc through
// dlopen (tests/unit/client/cuda_export_fake_test.cc). The runtime has no
// call newer than CUDA 12.0. Device 1 has two allocations; pointers are
// numbers, never dereferenced:
//   kIpcBase:  1 MiB of cudaMalloc memory (legacy-IPC capable)
//   kVmmBase:  4 KiB of a virtual-memory mapping (not legacy-IPC capable)
// cudaIpcGetMemHandle works only on an allocation's base with device 1
// current, as the real one needs the owning context; an event is made,
// recorded and waited for with its device current. The current device is
// per thread, as CUDA's is. fake_cudart_major() and fake_cudart_calls()
// tell a test which runtime a client used.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

static const uint64_t kIpcBase = 0x7f0000000000ull;
static const uint64_t kIpcSize = 1u << 20;
static const uint64_t kVmmBase = 0x7f0000200000ull;
static const uint64_t kVmmSize = 4096;

// The allocation holding ptr: its base and size; 0 when none.
static int Allocation(uint64_t ptr, uint64_t* base, uint64_t* size) {
  if (ptr >= kIpcBase && ptr < kIpcBase + kIpcSize) {
    *base = kIpcBase;
    *size = kIpcSize;
    return 1;
  }
  if (ptr >= kVmmBase && ptr < kVmmBase + kVmmSize) {
    *base = kVmmBase;
    *size = kVmmSize;
    return 1;
  }
  return 0;
}

#ifdef FAKE_CUDART
struct PointerAttributes {
  int type;
  int device;
  void* device_pointer;
  void* host_pointer;
  long reserved[8];
};

#ifndef FAKE_CUDART_MAJOR
#define FAKE_CUDART_MAJOR 13
#endif

struct IpcHandle {
  char reserved[64];
};

static __thread int current_device = 0;
static int calls = 0;  // atomic builtins: any thread may call
#define CALLED() __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST)

EXPORT int fake_cudart_major(void) { return FAKE_CUDART_MAJOR; }
EXPORT int fake_cudart_calls(void) {
  return __atomic_load_n(&calls, __ATOMIC_SEQ_CST);
}

EXPORT const char* cudaGetErrorString(int err) {
  CALLED();
  switch (err) {
    case 1:
      return "invalid argument";
    case 101:
      return "invalid device ordinal";
    case 400:
      return "invalid resource handle";
    default:
      return "unknown error";
  }
}

EXPORT int cudaPointerGetAttributes(struct PointerAttributes* attributes,
                                    const void* ptr) {
  uint64_t base, size;
  CALLED();
  memset(attributes, 0, sizeof(*attributes));
  if (Allocation((uint64_t)(uintptr_t)ptr, &base, &size)) {
    attributes->type = 2;  // cudaMemoryTypeDevice
    attributes->device = 1;
    attributes->device_pointer = (void*)ptr;
  }
  return 0;  // host memory: cudaMemoryTypeUnregistered, no error
}

EXPORT int cudaGetDevice(int* device) {
  CALLED();
  *device = current_device;
  return 0;
}

EXPORT int cudaSetDevice(int device) {
  CALLED();
  if (device < 0 || device > 1) return 101;
  current_device = device;
  return 0;
}

EXPORT int cudaIpcGetMemHandle(char handle[64], void* ptr) {
  uint64_t base, size;
  CALLED();
  if (current_device != 1 ||
      !Allocation((uint64_t)(uintptr_t)ptr, &base, &size) ||
      base != (uint64_t)(uintptr_t)ptr) {
    return 1;
  }
  memset(handle, 0, 64);
  snprintf(handle, 64, "fake-ipc:%llx", (unsigned long long)base);
  return 0;
}

EXPORT int cudaDeviceGetPCIBusId(char* bus_id, int length, int device) {
  CALLED();
  if (device < 0 || device > 1) return 101;
  snprintf(bus_id, (size_t)length, "0000:%02X:00.0", 0x3B + device);
  return 0;
}

// Events: heap cells holding their device.
EXPORT int cudaEventCreateWithFlags(void** event, unsigned flags) {
  CALLED();
  if (flags != (0x02 | 0x04)) return 1;  // DisableTiming | Interprocess
  int* device = malloc(sizeof(int));
  *device = current_device;
  *event = device;
  return 0;
}

EXPORT int cudaEventDestroy(void* event) {
  CALLED();
  free(event);
  return 0;
}

EXPORT int cudaIpcGetEventHandle(char handle[64], void* event) {
  CALLED();
  memset(handle, 0, 64);
  snprintf(handle, 64, "fake-event:%d", *(int*)event);
  return 0;
}

EXPORT int cudaIpcOpenEventHandle(void** event, struct IpcHandle handle) {
  CALLED();
  if (strncmp(handle.reserved, "fake-event:", 11) != 0) return 1;
  int* device = malloc(sizeof(int));
  *device = current_device;
  *event = device;
  return 0;
}

EXPORT int cudaEventRecord(void* event, void* stream) {
  (void)stream;
  CALLED();
  return *(int*)event == current_device ? 0 : 400;  // invalid handle
}

EXPORT int cudaStreamWaitEvent(void* stream, void* event, unsigned flags) {
  (void)stream;
  CALLED();
  if (flags != 0) return 1;
  return *(int*)event == current_device ? 0 : 400;
}
#endif  // FAKE_CUDART

#ifdef FAKE_LIBCUDA
EXPORT int cuMemGetAddressRange_v2(uint64_t* base, size_t* size, uint64_t ptr) {
  uint64_t b, s;
  if (!Allocation(ptr, &b, &s)) return 1;  // CUDA_ERROR_INVALID_VALUE
  *base = b;
  *size = (size_t)s;
  return 0;
}

EXPORT int cuPointerGetAttribute(void* data, int attribute, uint64_t ptr) {
  uint64_t base, size;
  if (attribute != 10 || !Allocation(ptr, &base, &size)) return 1;
  *(int*)data = base == kIpcBase;  // IS_LEGACY_CUDA_IPC_CAPABLE
  return 0;
}
#endif  // FAKE_LIBCUDA
