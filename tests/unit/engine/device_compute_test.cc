// cuda compute with host (Gloo) staging, without a GPU: the cpu backend
// stands in for the GPU (device-like memory the host cannot touch, copies
// to the host landing only at the next wait) beside host staging
// (EngineOptions::device_like_cpu), as on a machine whose ranks share GPUs
// over Gloo. Checked: every strategy and layout, fp32 and bf16 trainers,
// shared-memory and CUDA IPC trainer buffers, steps bitwise equal to the
// single-process reference; and OwnedDeviceCopy's copies: one each way for
// the owned gradients and the master weights (not one per matrix), the
// host ranges page-locked once (no copy to or from the GPU meets pageable
// memory during a step: JobRun::RunSteps), the values back only after the
// wait.
#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/base/dtype.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/pageable_copies.h"
#include "server/engine/owned_buffers.h"
#include "server/engine/owned_device_copy.h"
#include "server/engine/rank_layout.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/engine/engine_test_util.h"
#include "tests/unit/engine/parts_test_util.h"
#include "tests/unit/engine/single_threaded_blas.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::FakeNcclApi;
using ::canzona::testing::IsOkAndHolds;

constexpr int kSteps = 4;

struct Case {
  std::string name;
  int dp, tp;
  std::string strategy;
  DType dtype = DType::kFloat32;
  bool cuda_ipc = false;
  int shard_group_size = 0;
  // The trainer's "parameters written" event: host staging writes with
  // synchronous copies and never records it.
  bool params_event = false;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class DeviceComputeEngineTest : public ::testing::TestWithParam<Case> {};

TEST_P(DeviceComputeEngineTest, StepsAreBitwiseEqualToTheReference) {
  const Case& c = GetParam();
  FakeCudaIpc ipc;
  // The CUDA runtime's calls beside the Gloo plane: host staging is
  // page-locked through it, so the steps check that no copy to or from the
  // GPU's copy meets pageable memory (JobRun::RunSteps); a GPU trainer's
  // gradients event is snapshotted at each GradReady.
  FakeNcclApi cuda({.simulate_data = true});
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu",
                  c.cuda_ipc ? &ipc : nullptr, &cuda,
                  /*batch_updates=*/true, /*device_like_cpu=*/true,
                  /*gloo=*/true);
  JobConfig config =
      MakeJobConfig("dev-" + c.name, c.dp, c.tp, c.strategy,
                    c.strategy == "cost" ? MoeModel(4) : MuonModel());
  config.dtype = c.dtype;
  config.cuda_ipc = c.cuda_ipc;
  config.shard_group_size = c.shard_group_size;
  config.params_event = c.params_event;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  // The parameters-written events are granted on the NCCL plane only.
  for (const v1::Bucket& bucket : run.registered[0].buckets()) {
    EXPECT_TRUE(bucket.params_event_handle().empty());
  }
  ASSERT_OK(run.RunSteps(cluster, 1, 2));
  ASSERT_OK(run.RunStepsOverlapped(cluster, 3, kSteps, /*shuffled=*/true, 5));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, kSteps, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  for (const auto& per_rank : run.responses) {
    ASSERT_FALSE(per_rank.empty());
    EXPECT_GT(per_rank.back().grad_norm(), 0);
    EXPECT_GT(per_rank.back().update_rms(), 0);
  }
  ASSERT_OK(run.Deregister(cluster));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, DeviceComputeEngineTest,
    ::testing::Values(
        Case{"one_rank", 1, 1, "cost"}, Case{"cost_dp2_tp2", 2, 2, "cost"},
        Case{"cost_dp2_bf16", 2, 1, "cost", DType::kBFloat16},
        Case{"cost_dp2_ipc", 2, 1, "cost", DType::kFloat32, true},
        Case{"cost_dp2_tp2_ipc_bf16", 2, 2, "cost", DType::kBFloat16, true},
        Case{"cost_dp2_ipc_params_event", 2, 1, "cost", DType::kBFloat16, true,
             0, true},
        Case{"sc_dp2_tp2", 2, 2, "sc"},
        Case{"layerwise_dp2_tp2", 2, 2, "layerwise"},
        Case{"cost_dp4_hierarchical", 4, 1, "cost", DType::kFloat32, false, 2}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// The gradients scaled, summed and clipped on the GPU's copy (and in host
// staging for the TP-owned fragments): torch's clip factor from the right
// norm, and a NaN on one rank skips the step everywhere, leaving the
// parameters and the state where a run without that step has them.
TEST(DeviceComputeStepTest, ClippingAndANonFiniteStep) {
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", nullptr, nullptr,
                  /*batch_updates=*/true, /*device_like_cpu=*/true);
  JobConfig config = MakeJobConfig("dev-clip", 2, 2, "cost", MoeModel(4));
  config.max_grad_norm = 0.5 * ReferenceGradNorm(config, 1);
  config.nan_step = 3;
  config.nan_global_rank = 3;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 5));
  for (int g = 0; g < config.world(); ++g) {
    for (int s = 1; s <= 5; ++s) {
      const v1::StepResponse& r = run.responses[g][s - 1];
      EXPECT_EQ(r.skipped_nonfinite(), s == 3) << "rank " << g << " step " << s;
      if (s == 3) continue;
      const double norm = ReferenceGradNorm(config, s);
      EXPECT_NEAR(r.grad_norm(), norm, 1e-5 * norm) << "step " << s;
      const double factor = std::min(1.0, config.max_grad_norm / (norm + 1e-6));
      EXPECT_NEAR(r.clip_factor(), factor, 1e-5 * factor) << "step " << s;
    }
  }
  EXPECT_LT(run.responses[0][0].clip_factor(), 1.0);
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 5, {3}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/false, 1e-5f));
  ASSERT_OK(run.Deregister(cluster));
}

// One rank's step with its updates on the GPU's copy of the owned
// buffers waits twice (StepResponse.host_waits): for the gradient sums
// the skip and clip decision reads (which also read the last step's update
// sizes) and for the updated values' copy back, whatever the number of
// parameters and buckets (before: once more for the update RMS).
TEST(DeviceComputeStepTest, OneRankStepWaitsTwice) {
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", nullptr, nullptr,
                  /*batch_updates=*/true, /*device_like_cpu=*/true);
  for (int64_t bucket_size : {int64_t{20000}, int64_t{1} << 30}) {
    SCOPED_TRACE(bucket_size);
    JobConfig config = MakeJobConfig("dev-waits", 1, 1, "cost", MuonModel());
    config.bucket_size = bucket_size;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RunAll(cluster, 3));
    for (const v1::StepResponse& r : run.responses[0]) {
      EXPECT_EQ(r.host_waits(), 2);
    }
    EXPECT_GT(run.responses[0].back().update_rms(), 0);
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
    ASSERT_OK(run.Deregister(cluster));
  }
}

// The TP owner's whole matrices cross to the GPU a micro group at a time:
// one copy each way and one wait per group that hosts any, not one per
// matrix (each rank of a DP1 x TP2 job hosts several matrices in a group).
TEST(DeviceComputeStepTest, TpOwnedUpdatesWaitOncePerMicroGroup) {
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", nullptr, nullptr,
                  /*batch_updates=*/true, /*device_like_cpu=*/true);
  JobConfig config = MakeJobConfig("dev-tp-waits", 1, 2, "cost", MoeModel(4));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> jp, PlanOf(config));
  std::vector<int> groups_hosting(config.world(), 0);
  int matrices = 0, groups = 0;
  for (int g = 0; g < config.world(); ++g) {
    ASSERT_OK_AND_ASSIGN(RankSpec spec, SpecOf(config, g));
    ASSERT_OK_AND_ASSIGN(RankLayout layout,
                         LayoutRank(*jp, spec.settings, spec.coords));
    for (const GroupLayout& group : layout.groups) {
      int here = 0;
      for (int i : group.group->params) {
        here += jp->plan.tp_owner[i] == layout.tp_rank ? 1 : 0;
      }
      groups_hosting[g] += here > 0 ? 1 : 0;
      matrices += here;
      groups += here > 0 ? 1 : 0;
    }
  }
  ASSERT_GT(matrices, groups) << "no micro group hosts two matrices on a rank";
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 3));
  for (int g = 0; g < config.world(); ++g) {
    for (const v1::StepResponse& r : run.responses[g]) {
      // The gradient sums, the DP-owned values' copy back, and one per group.
      EXPECT_EQ(r.host_waits(), 2 + groups_hosting[g]) << "rank " << g;
    }
  }
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster));
}

// Host staging that copies to the GPU is page-locked while the rank lives
// (here through a fake CUDA runtime): the owned gradients, the masters and
// the bucket slot of a DP2 job whose bf16 trainers export CUDA IPC
// buffers; unlocked once the ranks are gone.
TEST(DeviceComputeStepTest, HostStagingIsPageLockedWhileTheRankLives) {
  FakeNcclApi pin;
  FakeCudaIpc ipc;
  // Comm stays gloo: `pin` stands in for the CUDA runtime beside it, so the
  // steps check that no copy to or from the GPU's copy of the owned values
  // meets pageable memory (JobRun::RunSteps).
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &pin,
                  /*batch_updates=*/true, /*device_like_cpu=*/true,
                  /*gloo=*/true);
  // bf16 (through the conversions' scratch), and fp32 under layerwise
  // (parameters written from its gather's buffer).
  for (const auto& [strategy, dtype] :
       {std::pair{"cost", DType::kBFloat16},
        std::pair{"layerwise", DType::kFloat32}}) {
    SCOPED_TRACE(absl::StrCat(strategy, " ", DTypeName(dtype)));
    JobConfig config = MakeJobConfig("dev-pin", 2, 1, strategy, MoeModel(4));
    config.dtype = dtype;
    config.cuda_ipc = true;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    // Per rank: gradients, masters, slot, scratch, the layerwise gather's
    // buffer (and the whole matrices of TP-owned updates, none here), whole
    // pages, none twice.
    EXPECT_GE(pin.host_registered(), 2);
    EXPECT_LE(pin.host_registered(), 5 * config.world());
    // Every copy between the trainer's GPU memory and host staging is DMA,
    // the bf16 conversions' scratch included.
    ipc.pageable_copies = 0;
    ipc.pinned = [&pin](const void* p, size_t n) {
      return pin.HostRegistered(p, static_cast<int64_t>(n));
    };
    ASSERT_OK(run.RunSteps(cluster, 1, 3));
    EXPECT_GT(ipc.to_host.load(), 0);
    EXPECT_EQ(ipc.pageable_copies.load(), 0);
    EXPECT_THAT(run.ReportedPageableCopies(0), IsOkAndHolds(0));
    for (const v1::RegisterResponse& r : run.registered) {
      EXPECT_EQ(r.pageable_host_bytes(), 0);
    }
    ipc.pinned = nullptr;
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
    ASSERT_OK(run.Deregister(cluster));
    Eventually([&] { return pin.host_registered() == 0; }, absl::Seconds(15));
    EXPECT_EQ(pin.host_registered(), 0);
  }
}

// Where the driver refuses to page-lock host staging (a memlock limit too
// small), the steps still match the reference and each answer reports the
// rank's copies from and to pageable memory (StepResponse.pageable_copies):
// the compute backend's and the trainer's CUDA IPC copies, each one the
// process-wide count saw.
TEST(DeviceComputeStepTest, RanksReportCopiesFromPageableStaging) {
  FakeNcclApi pin;
  pin.RefuseHostRegister();
  FakeCudaIpc ipc;
  ipc.pinned = [&pin](const void* p, size_t n) {
    return pin.HostRegistered(p, static_cast<int64_t>(n));
  };
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &pin,
                  /*batch_updates=*/true, /*device_like_cpu=*/true,
                  /*gloo=*/true);
  cluster.page_locked = false;  // RunSteps: pageable copies are expected
  JobConfig config = MakeJobConfig("dev-unpinned", 2, 1, "cost", MoeModel(4));
  config.dtype = DType::kBFloat16;
  config.cuda_ipc = true;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  EXPECT_EQ(pin.host_registered(), 0);
  // Registration says so first: the owned gradients, masters, slot and
  // scratch the updates copy to the GPU and back.
  for (const v1::RegisterResponse& r : run.registered) {
    EXPECT_GE(r.pageable_host_bytes(), r.master_bytes());
  }
  const int64_t before = PageableCopies();
  ipc.pageable_copies = 0;
  ASSERT_OK(run.RunSteps(cluster, 1, 3));
  ASSERT_OK_AND_ASSIGN(int64_t reported, run.ReportedPageableCopies(1));
  EXPECT_EQ(reported, PageableCopies() - before) << LastPageableCopy();
  // The trainer's copies among them, and the compute backend's besides.
  EXPECT_GT(ipc.pageable_copies.load(), 0);
  EXPECT_GT(reported, ipc.pageable_copies.load());
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster));
}

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(gen);
  return v;
}

// One DP rank's owned buffers as the engine allocates them in host
// staging, and a device-like backend for the copy.
class OwnedDeviceCopyTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    config_ = MakeJobConfig("odc", /*dp=*/2, /*tp=*/1, "cost", MoeModel(4));
    config_.dtype = GetParam();
    config_.bucket_order = true;  // the trainer's buckets in order
    trainer_ = std::make_unique<TrainerRank>(config_, 1);
    ASSERT_OK(trainer_->Init());
    ASSERT_OK_AND_ASSIGN(jp_, PlanOf(config_));
    ASSERT_OK_AND_ASSIGN(RankSpec spec,
                         ValidateRegisterRequest(trainer_->MakeRegister(), {}));
    ASSERT_OK_AND_ASSIGN(layout_, LayoutRank(*jp_, spec.settings, spec.coords));
    ASSERT_OK_AND_ASSIGN(
        buffers_,
        TrainerBuffers::Map(trainer_->MakeRegister(), spec.fragment_numel, {}));
    ASSERT_OK_AND_ASSIGN(host_, CreateBackend(BackendKind::kCpu));
    ASSERT_OK_AND_ASSIGN(device_, CreateCpuBackend(MemorySpace::kDevice));
    ASSERT_OK(AllocateOwned(*jp_, layout_, *buffers_, /*device_staging=*/false,
                            *host_, &memory_, &owned_));
    for (int i : layout_.stage_params) {
      if (owned_.grad_at[i] != nullptr) params_.push_back(i);
    }
    ASSERT_GT(params_.size(), 3u);
  }

  JobConfig config_;
  std::unique_ptr<TrainerRank> trainer_;
  std::shared_ptr<const JobPlan> jp_;
  RankLayout layout_;
  std::unique_ptr<TrainerBuffers> buffers_;
  std::unique_ptr<Backend> host_, device_;
  OwnedMemory memory_;
  OwnedBuffers owned_;
  std::vector<int> params_;  // held here
};

TEST_P(OwnedDeviceCopyTest, MovesRunsInOneCopyEachWayAndValuesAfterTheWait) {
  std::unique_ptr<OwnedDeviceCopy> copy;
  ASSERT_OK_AND_ASSIGN(
      copy, OwnedDeviceCopy::Create(*jp_, layout_, owned_, params_, *device_));
  // The owned gradients are one range; bf16 parameters' masters are
  // allocated in the same order (one range); fp32 parameters are updated
  // in the trainer's shared memory, at most one range per bucket.
  EXPECT_EQ(copy->copies_in() - copy->copies_out(), 1);
  if (GetParam() != DType::kFloat32) EXPECT_EQ(copy->copies_out(), 1);
  EXPECT_LE(copy->copies_out(), static_cast<int>(layout_.buckets.size()));

  // Fresh values on the host; on the device: value += 2 * gradient.
  std::vector<std::vector<float>> grads, values;
  for (int i : params_) {
    const int64_t n = jp_->params[i].fragment_numel;
    grads.push_back(Random(n, 10 + i));
    values.push_back(Random(n, 100 + i));
    std::copy(grads.back().begin(), grads.back().end(), owned_.grad_at[i]);
    std::copy(values.back().begin(), values.back().end(), owned_.param_at[i]);
  }
  ASSERT_OK(copy->Load());
  for (int i : params_) {
    ASSERT_OK(device_->Axpby(jp_->params[i].fragment_numel, 2.0f,
                             copy->view().grad_at[i], 1.0f,
                             copy->view().param_at[i]));
  }
  ASSERT_OK(copy->Store());
  for (size_t k = 0; k < params_.size(); ++k) {
    const int i = params_[k];
    for (size_t e = 0; e < values[k].size(); ++e) {
      ASSERT_EQ(owned_.param_at[i][e], values[k][e] + 2.0f * grads[k][e])
          << jp_->params[i].name << " element " << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OwnedDeviceCopyTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace canzona::engine_test
