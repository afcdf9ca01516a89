#include "server/engine/state_transfer.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"

namespace canzona {

absl::StatusOr<v1::ExportStateResponse> StateTransfer::Read(
    const v1::ExportStateRequest& request,
    const std::function<absl::StatusOr<v1::ExportStateResponse>()>&
        export_whole) {
  if (request.max_bytes() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_bytes: ", request.max_bytes(), " must be >= 0 (0: the default)"));
  }
  const int64_t offset = request.offset();
  if (offset < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset: ", offset, " must be >= 0"));
  }
  if (offset == 0) {
    exported_.reset();
    CANZONA_ASSIGN_OR_RETURN(exported_, export_whole());
  } else if (!exported_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("offset: ", offset,
                     ", but no export of this rank is being read (export "
                     "from offset 0 first)"));
  }
  const std::string& whole = exported_->state();
  const int64_t total = static_cast<int64_t>(whole.size());
  if (offset > total || (offset == total && offset > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "offset: ", offset, " lies outside the exported ", total, " bytes"));
  }
  const int64_t limit = request.max_bytes() == 0
                            ? total
                            : std::min(request.max_bytes(), kMaxPartBytes);
  const int64_t size = std::min(limit, total - offset);
  v1::ExportStateResponse part;
  part.set_step(exported_->step());
  part.set_plan_digest(exported_->plan_digest());
  part.set_records(exported_->records());
  part.set_offset(offset);
  part.set_total_bytes(total);
  part.set_state(whole.substr(offset, size));
  if (offset + size == total) exported_.reset();
  return part;
}

absl::StatusOr<std::optional<v1::ImportStateRequest>> StateTransfer::Add(
    const v1::ImportStateRequest& part) {
  const int64_t size = static_cast<int64_t>(part.state().size());
  if (part.total_bytes() == 0) {
    if (part.offset() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("offset: ", part.offset(),
                       " without total_bytes (a whole blob "
                       "starts at 0)"));
    }
    importing_.reset();
    return part;
  }
  if (part.total_bytes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("total_bytes: ", part.total_bytes(), " must be >= 0"));
  }
  if (part.offset() == 0) {
    if (size > part.total_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state: ", size, " bytes exceed total_bytes ", part.total_bytes()));
    }
    importing_ = part;
  } else {
    if (!importing_.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("offset: ", part.offset(),
                       ", but no import of this rank is under "
                       "way (start at offset 0)"));
    }
    const int64_t expected = static_cast<int64_t>(importing_->state().size());
    if (part.offset() != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "offset: ", part.offset(), ", the next part starts at ", expected));
    }
    if (part.total_bytes() != importing_->total_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "total_bytes: ", part.total_bytes(),
          ", the import's first part said ", importing_->total_bytes()));
    }
    if (part.step() != importing_->step()) {
      return absl::InvalidArgumentError(
          absl::StrCat("step: ", part.step(), ", the import's first part said ",
                       importing_->step()));
    }
    if (part.plan_digest() != importing_->plan_digest()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan_digest: ", part.plan_digest(),
          ", the import's first part said ", importing_->plan_digest()));
    }
    if (expected + size > part.total_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("state: ", expected + size, " bytes exceed total_bytes ",
                       part.total_bytes()));
    }
    importing_->mutable_state()->append(part.state());
  }
  if (static_cast<int64_t>(importing_->state().size()) <
      importing_->total_bytes()) {
    return std::nullopt;
  }
  std::optional<v1::ImportStateRequest> whole = std::move(importing_);
  importing_.reset();
  return whole;
}

int64_t StateTransfer::received_bytes() const {
  return importing_.has_value()
             ? static_cast<int64_t>(importing_->state().size())
             : 0;
}

}  // namespace canzona
