// The backend factory: the one place that knows every implementation, so
// that code written against the Backend interface alone (canzona_backend)
// links neither BLAS nor CUDA.
#include "kernels/backend.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"

namespace canzona {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind,
                                                       int device) {
  switch (kind) {
    case BackendKind::kCpu:
      return CreateCpuBackend();
    case BackendKind::kCuda:
      return CreateCudaBackend(device);
  }
  return absl::InvalidArgumentError("backend: unknown kind");
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackendByName(
    absl::string_view name, int device) {
  if (name == "auto") {
    auto cuda = CreateCudaBackend(device);
    if (cuda.ok()) return cuda;
    return CreateCpuBackend();
  }
  absl::StatusOr<BackendKind> kind = ParseBackendKind(name);
  if (!kind.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backend: unknown value \"", name, "\" (expected auto, cpu or cuda)"));
  }
  return CreateBackend(*kind, device);
}

}  // namespace canzona
