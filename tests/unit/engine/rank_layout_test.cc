// The plan-to-rank translation alone, checked across every rank of a job:
// offsets, slice cuts at parameter boundaries, each element counted once,
// one state holder per matrix, and micro-group exchanges that match.
#include "server/engine/rank_layout.h"

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/optim/update_rule.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/parts_test_util.h"

namespace canzona::engine_test {
namespace {

using Case = std::tuple<int, int, std::string, int>;  // dp, tp, strategy, S

class RankLayoutTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const auto& [dp, tp, strategy, shard] = GetParam();
    config_ = MakeJobConfig("layout", dp, tp, strategy);
    config_.shard_group_size = shard;
    ASSERT_OK_AND_ASSIGN(spec_, SpecOf(config_, 0));
    ASSERT_OK_AND_ASSIGN(jp_, PlanOf(config_));
    for (int g = 0; g < config_.world(); ++g) {
      ASSERT_OK_AND_ASSIGN(RankSpec spec, SpecOf(config_, g));
      ASSERT_OK_AND_ASSIGN(RankLayout layout,
                           LayoutRank(*jp_, spec.settings, spec.coords));
      layouts_.push_back(std::move(layout));
    }
  }
  JobConfig config_;
  RankSpec spec_;
  std::shared_ptr<const JobPlan> jp_;
  std::vector<RankLayout> layouts_;  // by global rank (pp = 1)
};

TEST_P(RankLayoutTest, ParametersAreLaidOutContiguouslyInBucketOrder) {
  for (const RankLayout& layout : layouts_) {
    int64_t next = 0;
    for (const BucketLayout& b : layout.buckets) {
      EXPECT_EQ(b.base, next);
      for (int i : jp_->plan.buckets[b.index].params) {
        EXPECT_EQ(layout.offset[i], next) << jp_->params[i].name;
        next += jp_->params[i].fragment_numel;
      }
      EXPECT_EQ(next, b.base + b.elements);
      int64_t even = 0;
      for (int64_t c : b.even_counts) even += c;
      EXPECT_EQ(even, b.elements);
    }
    EXPECT_EQ(next, layout.stage_elements);
    EXPECT_EQ(layout.stage_params.size(), jp_->params.size());
    ASSERT_EQ(layout.gather_order.size(), layout.buckets.size());
    for (size_t k = 0; k < layout.gather_order.size(); ++k) {
      EXPECT_EQ(layout.gather_order[k],
                static_cast<int>(layout.buckets.size() - 1 - k));
    }
  }
}

TEST_P(RankLayoutTest, SlicesAreCutAtParameterBoundaries) {
  for (const RankLayout& layout : layouts_) {
    if (!layout.sliced) continue;
    for (const BucketLayout& b : layout.buckets) {
      ASSERT_EQ(static_cast<int>(b.counts.size()), layout.shard_size);
      std::set<int64_t> starts = {b.elements};
      for (int i : jp_->plan.buckets[b.index].params) {
        starts.insert(layout.offset[i] - b.base);
      }
      int64_t at = 0;
      for (int r = 0; r < layout.shard_size; ++r) {
        EXPECT_TRUE(starts.count(at)) << "slice " << r << " starts at " << at;
        if (r == layout.shard_pos) EXPECT_EQ(b.my_start, at);
        at += b.counts[r];
      }
      EXPECT_EQ(at, b.elements);
      EXPECT_LE(b.counts[layout.shard_pos], layout.max_slice);
    }
  }
}

TEST_P(RankLayoutTest, EveryElementIsCountedOnceJobWide) {
  std::vector<int64_t> counted(jp_->params.size(), 0);
  for (const RankLayout& layout : layouts_) {
    for (int i : layout.stage_params) {
      if (layout.counted[i]) counted[i] += jp_->params[i].fragment_numel;
      // Counted only where the gradient is summed and owned.
      if (layout.counted[i]) EXPECT_TRUE(layout.dp_owned[i]);
    }
  }
  for (size_t i = 0; i < jp_->params.size(); ++i) {
    EXPECT_EQ(counted[i], jp_->params[i].numel) << jp_->params[i].name;
  }
}

TEST_P(RankLayoutTest, EachMatrixHasOneWholeStateHolderPerDpOwner) {
  const int TP = config_.tp;
  for (size_t i = 0; i < jp_->params.size(); ++i) {
    const ParamMeta& m = jp_->params[i];
    // Per shard position (a DP owner), how many TP ranks hold what.
    std::map<int, int> whole, any;
    for (const RankLayout& layout : layouts_) {
      if (layout.shard_group != 0) continue;
      const std::vector<int64_t>& shape = layout.state_shape[i];
      if (shape.empty()) continue;
      ++any[layout.shard_pos];
      if (shape == m.shape) ++whole[layout.shard_pos];
      EXPECT_TRUE(layout.dp_owned[i]);
      EXPECT_LE(NumElements(shape), layout.max_state);
    }
    ASSERT_FALSE(any.empty()) << m.name << " has no state anywhere";
    for (const auto& [position, n] : any) {
      const int pos = position;  // (clang 14 cannot capture bindings)
      const UpdateMode mode = [&] {
        for (const RankLayout& l : layouts_) {
          if (l.shard_pos == pos) return l.mode[i];
        }
        return layouts_[0].mode[i];
      }();
      switch (mode) {
        case UpdateMode::kTpOwned:
          EXPECT_EQ(whole[pos], 1) << m.name;
          EXPECT_EQ(n, 1) << m.name;
          break;
        case UpdateMode::kRedundant:
          EXPECT_EQ(whole[pos], TP) << m.name;
          break;
        case UpdateMode::kDpOwned:
          EXPECT_EQ(n, TP) << m.name;  // every TP rank its own tensor
          break;
      }
    }
  }
}

TEST_P(RankLayoutTest, MicroGroupExchangesMatchAcrossTpRanks) {
  const int TP = config_.tp;
  // The TP group of (dp position d): global ranks d * TP + t.
  for (int d = 0; d < config_.dp; ++d) {
    const RankLayout& first = layouts_[d * TP];
    for (int t = 0; t < TP; ++t) {
      const RankLayout& mine = layouts_[d * TP + t];
      ASSERT_EQ(mine.groups.size(), first.groups.size());
      for (size_t k = 0; k < mine.groups.size(); ++k) {
        EXPECT_EQ(mine.groups[k].group, first.groups[k].group);
        for (int h = 0; h < TP; ++h) {
          const GroupLayout& host = layouts_[d * TP + h].groups[k];
          // What t sends to h is what h expects from t, both ways.
          EXPECT_EQ(mine.groups[k].send_counts[h], host.recv_counts[t]);
          EXPECT_EQ(host.back_send[t], mine.groups[k].back_recv[h]);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, RankLayoutTest,
    ::testing::Values(Case{1, 1, "cost", 0}, Case{2, 2, "cost", 0},
                      Case{2, 2, "sc", 0}, Case{2, 2, "layerwise", 0},
                      Case{1, 4, "alpha", 0}, Case{4, 1, "start_anchored", 0},
                      Case{4, 2, "cost", 2}));

TEST(RankLayoutErrorTest, AStageOutsideThePlanIsInternal) {
  const JobConfig config = MakeJobConfig("layout", 1, 1, "cost");
  ASSERT_OK_AND_ASSIGN(RankSpec spec, SpecOf(config, 0));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> jp, PlanOf(config));
  spec.coords.set_pp_rank(1);
  EXPECT_THAT(LayoutRank(*jp, spec.settings, spec.coords),
              ::canzona::testing::StatusIs(absl::StatusCode::kInternal));
}

}  // namespace
}  // namespace canzona::engine_test
