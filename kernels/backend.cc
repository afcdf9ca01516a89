#include "kernels/backend.h"

#include "absl/strings/str_cat.h"

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

}  // namespace canzona
