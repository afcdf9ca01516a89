// The distributed step with the cuda compute backend and the Gloo data
// plane (host staging): several ranks share one GPU, as on a small box.
// Every parameter must match the single-process cpu reference within the
// numerics tolerances (fp32 Newton-Schulz: 1e-4 of the parameter's
// magnitude; the default bf16 Newton-Schulz: 2e-2), and steady-state steps
// must allocate no device memory. Skips without a CUDA device.
//
// The matrices run Muon here, not Shampoo or SOAP: this test checks the
// data path (staging, TP owners, collectives, device buffers), and Muon's
// Newton-Schulz is a smooth function of its input. Shampoo's and SOAP's
// first factors are rank-deficient (a 128 x 64 gradient gives a 128 x 128
// left factor of rank <= 64); the eigenbasis of that null space is rounding
// noise, cuSOLVER and LAPACK legitimately pick different bases, and SOAP's
// Adam in that basis turns the difference into updates that differ by
// about lr from step 2. Their cuda numerics are checked on well-conditioned
// gradients by update_rule_gpu_test.cc.
//
// And the NCCL data plane (comm "nccl": staging, collectives and updates in
// GPU memory, no host round trip) at world size 1 on the real NCCL: its
// groups of one are NCCL communicators, so every collective of the step
// runs through NCCL on device pointers.
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "server/comm/nccl_api.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {
namespace {

// Steps 1-3, then up to `last` (the last two as an overlapping trainer
// drives them when `overlap_tail`) with the backend allocations counted;
// every parameter within the precision's tolerance of the cpu reference.
void ExpectMatchesCpuReference(Cluster& cluster, const JobConfig& config,
                               int last, bool overlap_tail) {
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 3));
  const int64_t allocations = BackendAllocationCount();
  const int plain_last = overlap_tail ? last - 2 : last;
  ASSERT_OK(run.RunSteps(cluster, 4, plain_last));
  if (overlap_tail) {
    ASSERT_OK(run.RunStepsOverlapped(cluster, plain_last + 1, last,
                                     /*shuffled=*/true, 3));
  }
  EXPECT_EQ(BackendAllocationCount(), allocations)
      << "device allocations during steady-state steps";
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, last, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/false,
                        config.muon_ns_precision == "fp32" ? 1e-4f : 2e-2f));
  EXPECT_OK(run.Deregister(cluster));
}

class EngineGpuTest
    : public ::testing::TestWithParam<std::tuple<int, int, std::string>> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    SetCpuBlasThreads(1);
  }
};

TEST_P(EngineGpuTest, CudaComputeWithGlooMatchesTheCpuReference) {
  const auto& [dp, tp, precision] = GetParam();
  JobConfig config = MakeJobConfig("gpu", dp, tp, "cost", MuonModel());
  config.muon_ns_precision = precision;
  config.seed = 11;
  Cluster cluster(absl::Seconds(60), absl::Seconds(60), "cuda");
  ExpectMatchesCpuReference(cluster, config, 6, /*overlap_tail=*/false);
}

// A bf16 trainer (shared memory, in bucket order) over fp32 masters, the
// updates on the GPU: within the tolerance above, and at least one bf16
// ulp (Compare's mixed-precision floor).
TEST_P(EngineGpuTest, Bf16TrainerWithCudaComputeMatchesTheCpuReference) {
  const auto& [dp, tp, precision] = GetParam();
  JobConfig config = MakeJobConfig("gpu16", dp, tp, "cost", MuonModel());
  config.muon_ns_precision = precision;
  config.dtype = DType::kBFloat16;
  config.bucket_order = true;
  config.seed = 17;
  Cluster cluster(absl::Seconds(60), absl::Seconds(60), "cuda");
  ExpectMatchesCpuReference(cluster, config, 5, /*overlap_tail=*/false);
}

INSTANTIATE_TEST_SUITE_P(
    OneGpu, EngineGpuTest,
    ::testing::Values(std::make_tuple(2, 1, std::string("fp32")),
                      std::make_tuple(4, 1, std::string("fp32")),
                      std::make_tuple(2, 2, std::string("fp32")),
                      std::make_tuple(2, 1, std::string("bf16"))),
    [](const auto& info) {
      return absl::StrCat("dp", std::get<0>(info.param), "tp",
                          std::get<1>(info.param), "_",
                          std::get<2>(info.param));
    });

class EngineNcclGpuTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    SetCpuBlasThreads(1);
  }
};

TEST_P(EngineNcclGpuTest, DeviceResidentStepMatchesTheCpuReference) {
  const std::string precision = GetParam();
  ASSERT_OK_AND_ASSIGN(NcclApi * nccl, RealNcclApi());
  JobConfig config = MakeJobConfig("gpu-nccl", 1, 1, "cost", MuonModel());
  config.muon_ns_precision = precision;
  config.seed = 13;
  Cluster cluster(absl::Seconds(60), absl::Seconds(60), "cuda", nullptr, nccl);
  ExpectMatchesCpuReference(cluster, config, 7, /*overlap_tail=*/true);
}

INSTANTIATE_TEST_SUITE_P(WorldSizeOne, EngineNcclGpuTest,
                         ::testing::Values("fp32", "bf16"));

}  // namespace
}  // namespace canzona::engine_test
