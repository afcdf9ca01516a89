#include "server/comm/nccl_uneven.h"

#include <algorithm>
#include <cstdint>

namespace canzona {

const char* NcclUnevenName(NcclUneven strategy) {
  switch (strategy) {
    case NcclUneven::kPerRoot:
      return "per_root";
    case NcclUneven::kPadded:
      return "padded";
  }
  return "unknown";
}

NcclUneven ChooseUneven(absl::Span<const int64_t> counts,
                        const NcclCostModel& cost) {
  int64_t nonzero = 0;
  int64_t max = 0;
  int64_t total = 0;
  for (int64_t c : counts) {
    if (c > 0) ++nonzero;
    max = std::max(max, c);
    total += c;
  }
  if (nonzero < 2 || !(cost.bytes_per_us > 0.0)) return NcclUneven::kPerRoot;
  const double pad_bytes =
      static_cast<double>(sizeof(float)) *
      (static_cast<double>(counts.size()) * static_cast<double>(max) -
       static_cast<double>(total));
  const double pad_us = pad_bytes / cost.bytes_per_us;
  const double saved_us = static_cast<double>(nonzero - 1) * cost.launch_us;
  return pad_us < saved_us ? NcclUneven::kPadded : NcclUneven::kPerRoot;
}

}  // namespace canzona
