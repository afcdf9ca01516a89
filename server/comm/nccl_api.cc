// The parts of nccl_api.h that need no CUDA (every build).
#include "server/comm/nccl_api.h"

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/base/poll.h"
#include "kernels/base/status_macros.h"

namespace canzona {

std::string NcclUniqueId::ToHex() const {
  return absl::BytesToHexString(absl::string_view(bytes.data(), bytes.size()));
}

absl::StatusOr<NcclUniqueId> NcclUniqueId::FromHex(const std::string& hex) {
  NcclUniqueId id;
  if (hex.size() != 2 * id.bytes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL unique id: expected ", 2 * id.bytes.size(),
                     " hex digits, got ", hex.size()));
  }
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError("NCCL unique id: not a hex string");
    }
  }
  std::string raw = absl::HexStringToBytes(hex);
  for (size_t i = 0; i < id.bytes.size(); ++i) id.bytes[i] = raw[i];
  return id;
}

const char* NcclDataTypeName(NcclDataType dtype) {
  switch (dtype) {
    case NcclDataType::kFloat32:
      return "float32";
    case NcclDataType::kBFloat16:
      return "bfloat16";
    case NcclDataType::kFloat16:
      return "float16";
  }
  return "unknown";
}

NcclDataType ToNcclDataType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return NcclDataType::kFloat32;
    case DType::kBFloat16:
      return NcclDataType::kBFloat16;
    case DType::kFloat16:
      return NcclDataType::kFloat16;
  }
  return NcclDataType::kFloat32;
}

DType FromNcclDataType(NcclDataType dtype) {
  switch (dtype) {
    case NcclDataType::kFloat32:
      return DType::kFloat32;
    case NcclDataType::kBFloat16:
      return DType::kBFloat16;
    case NcclDataType::kFloat16:
      return DType::kFloat16;
  }
  return DType::kFloat32;
}

absl::StatusOr<bool> EventDoneBy(NcclApi& api, NcclEvent event,
                                 absl::Time deadline) {
  bool done = false;
  CANZONA_RETURN_IF_ERROR(PollUntilDone([&]() -> absl::StatusOr<bool> {
    CANZONA_ASSIGN_OR_RETURN(done, api.EventQuery(event));
    return done || absl::Now() >= deadline;
  }));
  return done;
}

}  // namespace canzona
