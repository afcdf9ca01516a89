// Training as LLMs are trained, through the Engine: the ZeRO-1 data path
// (trainer buffers in bucket order served in place, fp32 parameters updated
// where they lie, bf16 / fp16 masters only for what a rank owns, gradients
// summed in the trainer's dtype or in fp32), the daemon's memory per rank,
// gradient clipping by the global norm, the one world reduction per step
// (update_rms of the previous step), and the refusals of bad settings.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/base/dtype.h"
#include "kernels/cpu/cpu_backend.h"
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
using ::canzona::testing::IsOk;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kSteps = 4;

JobConfig Config(const std::string& stem, int dp, int tp,
                 const std::string& strategy, DType dtype, bool bucket_order) {
  JobConfig c = MakeJobConfig(stem, dp, tp, strategy);
  c.dtype = dtype;
  c.bucket_order = bucket_order;
  c.seed = static_cast<uint64_t>(dp * 100 + tp * 10 + 3);
  return c;
}

// ---------------------------------------------------------------------------
// The trainer's buffers in bucket order: every collective in place.

using Layout = std::tuple<int, int>;  // dp, tp

class BucketOrderTest
    : public ::testing::TestWithParam<std::tuple<DType, Layout, std::string>> {
};

TEST_P(BucketOrderTest, BitwiseEqualToTheReference) {
  const auto& [dtype, layout, strategy] = GetParam();
  const auto [dp, tp] = layout;
  Cluster cluster;
  JobRun run(Config("z1", dp, tp, strategy, dtype, /*bucket_order=*/true));
  ASSERT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/true,
                                /*deregister=*/false));
  // A different optimizer (a fragment orthogonalized alone) is caught.
  if (tp > 1) {
    ASSERT_OK_AND_ASSIGN(Params wrong,
                         Reference(run.config(), kSteps, {},
                                   "decoder.layers.0.mlp.linear_fc2.weight"));
    EXPECT_THAT(run.Compare(wrong, /*bitwise=*/true), Not(IsOk()));
  }
  EXPECT_OK(run.Deregister(cluster));
}

std::string BucketOrderName(
    const ::testing::TestParamInfo<BucketOrderTest::ParamType>& info) {
  const auto& [dtype, layout, strategy] = info.param;
  return absl::StrCat(DTypeName(dtype), "_dp", std::get<0>(layout), "tp",
                      std::get<1>(layout), "_", strategy);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, BucketOrderTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16),
                       ::testing::Values(Layout{1, 1}, Layout{4, 1},
                                         Layout{2, 2}),
                       ::testing::Values("sc", "layerwise", "cost")),
    BucketOrderName);

// ---------------------------------------------------------------------------
// The reduce dtype.

TEST(GradReduceDtypeTest, Fp32SumsEqualTheUnroundedReference) {
  for (bool bucket_order : {false, true}) {
    SCOPED_TRACE(bucket_order ? "bucket order" : "interleaved");
    Cluster cluster;
    JobConfig config =
        Config("z1-fp32", 4, 1, "cost", DType::kBFloat16, bucket_order);
    config.grad_reduce_fp32 = true;
    JobRun run(config);
    EXPECT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/true,
                                  /*deregister=*/true));
  }
}

TEST(GradReduceDtypeTest, Bf16SumsAreRoundedOnceAndTheReferenceSeesIt) {
  Cluster cluster;
  // Random gradients: their bf16 sums need rounding (the exact ones'
  // small integers never do).
  JobConfig config = Config("z1-bf16", 4, 1, "cost", DType::kBFloat16, true);
  config.exact = false;
  JobRun run(config);
  ASSERT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/true,
                                /*deregister=*/false));
  // Summing in fp32 is another result on these gradients: the comparison
  // notices which dtype the sums ran in.
  JobConfig fp32 = run.config();
  fp32.grad_reduce_fp32 = true;
  ASSERT_OK_AND_ASSIGN(Params unrounded, Reference(fp32, kSteps, {}));
  EXPECT_THAT(run.Compare(unrounded, /*bitwise=*/true), Not(IsOk()));
  EXPECT_OK(run.Deregister(cluster));
}

// ---------------------------------------------------------------------------
// Memory per rank.

struct RankBytes {
  int64_t master = 0, state = 0, buffers = 0;
  int64_t total() const { return master + state + buffers; }
};

// The largest per-rank footprint and allocation of a job.
struct JobMemory {
  RankBytes worst;
  int64_t largest_allocation = 0;  // floats
  int64_t bound = 0;               // floats: what the layout allows
  int64_t stage_elements = 0;
  int64_t param_bytes = 0;  // one rank's parameter bytes
};

JobMemory Measure(const JobConfig& config) {
  JobMemory out;
  // The layouts first (their requests map shm objects of the job's names).
  absl::StatusOr<std::shared_ptr<const JobPlan>> jp = PlanOf(config);
  EXPECT_OK(jp.status());
  for (int g = 0; g < config.world(); ++g) {
    absl::StatusOr<RankSpec> spec = SpecOf(config, g);
    EXPECT_OK(spec.status());
    absl::StatusOr<RankLayout> layout =
        LayoutRank(**jp, spec->settings, spec->coords);
    EXPECT_OK(layout.status());
    // Owned gradients (and masters), whole matrices, and the bucket slot
    // when the trainer's buffers cannot be used in place.
    out.bound = std::max({out.bound, layout->owned_elements, layout->max_state,
                          config.bucket_order ? 0 : layout->max_bucket});
    out.stage_elements = layout->stage_elements;
  }
  out.param_bytes = out.stage_elements * DTypeBytes(config.dtype);
  Cluster cluster;
  JobRun run(config);
  EXPECT_OK(run.Init());
  ResetBackendLargestAllocation();
  EXPECT_OK(run.RegisterAll(cluster));
  out.largest_allocation = BackendLargestAllocation();
  for (const v1::RegisterResponse& r : run.registered) {
    RankBytes b{r.master_bytes(), r.state_bytes(), r.buffer_bytes()};
    if (b.total() > out.worst.total()) out.worst = b;
  }
  EXPECT_OK(run.RunSteps(cluster, 1, 2));
  EXPECT_OK(run.Deregister(cluster));
  return out;
}

// The ratios themselves are the memory benchmark's (tests/bench/
// memory_bench.sh, real shapes); here: the bound on every buffer, and the
// footprint falling with DP (Muon and AdamW: Shampoo's and SOAP's
// preconditioners are larger than the matrices they serve).
TEST(MemoryTest, NoBufferExceedsItsBoundAndMemoryFallsWithDp) {
  double last_ratio = 1e9;
  for (int dp : {1, 2, 4}) {
    SCOPED_TRACE(absl::StrCat("dp ", dp));
    JobConfig config = Config("z1-mem", dp, 1, "cost", DType::kFloat32, true);
    config.params = MuonModel();
    config.bucket_size = 4000;
    const JobMemory m = Measure(config);
    EXPECT_LE(m.largest_allocation, m.bound);
    std::printf(
        "dp %d: params %lld B, worst rank master %lld state %lld "
        "buffers %lld; largest allocation %lld floats, bound %lld, "
        "stage %lld\n",
        dp, static_cast<long long>(m.param_bytes),
        static_cast<long long>(m.worst.master),
        static_cast<long long>(m.worst.state),
        static_cast<long long>(m.worst.buffers),
        static_cast<long long>(m.largest_allocation),
        static_cast<long long>(m.bound),
        static_cast<long long>(m.stage_elements));
    // fp32 parameters are updated in the trainer's own buffers.
    EXPECT_EQ(m.worst.master, 0);
    const double ratio = static_cast<double>(m.worst.total()) /
                         static_cast<double>(m.param_bytes);
    EXPECT_LT(ratio, last_ratio);
    last_ratio = ratio;
    // Not one stage-sized buffer once the state is sharded.
    if (dp > 1) EXPECT_LT(m.bound, m.stage_elements);
  }
}

TEST(MemoryTest, Bf16MastersAreTheOwnedElementsInFp32) {
  JobConfig config = Config("z1-mem16", 4, 1, "cost", DType::kBFloat16, true);
  config.params = MuonModel();
  config.bucket_size = 4000;
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> jp, PlanOf(config));
  std::vector<int64_t> owned;
  for (int g = 0; g < config.world(); ++g) {
    ASSERT_OK_AND_ASSIGN(RankSpec spec, SpecOf(config, g));
    ASSERT_OK_AND_ASSIGN(RankLayout layout,
                         LayoutRank(*jp, spec.settings, spec.coords));
    owned.push_back(layout.owned_elements);
  }
  Cluster cluster;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  int64_t masters = 0;
  for (int g = 0; g < config.world(); ++g) {
    EXPECT_EQ(run.registered[g].master_bytes(), 4 * owned[g]);
    masters += owned[g];
  }
  // Each element has exactly one master job-wide.
  EXPECT_EQ(masters, jp->total_numel);
  ASSERT_OK(run.RunSteps(cluster, 1, 2));
  ASSERT_OK(run.Deregister(cluster));
}

// ---------------------------------------------------------------------------
// Gradient clipping and the one world reduction.

TEST(ClippingTest, NormAndFactorAreTorchsAndTheUpdateUsesThem) {
  Cluster cluster;
  JobConfig config = Config("z1-clip", 2, 2, "cost", DType::kFloat32, true);
  config.exact = false;
  // Clip every step, at two different norms (the job's, a step's own).
  config.max_grad_norm = 0.5 * ReferenceGradNorm(config, 1);
  config.step_max_grad_norm[3] = 0.25 * ReferenceGradNorm(config, 3);
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, kSteps));
  for (int s = 1; s <= kSteps; ++s) {
    const double norm = ReferenceGradNorm(config, s);
    const double max_norm =
        s == 3 ? config.step_max_grad_norm[3] : config.max_grad_norm;
    const double factor = std::min(1.0, max_norm / (norm + 1e-6));
    for (int g = 0; g < config.world(); ++g) {
      const v1::StepResponse& r = run.responses[g][s - 1];
      EXPECT_NEAR(r.grad_norm(), norm, 1e-5 * norm) << "step " << s;
      EXPECT_NEAR(r.clip_factor(), factor, 1e-5 * factor) << "step " << s;
    }
    EXPECT_LT(run.responses[0][s - 1].clip_factor(), 1.0);
  }
  ASSERT_OK_AND_ASSIGN(Params ref, Reference(run.config(), kSteps, {}));
  EXPECT_OK(run.Compare(ref, /*bitwise=*/false, 1e-5f));
  // Without the clipping the parameters are elsewhere.
  JobConfig unclipped = config;
  unclipped.max_grad_norm = 0;
  unclipped.step_max_grad_norm.clear();
  ASSERT_OK_AND_ASSIGN(Params free, Reference(unclipped, kSteps, {}));
  EXPECT_THAT(run.Compare(free, /*bitwise=*/false, 1e-5f), Not(IsOk()));
  EXPECT_OK(run.Deregister(cluster));
}

TEST(ClippingTest, ANormBelowTheLimitLeavesTheStepAlone) {
  Cluster cluster;
  JobConfig config = Config("z1-noclip", 2, 1, "cost", DType::kFloat32, true);
  config.max_grad_norm = 1e6;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, kSteps));
  for (const auto& per_rank : run.responses) {
    for (const v1::StepResponse& r : per_rank) EXPECT_EQ(r.clip_factor(), 1.0);
  }
  ASSERT_OK_AND_ASSIGN(Params ref, Reference(run.config(), kSteps, {}));
  EXPECT_OK(run.Compare(ref, /*bitwise=*/true));
  EXPECT_OK(run.Deregister(cluster));
}

TEST(UpdateRmsTest, EachStepReportsThePreviousUpdate) {
  Cluster cluster;
  JobConfig config = Config("z1-rms", 2, 2, "cost", DType::kFloat32, true);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const JobPlan> jp, PlanOf(config));
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 3));
  std::vector<Params> states;
  for (int s = 0; s <= 2; ++s) {
    ASSERT_OK_AND_ASSIGN(Params p, Reference(config, s, {}));
    states.push_back(std::move(p));
  }
  for (int g = 0; g < config.world(); ++g) {
    EXPECT_EQ(run.responses[g][0].update_rms(), 0) << "nothing before step 1";
    for (int s = 1; s <= 2; ++s) {
      double sumsq = 0;
      for (const auto& [name, after] : states[s]) {
        const std::vector<float>& before = states[s - 1].at(name);
        for (size_t k = 0; k < after.size(); ++k) {
          const double d = static_cast<double>(after[k]) - before[k];
          sumsq += d * d;
        }
      }
      const double rms = std::sqrt(sumsq / jp->total_numel);
      EXPECT_NEAR(run.responses[g][s].update_rms(), rms, 1e-4 * rms)
          << "step " << s + 1 << " reports step " << s;
    }
  }
  EXPECT_OK(run.Deregister(cluster));
}

// A world of one rank has nothing to reduce: its step sends the five
// values nowhere (no all-reduce, no trip through the device); larger
// worlds reduce once per step (NcclJobTest's collective sequence).
TEST(WorldReductionTest, WorldOfOneReducesNothingOnTheNcclPlane) {
  FakeNcclApi::Options options;
  options.simulate_data = true;
  FakeNcclApi nccl(options);
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", nullptr, &nccl);
  JobConfig config = Config("z1-world", 1, 1, "cost", DType::kFloat32, false);
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  const size_t before = nccl.calls_named("ncclAllReduce").size();
  ASSERT_OK(run.RunSteps(cluster, 1, 3));
  EXPECT_EQ(nccl.calls_named("ncclAllReduce").size() - before, 0u);
  EXPECT_GT(run.responses[0][2].update_rms(), 0);  // still reported
  ASSERT_OK(run.Deregister(cluster));
}

// ---------------------------------------------------------------------------
// mixed precision on the NCCL data plane (CUDA IPC buffers over fakes).

TEST(NcclMixedPrecisionTest, Bf16OverCudaIpcEqualsTheReference) {
  for (bool bucket_order : {false, true}) {
    SCOPED_TRACE(bucket_order ? "bucket order" : "interleaved");
    FakeNcclApi::Options options;
    options.simulate_data = true;
    FakeNcclApi nccl(options);
    FakeCudaIpc ipc;
    ipc.devices = 4;
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
    JobConfig config =
        Config("z1-nccl16", 2, 1, "cost", DType::kBFloat16, bucket_order);
    config.cuda_ipc = true;
    JobRun run(config);
    ASSERT_OK(RunMatchesReference(cluster, run, kSteps, /*bitwise=*/true,
                                  /*deregister=*/false));
    // bf16 conversions ran as device kernels on the copier's stream, and
    // the reduce-scatters summed bf16.
    EXPECT_FALSE(nccl.calls_named("ConvertDTypeAsync").empty());
    bool bf16_reduce = false;
    for (const auto& c : nccl.calls()) {
      bf16_reduce |= c.dtype == "bfloat16" &&
                     (c.op == "ncclReduce" || c.op == "ncclReduceScatter");
    }
    EXPECT_TRUE(bf16_reduce);
    EXPECT_OK(run.Deregister(cluster));
  }
}

// ---------------------------------------------------------------------------
// Bad settings: a precise status, nothing registered or stepped.

TEST(ZeroOneBadInputTest, SettingsAreRefusedNamingTheField) {
  Cluster cluster;
  JobConfig config = Config("z1-bad", 1, 1, "cost", DType::kFloat32, true);
  JobRun run(config);
  ASSERT_OK(run.Init());
  TrainerRank& rank = *run.ranks()[0];
  auto refused = [&](const v1::RegisterRequest& r) {
    Result<v1::RegisterResponse> result;
    cluster.engines[0]->Register(r, PeerInfo{}, result.callback());
    return result.Get().status();
  };
  for (double bad : {-1.0, std::nan(""), HUGE_VAL}) {
    v1::RegisterRequest r = rank.MakeRegister();
    r.set_max_grad_norm(bad);
    EXPECT_THAT(refused(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("max_grad_norm")));
  }
  for (int bad : {static_cast<int>(v1::DTYPE_BFLOAT16), 42}) {
    v1::RegisterRequest r = rank.MakeRegister();
    r.set_grad_reduce_dtype(static_cast<v1::DType>(bad));
    EXPECT_THAT(refused(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("grad_reduce_dtype")));
  }
  EXPECT_EQ(cluster.engines[0]->GetStatus().jobs_size(), 0);
  // The same rank then registers; a bad step clip changes nothing.
  ASSERT_OK(run.RegisterAll(cluster));
  v1::StepRequest step = rank.MakeStep(1);
  step.set_max_grad_norm(-2);
  Result<v1::StepResponse> bad_step;
  cluster.engines[0]->Step(step, bad_step.callback());
  EXPECT_THAT(bad_step.Get(), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("max_grad_norm")));
  ASSERT_OK(run.RunSteps(cluster, 1, 2));
  ASSERT_OK_AND_ASSIGN(Params ref, Reference(run.config(), 2, {}));
  EXPECT_OK(run.Compare(ref, /*bitwise=*/true));
  EXPECT_OK(run.Deregister(cluster));
}

}  // namespace
}  // namespace canzona::engine_test
