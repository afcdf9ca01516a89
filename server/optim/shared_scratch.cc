#include "server/optim/shared_scratch.h"

#include <algorithm>

#include "kernels/base/status_macros.h"

namespace canzona {

absl::StatusOr<float*> SharedScratch::Take(int64_t count) {
  if (blocks_.empty() || used_ + count > blocks_.back().size()) {
    const int64_t size =
        std::max(used_ + count, blocks_.empty() ? int64_t{0}
                                                : 2 * blocks_.back().size());
    CANZONA_ASSIGN_OR_RETURN(DeviceBuffer block, backend_->Allocate(size));
    blocks_.push_back(std::move(block));
    // The rule's earlier requests stay in the old block; this one and its
    // later ones go to the new.
    used_ = 0;
  }
  float* at = blocks_.back().data() + used_;
  used_ += count;
  return at;
}

int64_t SharedScratch::bytes() const {
  int64_t floats = 0;
  for (const DeviceBuffer& b : blocks_) floats += b.size();
  return floats * static_cast<int64_t>(sizeof(float));
}

}  // namespace canzona
