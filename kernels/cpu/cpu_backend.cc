#include "kernels/cpu/cpu_backend.h"

namespace canzona {
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend() {
  return absl::UnimplementedError("cpu backend: not yet built");
}
}  // namespace canzona
