// The DP collectives of a rank's buckets alone: two DP ranks as threads over
// an in-process fake group, the trainers' buffers in real shared memory.
#include "server/engine/bucket_collectives.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "server/comm/fake_communicator.h"
#include "server/engine/local_communicator.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/parts_test_util.h"

namespace canzona::engine_test {
namespace {

constexpr int kDp = 2;

// One DP rank: its trainer, mapped buffers, staging and collectives.
struct DpRank {
  std::unique_ptr<TrainerRank> trainer;
  std::unique_ptr<TrainerBuffers> buffers;
  RankLayout layout;
  std::unique_ptr<Backend> backend;
  DeviceBuffer grads, params;
  std::unique_ptr<BucketCollectives> collectives;
};

class BucketCollectivesTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    config_ = MakeJobConfig("bc", kDp, /*tp=*/1, GetParam());
    ASSERT_OK_AND_ASSIGN(jp_, PlanOf(config_));
    for (int d = 0; d < kDp; ++d) {
      DpRank& r = ranks_[d];
      r.trainer = std::make_unique<TrainerRank>(config_, d);
      ASSERT_OK(r.trainer->Init());
      r.trainer->WriteGrads(1);
      ASSERT_OK_AND_ASSIGN(RankSpec spec, ValidateRegisterRequest(
                                              r.trainer->MakeRegister(), {}));
      ASSERT_OK_AND_ASSIGN(r.layout,
                           LayoutRank(*jp_, spec.settings, spec.coords));
      ASSERT_OK_AND_ASSIGN(
          r.buffers,
          TrainerBuffers::Map(r.trainer->MakeRegister(), spec.local_numel, {}));
      ASSERT_OK_AND_ASSIGN(r.backend, CreateBackend(BackendKind::kCpu));
      ASSERT_OK_AND_ASSIGN(r.grads,
                           r.backend->Allocate(r.layout.stage_elements));
      ASSERT_OK_AND_ASSIGN(r.params,
                           r.backend->Allocate(r.layout.stage_elements));
      BucketCollectives::Parts parts;
      parts.copier = CreateHostStageCopier();
      parts.dp = group_.TakeCommunicator(d);
      parts.cross = CreateLocalCommunicator();
      parts.calibration = std::make_unique<UnevenCalibration>();
      ASSERT_OK_AND_ASSIGN(parts.slice,
                           r.backend->Allocate(r.layout.max_slice));
      if (!r.layout.layerwise_counts.empty()) {
        ASSERT_OK_AND_ASSIGN(parts.packed,
                             r.backend->Allocate(r.layout.layerwise_counts[d]));
        ASSERT_OK_AND_ASSIGN(parts.gathered,
                             r.backend->Allocate(r.layout.layerwise_total));
      }
      BucketCollectives::Staging staging;
      staging.plan = jp_;
      staging.layout = &r.layout;
      staging.trainer = r.buffers.get();
      staging.grads = r.grads.data();
      staging.params = r.params.data();
      staging.who = absl::StrCat("dp ", d);
      r.collectives = std::make_unique<BucketCollectives>(std::move(staging),
                                                          std::move(parts));
    }
  }

  // Runs f(rank) for every bucket on both DP ranks concurrently.
  void OnBothRanks(const std::function<absl::Status(DpRank&, int)>& f,
                   const std::vector<int>& order) {
    std::vector<absl::Status> results(kDp);
    std::vector<std::thread> threads;
    for (int d = 0; d < kDp; ++d) {
      threads.emplace_back([&, d] {
        for (int b : order) {
          results[d] = f(ranks_[d], b);
          if (!results[d].ok()) return;
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const absl::Status& s : results) ASSERT_OK(s);
  }

  std::vector<int> Buckets() const {
    std::vector<int> all;
    for (size_t b = 0; b < ranks_[0].layout.buckets.size(); ++b) {
      all.push_back(static_cast<int>(b));
    }
    return all;
  }

  JobConfig config_;
  std::shared_ptr<const JobPlan> jp_;
  FakeCommunicatorGroup group_{kDp};
  DpRank ranks_[kDp];
};

TEST_P(BucketCollectivesTest, ReduceSumsWhatEachRankMustHold) {
  OnBothRanks([](DpRank& r, int b) { return r.collectives->Reduce(b); },
              Buckets());
  for (int d = 0; d < kDp; ++d) {
    const RankLayout& layout = ranks_[d].layout;
    for (const BucketLayout& b : layout.buckets) {
      const int64_t begin = layout.sliced ? b.my_start : 0;
      const int64_t end = layout.sliced ? b.my_start + b.counts[d] : b.elements;
      for (int i : jp_->plan.buckets[b.index].params) {
        const int64_t n = jp_->params[i].local_numel;
        const int64_t at = layout.offset[i] - b.base;
        const bool mine = at >= begin && at < end;
        EXPECT_EQ(mine, !layout.sliced || jp_->plan.dp_owner[i] == d)
            << jp_->params[i].name;
        if (!mine) continue;
        const float* staged = ranks_[d].grads.data() + layout.offset[i];
        const auto* trainer_params =
            static_cast<const float*>(ranks_[d].buffers->param(i));
        for (int64_t k = 0; k < n; ++k) {
          const float sum =
              static_cast<const float*>(ranks_[0].buffers->grad(i))[k] +
              static_cast<const float*>(ranks_[1].buffers->grad(i))[k];
          ASSERT_EQ(staged[k], sum) << jp_->params[i].name << "[" << k << "]";
          ASSERT_EQ(ranks_[d].params.data()[layout.offset[i] + k],
                    trainer_params[k]);
        }
      }
    }
  }
}

TEST_P(BucketCollectivesTest, GatherPublishesTheOwnersParameters) {
  OnBothRanks([](DpRank& r, int b) { return r.collectives->Reduce(b); },
              Buckets());
  // Each owner "updates" what it owns: param <- -(d + 1) - element index.
  for (int d = 0; d < kDp; ++d) {
    for (int i : ranks_[d].layout.local_params) {
      if (!ranks_[d].layout.dp_owned[i]) continue;
      if (jp_->plan.dp_owner[i] >= 0 && jp_->plan.dp_owner[i] != d) continue;
      float* p = ranks_[d].params.data() + ranks_[d].layout.offset[i];
      for (int64_t k = 0; k < jp_->params[i].local_numel; ++k) {
        p[k] = -static_cast<float>(jp_->plan.dp_owner[i] < 0 ? 1 : d + 1) -
               static_cast<float>(k);
      }
    }
  }
  OnBothRanks([](DpRank& r, int b) { return r.collectives->Gather(b); },
              ranks_[0].layout.gather_order);
  for (int d = 0; d < kDp; ++d) {
    for (size_t i = 0; i < jp_->params.size(); ++i) {
      const int owner = jp_->plan.dp_owner[i];
      const auto* p = static_cast<const float*>(
          ranks_[d].buffers->param(static_cast<int>(i)));
      for (int64_t k = 0; k < jp_->params[i].local_numel; ++k) {
        ASSERT_EQ(p[k], -static_cast<float>(owner < 0 ? 1 : owner + 1) -
                            static_cast<float>(k))
            << "rank " << d << " " << jp_->params[i].name << "[" << k << "]";
      }
    }
  }
  // Sliced: one reduce-scatter per bucket, then one all-gather per bucket
  // in gather order, the same sequence on both ranks.
  if (ranks_[0].layout.sliced) {
    const std::vector<FakeCommCall> calls = group_.calls(0);
    const size_t buckets = ranks_[0].layout.buckets.size();
    ASSERT_EQ(calls.size(), 2 * buckets);
    for (size_t b = 0; b < buckets; ++b) {
      EXPECT_EQ(calls[b].op, "ReduceScatterV");
      EXPECT_EQ(calls[buckets + b].op, "AllGatherV");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, BucketCollectivesTest,
                         ::testing::Values("cost", "sc", "layerwise"));

}  // namespace
}  // namespace canzona::engine_test
