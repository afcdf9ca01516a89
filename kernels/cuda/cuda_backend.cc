// Stand-in for builds without CUDA: no device, ever.
#include "kernels/cuda/cuda_backend.h"

namespace canzona {

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  return absl::FailedPreconditionError(
      "no usable CUDA device: this build has no CUDA support "
      "(CANZONA_ENABLE_CUDA=OFF)");
}

int CudaDeviceCount() { return 0; }

}  // namespace canzona
