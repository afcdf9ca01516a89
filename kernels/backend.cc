#include "kernels/backend.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"

namespace canzona {

absl::string_view BackendKindName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kCpu:
      return "cpu";
    case BackendKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name) {
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(absl::StrCat(
      "backend: unknown value \"", name, "\" (expected cpu or cuda)"));
}

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
