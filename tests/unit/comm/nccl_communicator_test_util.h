// What the NCCL communicator tests share (nccl_communicator_test.cc,
// nccl_communicator_lifetime_test.cc, nccl_communicator_data_test.cc):
// options with reserved scratch, a forced uneven strategy, and one rank of
// a nominal group alone on a record-only FakeNcclApi.
#ifndef CANZONA_TESTS_UNIT_COMM_NCCL_COMMUNICATOR_TEST_UTIL_H_
#define CANZONA_TESTS_UNIT_COMM_NCCL_COMMUNICATOR_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <ostream>
#include <utility>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/comm/nccl_api.h"
#include "server/comm/nccl_communicator.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"

namespace canzona {

// Test names and failure messages print the strategy's name.
inline void PrintTo(NcclUneven strategy, std::ostream* os) {
  *os << NcclUnevenName(strategy);
}

namespace testing {

// Scratch for every padded or staged collective of these tests (the
// largest: 4 ranks x 40 floats).
inline constexpr int64_t kScratchFloats = 4096;

inline NcclOptions Options(absl::Duration timeout = absl::Seconds(10)) {
  NcclOptions options;
  options.timeout = timeout;
  options.scratch_floats = kScratchFloats;
  return options;
}

inline NcclOptions Forced(NcclUneven strategy) {
  NcclOptions options = Options();
  options.chooser = [strategy](absl::Span<const int64_t>) { return strategy; };
  return options;
}

// `rank`'s non-blocking NCCL communicator of a group of `size` whose other
// ranks joined too (on a record-only fake they never take part in anything
// else), so that its initialization can finish.
inline NcclComm InitRank(FakeNcclApi& api, int rank, int size) {
  absl::StatusOr<NcclUniqueId> id = api.GetUniqueId();
  EXPECT_OK(id);
  NcclComm mine = nullptr;
  for (int r = 0; r < size; ++r) {
    EXPECT_OK(api.SetDevice(r));  // a GPU per rank, as NCCL needs
    absl::StatusOr<NcclComm> comm =
        api.CommInitRank(size, *id, r, /*blocking=*/false);
    EXPECT_OK(comm);
    if (r == rank) mine = *comm;
  }
  EXPECT_OK(api.SetDevice(rank));
  return mine;
}

// One rank of a nominal group, alone on a record-only fake.
inline std::unique_ptr<NcclCommunicator> Solo(FakeNcclApi& api, int rank,
                                              int size,
                                              const NcclOptions& options) {
  auto c = NcclCommunicator::Create(
      &api, InitRank(api, rank, size),
      {.rank = rank, .device = rank, .stream = FakeNcclApi::Stream(0)}, size,
      options);
  EXPECT_OK(c);
  api.ClearCalls();
  return std::move(*c);
}

}  // namespace testing
}  // namespace canzona

#endif  // CANZONA_TESTS_UNIT_COMM_NCCL_COMMUNICATOR_TEST_UTIL_H_
