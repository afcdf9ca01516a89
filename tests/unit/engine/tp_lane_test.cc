// The TP lane alone (TP owner variant): two TP ranks as threads over an
// in-process fake group; a compute that adds each gathered gradient
// fragment to its parameter fragment, so every TP-owned fragment must come
// back to its own rank updated. Also: no thread is started per step.
#include "server/engine/tp_lane.h"

#include <dirent.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/comm/fake_communicator.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/parts_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;

constexpr int kTp = 2;

int ThreadsOfThisProcess() {
  int n = 0;
  if (DIR* dir = ::opendir("/proc/self/task")) {
    while (dirent* e = ::readdir(dir)) n += e->d_name[0] != '.';
    ::closedir(dir);
  }
  return n;
}

struct TpRank {
  RankLayout layout;
  std::unique_ptr<Backend> backend;
  // Stage-sized stand-ins for the owned buffers, at layout.offset.
  DeviceBuffer grads, params;
  OwnedBuffers owned;
  std::unique_ptr<TpLane> lane;
};

class TpLaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = MakeJobConfig("tp", /*dp=*/1, kTp, "cost");
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> planned,
                         PlanOf(config_));
    // The tiny model fits one micro group; one group per matrix makes the
    // lane run its two-deep pipeline.
    auto split = std::make_shared<JobPlan>(*planned);
    split->plan.micro_groups.clear();
    for (const plan::MicroGroup& g : planned->plan.micro_groups) {
      for (int p : g.params)
        split->plan.micro_groups.push_back({g.stage, g.dp, {p}});
    }
    jp_ = split;
    for (int t = 0; t < kTp; ++t) {
      TpRank& r = ranks_[t];
      ASSERT_OK_AND_ASSIGN(RankSpec spec, SpecOf(config_, t));
      ASSERT_OK_AND_ASSIGN(r.layout,
                           LayoutRank(*jp_, spec.settings, spec.coords));
      ASSERT_OK_AND_ASSIGN(r.backend, CreateBackend(BackendKind::kCpu));
      ASSERT_OK_AND_ASSIGN(r.grads,
                           r.backend->Allocate(r.layout.stage_elements));
      ASSERT_OK_AND_ASSIGN(r.params,
                           r.backend->Allocate(r.layout.stage_elements));
      r.owned.grad_at.assign(jp_->params.size(), nullptr);
      r.owned.param_at.assign(jp_->params.size(), nullptr);
      for (int i : r.layout.stage_params) {
        r.owned.grad_at[i] = r.grads.data() + r.layout.offset[i];
        r.owned.param_at[i] = r.params.data() + r.layout.offset[i];
      }
      TpLane::Parts parts;
      parts.copier = CreateHostStagingCopier(&r.backend->allocations());
      parts.tp.comm = group_.TakeCommunicator(t);
      for (const GroupLayout& g : r.layout.groups) {
        GroupBuffers b;
        ASSERT_OK_AND_ASSIGN(b.send, r.backend->Allocate(2 * g.local));
        ASSERT_OK_AND_ASSIGN(b.recv,
                             r.backend->Allocate(2 * g.tp_owned_here * kTp));
        ASSERT_OK_AND_ASSIGN(b.back,
                             r.backend->Allocate(g.tp_owned_here * kTp));
        ASSERT_OK_AND_ASSIGN(b.back_in, r.backend->Allocate(g.local));
        parts.buffers.push_back(std::move(b));
      }
      TpLane::Staging staging;
      staging.plan = jp_;
      staging.layout = &r.layout;
      staging.owned = &r.owned;
      staging.backend = r.backend.get();
      r.lane = TpLane::CreateHost(std::move(staging), std::move(parts));
    }
    ASSERT_GE(ranks_[0].lane->groups(), 2) << "the model must need a pipeline";
  }

  // Fresh staging values: gradient and parameter of (rank, element).
  void Fill(int round) {
    for (int t = 0; t < kTp; ++t) {
      for (int64_t k = 0; k < ranks_[t].layout.stage_elements; ++k) {
        ranks_[t].grads.data()[k] = static_cast<float>(round * 1000 + t + k);
        ranks_[t].params.data()[k] = static_cast<float>(-k) - 0.5f;
      }
    }
  }

  // On the TP owner: back fragment = gathered param + gathered grad.
  absl::Status AddGradients(TpRank& r, int i) {
    GroupBuffers& b = r.lane->buffers(i);
    const GroupLayout& g = r.layout.groups[i];
    int64_t at = 0;
    for (int p : g.group->params) {
      if (jp_->plan.tp_owner[p] != r.layout.tp_rank) continue;
      const int64_t n = jp_->params[p].fragment_numel;
      for (int j = 0; j < kTp; ++j) {
        const float* frag = b.recv.data() + 2 * g.tp_owned_here * j + 2 * at;
        float* out = b.back.data() + g.tp_owned_here * j + at;
        for (int64_t k = 0; k < n; ++k) out[k] = frag[n + k] + frag[k];
      }
      at += n;
    }
    return absl::OkStatus();
  }

  std::vector<absl::Status> RunBoth(int* threads_seen = nullptr) {
    std::vector<absl::Status> results(kTp);
    std::vector<std::thread> threads;
    for (int t = 0; t < kTp; ++t) {
      threads.emplace_back([&, t] {
        PhaseSeconds times;
        results[t] = ranks_[t].lane->Run(
            [&, t](int i) {
              if (threads_seen != nullptr && t == 0 && i == 0) {
                *threads_seen = ThreadsOfThisProcess();
              }
              return AddGradients(ranks_[t], i);
            },
            &times);
        if (results[t].ok()) {
          EXPECT_GT(times.tp_gather, 0);
          EXPECT_GT(times.tp_scatter, 0);
        }
      });
    }
    for (auto& th : threads) th.join();
    return results;
  }

  JobConfig config_;
  std::shared_ptr<const JobPlan> jp_;
  FakeCommunicatorGroup group_{kTp};
  TpRank ranks_[kTp];
};

TEST_F(TpLaneTest, HostedFragmentsComeBackUpdatedStepAfterStep) {
  for (int round = 1; round <= 3; ++round) {
    Fill(round);
    for (const absl::Status& s : RunBoth()) ASSERT_OK(s);
    for (int t = 0; t < kTp; ++t) {
      const RankLayout& layout = ranks_[t].layout;
      for (const GroupLayout& g : layout.groups) {
        for (int p : g.group->params) {
          for (int64_t k = 0; k < jp_->params[p].fragment_numel; ++k) {
            const int64_t at = layout.offset[p] + k;
            ASSERT_EQ(ranks_[t].params.data()[at],
                      static_cast<float>(-at) - 0.5f +
                          static_cast<float>(round * 1000 + t + at))
                << "round " << round << " rank " << t << " "
                << jp_->params[p].name;
          }
        }
      }
    }
  }
  // Gathers and scatters alternate as the two-deep pipeline issues them.
  const std::vector<FakeCommCall> calls = group_.calls(0);
  ASSERT_EQ(calls.size(), 3u * 2 * ranks_[0].lane->groups());
  for (const FakeCommCall& c : calls) EXPECT_EQ(c.op, "AllToAllV");
}

TEST_F(TpLaneTest, NoThreadIsStartedForAStep) {
  Fill(1);
  const int before = ThreadsOfThisProcess();
  int during = 0;
  // (Two rank threads run the lanes here.)
  for (const absl::Status& s : RunBoth(&during)) ASSERT_OK(s);
  EXPECT_EQ(during, before + kTp);
}

TEST_F(TpLaneTest, ACommunicationFailureEndsTheStepOnEveryRank) {
  Fill(1);
  group_.InjectFailure(1, "AllToAllV", absl::UnavailableError("link down"));
  for (const absl::Status& s : RunBoth()) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable));
  }
}

}  // namespace
}  // namespace canzona::engine_test
