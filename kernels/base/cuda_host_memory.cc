#include "kernels/base/cuda_host_memory.h"

#include <cuda_runtime_api.h>

namespace canzona {

bool CudaHostPageable(const void* p) {
  cudaPointerAttributes attributes;
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it for the next call
    return false;
  }
  return attributes.type == cudaMemoryTypeUnregistered;
}

}  // namespace canzona
