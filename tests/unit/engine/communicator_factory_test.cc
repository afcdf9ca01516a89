// Creating a rank's process groups: Gloo over the control plane, a local
// communicator for one rank, NCCL over a fake library, the metrics wrapper,
// and errors that name the group.
#include "server/engine/communicator_factory.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/canzona_metrics.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

CommunicatorFactory::Options Gloo(KvStore* kv, MetricsRegistry* metrics,
                                  int rank) {
  CommunicatorFactory::Options o;
  o.control = kv;
  o.job_id = "jf";
  o.rank_label = std::to_string(rank);
  o.timeout = absl::Seconds(10);
  o.metrics = metrics;
  return o;
}

// The staging memory the copiers check ranges against: none is allocated
// here, so every range is host memory outside it.
const AllocationRegistry host_memory;

TEST(CommunicatorFactoryTest, OneRankGlooGroupsNeedNoRendezvous) {
  InMemoryKvStore kv;
  MetricsRegistry metrics;
  auto copier = CreateHostStagingCopier(&host_memory);
  const CommunicatorFactory factory(Gloo(&kv, &metrics, 0));
  ASSERT_OK_AND_ASSIGN(MadeCommunicator made,
                       factory.Make("tp.0.0", 0, 1, *copier));
  EXPECT_EQ(made.comm->size(), 1);
  EXPECT_EQ(made.counting, nullptr);
  EXPECT_EQ(made.nccl, nullptr);
  float x = 3;
  EXPECT_OK(made.comm->AllReduce(&x, 1));
  EXPECT_EQ(x, 3);
  EXPECT_THAT(kv.Keys(), IsEmpty());
}

TEST(CommunicatorFactoryTest, GlooGroupsRendezvousUnderTheJobAndCountBytes) {
  InMemoryKvStore kv;
  MetricsRegistry metrics;
  std::vector<MadeCommunicator> made(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto copier = CreateHostStagingCopier(&host_memory);
      const CommunicatorFactory factory(Gloo(&kv, &metrics, r));
      absl::StatusOr<MadeCommunicator> m =
          factory.Make("dp.0.0", r, 2, *copier);
      ASSERT_OK(m.status());
      made[r] = *std::move(m);
      std::vector<float> data(100, static_cast<float>(r + 1));
      ASSERT_OK(made[r].comm->AllReduce(data.data(), 100));
      EXPECT_EQ(data[99], 3.0f);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(absl::c_all_of(kv.Keys(), [](const std::string& k) {
    return absl::StartsWith(k, "canzona/job/jf/comm/dp.0.0/");
  }));
  ASSERT_NE(made[0].counting, nullptr);
  const CanzonaMetrics m = CanzonaMetrics::Register(&metrics);
  // A ring all-reduce of 100 floats over 2 ranks sends 2 (n-1)/n of them.
  EXPECT_DOUBLE_EQ(
      m.comm_sent_bytes_total->WithLabels({"jf", "0", "all_reduce"})->Value(),
      400.0);
}

TEST(CommunicatorFactoryTest, NcclGroupsRunOnTheCopiersStream) {
  InMemoryKvStore kv;
  ::canzona::testing::FakeNcclApi nccl;
  ASSERT_OK_AND_ASSIGN(
      auto copier,
      CreateDeviceStagingCopier(&nccl, 0, absl::Seconds(5), &host_memory));
  CommunicatorFactory::Options o = Gloo(&kv, nullptr, 0);
  o.nccl = &nccl;
  const CommunicatorFactory factory(o);
  ASSERT_OK_AND_ASSIGN(MadeCommunicator made,
                       factory.Make("world", 0, 1, *copier));
  ASSERT_NE(made.nccl, nullptr);
  EXPECT_EQ(made.nccl->stream(), copier->stream());
  EXPECT_TRUE(absl::c_any_of(kv.Keys(), [](const std::string& k) {
    return absl::StartsWith(k, "canzona/job/jf/nccl/world");
  }));
}

TEST(CommunicatorFactoryTest, FailuresNameTheGroup) {
  InMemoryKvStore kv;
  auto copier = CreateHostStagingCopier(&host_memory);
  CommunicatorFactory::Options o = Gloo(&kv, nullptr, 0);
  o.timeout = absl::Milliseconds(200);
  const CommunicatorFactory factory(o);
  // The peer never comes.
  EXPECT_THAT(factory.Make("dp.0.1", 0, 2, *copier).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("creating the dp.0.1 group")));
}

}  // namespace
}  // namespace canzona
