#include "server/engine/single_rank_communicator.h"

#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace canzona {
namespace {

class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }

  // The float forms stay visible beside the typed overrides.
  using Communicator::AllGatherV;
  using Communicator::ReduceScatterV;
  absl::Status ReduceScatterVTyped(DType dtype, const void* send,
                                   absl::Span<const int64_t> counts,
                                   void* recv) override {
    if (auto s = Check("ReduceScatterV", counts); !s.ok()) return s;
    Copy(send, counts[0] * DTypeBytes(dtype), recv);
    return absl::OkStatus();
  }
  absl::Status AllGatherVTyped(DType dtype, const void* send,
                               absl::Span<const int64_t> counts,
                               void* recv) override {
    if (auto s = Check("AllGatherV", counts); !s.ok()) return s;
    Copy(send, counts[0] * DTypeBytes(dtype), recv);
    return absl::OkStatus();
  }
  absl::Status AllToAllV(const float* send,
                         absl::Span<const int64_t> send_counts, float* recv,
                         absl::Span<const int64_t> recv_counts) override {
    if (auto s = Check("AllToAllV", send_counts); !s.ok()) return s;
    if (recv_counts.size() != 1 || recv_counts[0] != send_counts[0]) {
      return absl::InvalidArgumentError(
          "AllToAllV: recv_counts must mirror send_counts");
    }
    Copy(send, send_counts[0] * sizeof(float), recv);
    return absl::OkStatus();
  }
  absl::Status AllReduce(float*, int64_t count) override {
    return CheckCount("AllReduce", count);
  }
  absl::Status Broadcast(float*, int64_t count, int root) override {
    if (root != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Broadcast: root ", root, " outside [0, 1)"));
    }
    return CheckCount("Broadcast", count);
  }
  absl::Status Barrier() override { return CheckCount("Barrier", 0); }
  void Abort() override { aborted_ = true; }

 private:
  absl::Status CheckCount(const char* op, int64_t count) {
    if (aborted_) {
      return absl::FailedPreconditionError(
          absl::StrCat(op, ": communicator aborted"));
    }
    if (count < 0) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": negative count"));
    }
    return absl::OkStatus();
  }
  absl::Status Check(const char* op, absl::Span<const int64_t> counts) {
    if (counts.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": counts must have 1 entry"));
    }
    return CheckCount(op, counts[0]);
  }
  static void Copy(const void* from, int64_t bytes, void* to) {
    if (bytes > 0 && from != to) std::memmove(to, from, bytes);
  }

  std::atomic<bool> aborted_{false};
};

}  // namespace

std::unique_ptr<Communicator> CreateSingleRankCommunicator() {
  return std::make_unique<SingleRankCommunicator>();
}

}  // namespace canzona
