// The NCCL communicator's results on FakeNcclApi's simulated data (host
// memory as device memory, every rank on a thread) against float64
// references, per uneven strategy; a missing or stuck peer; and the real
// NcclApi existing exactly in CUDA builds.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/comm/nccl_api.h"
#include "server/comm/nccl_communicator.h"
#include "server/control/kv_store.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/comm_test_util.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/comm/nccl_communicator_test_util.h"

namespace canzona::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

// --- Results on simulated data ----------------------------------------------

// A group of `size` communicators over one data-mode fake.
class SimGroup {
 public:
  SimGroup(int size, const NcclOptions& options)
      : api_({.simulate_data = true}), comms_(size) {
    RunOnRanks(size, [&](int r) {
      auto c = CreateNcclCommunicator(
          &store_, "sim", &api_,
          {.rank = r, .device = r, .stream = FakeNcclApi::Stream(r)}, size,
          options);
      ASSERT_OK(c);
      comms_[r] = *std::move(c);
    });
  }
  Communicator* comm(int r) { return comms_[r].get(); }
  FakeNcclApi& api() { return api_; }

 private:
  FakeNcclApi api_;
  InMemoryKvStore store_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

std::vector<double> RefReduceScatterV64(const Buffers& send,
                                        const std::vector<int64_t>& counts,
                                        int rank) {
  int64_t off = 0;
  for (int q = 0; q < rank; ++q) off += counts[q];
  std::vector<double> out(counts[rank], 0.0);
  for (const auto& buf : send) {
    for (int64_t i = 0; i < counts[rank]; ++i) out[i] += buf[off + i];
  }
  return out;
}

void ExpectEqualTo64(const float* got, const std::vector<double>& want,
                     const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i], static_cast<float>(want[i])) << what << " at " << i;
  }
}

class NcclSimulatedDataTest : public ::testing::TestWithParam<NcclUneven> {};

TEST_P(NcclSimulatedDataTest, CollectivesMatchFloat64References) {
  constexpr int kSize = 4;
  SimGroup group(kSize, Forced(GetParam()));
  std::mt19937 rng(1234 + static_cast<int>(GetParam()));
  for (int trial = 0; trial < 6; ++trial) {
    // Uneven with a zero, then even.
    std::vector<int64_t> counts = trial < 4 ? RandomCounts(rng, kSize, 40)
                                            : std::vector<int64_t>(kSize, 9);
    const int64_t total = Sum(counts);
    Buffers send(kSize), rs_out(kSize), ag_out(kSize);
    for (int r = 0; r < kSize; ++r) send[r] = ExactRandom(rng, total);
    // AllToAllV: send_counts[i][j] random; recv mirrored.
    std::vector<std::vector<int64_t>> a2a(kSize);
    for (int i = 0; i < kSize; ++i) a2a[i] = RandomCounts(rng, kSize, 7);
    Buffers a2a_send(kSize), a2a_out(kSize);
    for (int i = 0; i < kSize; ++i) a2a_send[i] = ExactRandom(rng, Sum(a2a[i]));
    Buffers ar(kSize);
    for (int r = 0; r < kSize; ++r) ar[r] = ExactRandom(rng, 33);
    const Buffers ar_in = ar;
    Buffers inplace = send;  // ReduceScatterV with recv == send

    RunOnRanks(kSize, [&](int r) {
      Communicator* c = group.comm(r);
      rs_out[r].assign(counts[r], -1.0f);
      ASSERT_OK(c->ReduceScatterV(send[r].data(), counts, rs_out[r].data()));
      ASSERT_OK(
          c->ReduceScatterV(inplace[r].data(), counts, inplace[r].data()));
      ag_out[r].assign(total, -1.0f);
      ASSERT_OK(c->AllGatherV(rs_out[r].data(), counts, ag_out[r].data()));
      std::vector<int64_t> recv_counts(kSize);
      for (int i = 0; i < kSize; ++i) recv_counts[i] = a2a[i][r];
      a2a_out[r].assign(Sum(recv_counts), -1.0f);
      ASSERT_OK(c->AllToAllV(a2a_send[r].data(), a2a[r], a2a_out[r].data(),
                             recv_counts));
      ASSERT_OK(c->AllReduce(ar[r].data(), 33));
      ASSERT_OK(c->Barrier());
    });

    std::vector<double> full;
    for (int r = 0; r < kSize; ++r) {
      std::vector<double> want = RefReduceScatterV64(send, counts, r);
      ExpectEqualTo64(rs_out[r].data(), want, "ReduceScatterV");
      ExpectEqualTo64(inplace[r].data(), want, "in-place ReduceScatterV");
      full.insert(full.end(), want.begin(), want.end());
    }
    for (int r = 0; r < kSize; ++r) {
      ExpectEqualTo64(ag_out[r].data(), full, "AllGatherV");
      EXPECT_EQ(a2a_out[r], RefAllToAllV(a2a_send, a2a, r));
      std::vector<double> sum(33, 0.0);
      for (int q = 0; q < kSize; ++q) {
        for (int i = 0; i < 33; ++i) sum[i] += ar_in[q][i];
      }
      ExpectEqualTo64(ar[r].data(), sum, "AllReduce");
    }
  }
}

TEST_P(NcclSimulatedDataTest, InPlaceAllGatherAndBroadcast) {
  constexpr int kSize = 3;
  SimGroup group(kSize, Forced(GetParam()));
  std::mt19937 rng(77);
  const std::vector<int64_t> counts = {6, 0, 11};
  Buffers slices = {ExactRandom(rng, 6), {}, ExactRandom(rng, 11)};
  Buffers bufs(kSize, std::vector<float>(17, -1.0f));
  Buffers bc(kSize);
  for (int r = 0; r < kSize; ++r) bc[r] = ExactRandom(rng, 5);
  const std::vector<float> root_data = bc[2];
  RunOnRanks(kSize, [&](int r) {
    int64_t off = 0;
    for (int q = 0; q < r; ++q) off += counts[q];
    std::copy(slices[r].begin(), slices[r].end(), bufs[r].begin() + off);
    ASSERT_OK(group.comm(r)->AllGatherV(bufs[r].data() + off, counts,
                                        bufs[r].data()));
    ASSERT_OK(group.comm(r)->Broadcast(bc[r].data(), 5, 2));
  });
  for (int r = 0; r < kSize; ++r) {
    EXPECT_EQ(bufs[r], RefAllGatherV(slices));
    EXPECT_EQ(bc[r], root_data);
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, NcclSimulatedDataTest,
                         ::testing::Values(NcclUneven::kPerRoot,
                                           NcclUneven::kPadded),
                         [](const auto& info) {
                           return std::string(NcclUnevenName(info.param));
                         });

TEST(NcclSimulatedDataTest, AMissingPeerTimesOutOnTheRanksThatCame) {
  FakeNcclApi api({.simulate_data = true});
  InMemoryKvStore store;
  std::vector<std::unique_ptr<Communicator>> comms(2);
  RunOnRanks(2, [&](int r) {
    auto c = CreateNcclCommunicator(
        &store, "late", &api,
        {.rank = r, .device = r, .stream = FakeNcclApi::Stream(r)}, 2,
        Options(absl::Milliseconds(100)));
    ASSERT_OK(c);
    comms[r] = *std::move(c);
  });
  std::vector<float> data(3, 1.0f);
  EXPECT_THAT(
      comms[0]->AllReduce(data.data(), 3),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("AllReduce")));
}

TEST(NcclSimulatedDataTest, APeerStuckInItsLaunchTimesOutTheOthers) {
  FakeNcclApi api({.simulate_data = true});
  InMemoryKvStore store;
  std::vector<std::unique_ptr<Communicator>> comms(2);
  RunOnRanks(2, [&](int r) {
    auto c = CreateNcclCommunicator(
        &store, "stuck", &api,
        {.rank = r, .device = r, .stream = FakeNcclApi::Stream(r)}, 2,
        Options(absl::Milliseconds(100)));
    ASSERT_OK(c);
    comms[r] = *std::move(c);
  });
  std::vector<float> a(3, 1.0f), b(3, 2.0f);
  // Rank 0's launch never finishes (it is aborted at its deadline); rank 1
  // then enters the same collective and cannot complete it either.
  api.SetNeverReady(true);
  EXPECT_THAT(comms[0]->AllReduce(a.data(), 3),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  api.SetNeverReady(false);
  EXPECT_THAT(comms[1]->AllReduce(b.data(), 3),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(b, ElementsAre(2, 2, 2));
  EXPECT_THAT(api.calls_named("ncclCommAbort"), SizeIs(2));
}

TEST(RealNcclApiTest, ExistsExactlyInCudaBuilds) {
#ifdef CANZONA_ENABLE_CUDA
  // Only the object: no call reaches the driver (tests/gpu runs it).
  ASSERT_OK_AND_ASSIGN(NcclApi * api, RealNcclApi());
  EXPECT_NE(api, nullptr);
#else
  EXPECT_THAT(RealNcclApi(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                      HasSubstr("CANZONA_ENABLE_CUDA=OFF")));
#endif
}

}  // namespace
}  // namespace canzona::testing
