#include "server/engine/engine_options.h"

#include "kernels/cuda/cuda_backend.h"

namespace canzona {

int NodeCudaDevices(const EngineOptions& options) {
  return options.cuda_devices >= 0 ? options.cuda_devices : CudaDeviceCount();
}

}  // namespace canzona
