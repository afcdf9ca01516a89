#include "server/comm/comm_args.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace canzona::comm_args {
namespace {

// Byte counts reach Gloo as size_t and offsets as int64: keep a total well
// inside both so no product overflows.
constexpr int64_t kMaxElements = std::numeric_limits<int64_t>::max() / 16;

absl::Status CheckCounts(const char* op, const char* field, int size,
                         absl::Span<const int64_t> counts) {
  if (static_cast<int64_t>(counts.size()) != size) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", field, " has ", counts.size(),
                     " entries but the group has ", size, " ranks"));
  }
  int64_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": ", field, "[", i, "] is negative (", counts[i], ")"));
    }
    total += counts[i];
    if (total > kMaxElements) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": ", field, " sums to more than ", kMaxElements, " elements"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPointer(const char* op, const char* field, const void* ptr,
                          int64_t elements) {
  if (ptr == nullptr && elements > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", field, " is null but addresses ", elements, " elements"));
  }
  return absl::OkStatus();
}

absl::Status CheckCount(const char* op, int64_t count) {
  if (count < 0 || count > kMaxElements) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": count is out of range (", count, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t Total(absl::Span<const int64_t> counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

int64_t Offset(absl::Span<const int64_t> counts, int index) {
  int64_t offset = 0;
  for (int i = 0; i < index; ++i) offset += counts[i];
  return offset;
}

void SumInRankOrder(DType dtype, absl::Span<const void* const> parts, int64_t n,
                    void* out) {
  if (n == 0 || parts.empty()) return;
  if (dtype == DType::kFloat32) {
    float* sum = static_cast<float*>(out);
    std::memcpy(sum, parts[0], static_cast<size_t>(n) * sizeof(float));
    for (size_t q = 1; q < parts.size(); ++q) {
      const float* part = static_cast<const float*>(parts[q]);
      for (int64_t i = 0; i < n; ++i) sum[i] += part[i];
    }
    return;
  }
  std::vector<float> sum(n), part(n);
  WidenToFloat(dtype, parts[0], n, sum.data());
  for (size_t q = 1; q < parts.size(); ++q) {
    WidenToFloat(dtype, parts[q], n, part.data());
    for (int64_t i = 0; i < n; ++i) sum[i] += part[i];
  }
  RoundFromFloat(sum.data(), n, dtype, out);
}

absl::Status CheckReduceScatterV(int rank, int size, const void* send,
                                 absl::Span<const int64_t> counts,
                                 const void* recv) {
  constexpr char kOp[] = "ReduceScatterV";
  if (absl::Status s = CheckCounts(kOp, "counts", size, counts); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckPointer(kOp, "send", send, Total(counts));
      !s.ok()) {
    return s;
  }
  return CheckPointer(kOp, "recv", recv, counts[rank]);
}

absl::Status CheckAllGatherV(int rank, int size, const void* send,
                             absl::Span<const int64_t> counts,
                             const void* recv) {
  constexpr char kOp[] = "AllGatherV";
  if (absl::Status s = CheckCounts(kOp, "counts", size, counts); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckPointer(kOp, "send", send, counts[rank]); !s.ok()) {
    return s;
  }
  return CheckPointer(kOp, "recv", recv, Total(counts));
}

absl::Status CheckAllToAllV(int rank, int size, const float* send,
                            absl::Span<const int64_t> send_counts,
                            const float* recv,
                            absl::Span<const int64_t> recv_counts) {
  constexpr char kOp[] = "AllToAllV";
  if (absl::Status s = CheckCounts(kOp, "send_counts", size, send_counts);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckCounts(kOp, "recv_counts", size, recv_counts);
      !s.ok()) {
    return s;
  }
  if (send_counts[rank] != recv_counts[rank]) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": send_counts[", rank, "] (", send_counts[rank],
        ") differs from recv_counts[", rank, "] (", recv_counts[rank],
        "): what rank ", rank, " sends itself is what it receives"));
  }
  if (absl::Status s = CheckPointer(kOp, "send", send, Total(send_counts));
      !s.ok()) {
    return s;
  }
  return CheckPointer(kOp, "recv", recv, Total(recv_counts));
}

absl::Status CheckAllReduce(const float* data, int64_t count) {
  constexpr char kOp[] = "AllReduce";
  if (absl::Status s = CheckCount(kOp, count); !s.ok()) return s;
  return CheckPointer(kOp, "data", data, count);
}

absl::Status CheckBroadcast(int size, const float* data, int64_t count,
                            int root) {
  constexpr char kOp[] = "Broadcast";
  if (root < 0 || root >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": root ", root, " is not a rank of a group of ", size));
  }
  if (absl::Status s = CheckCount(kOp, count); !s.ok()) return s;
  return CheckPointer(kOp, "data", data, count);
}

}  // namespace canzona::comm_args
