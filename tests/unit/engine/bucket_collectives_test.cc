// The DP collectives of a rank's buckets alone: two DP ranks as threads over
// an in-process fake group, the trainers' buffers in real shared memory,
// the owned (ZeRO-1) buffers as the engine allocates them. Every strategy,
// both trainer layouts (interleaved: through the bucket slot; bucket order:
// in place), fp32 and bf16 trainers, bf16 gradients summed in bf16 or fp32;
// and the same buffers as a GPU trainer's CUDA IPC memory (FakeCudaIpc)
// under host staging, copied through the IPC layer: one copy per bucket
// each way in bucket order, one per parameter interleaved.
#include "server/engine/bucket_collectives.h"

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/dtype.h"
#include "kernels/base/status_macros.h"
#include "server/comm/fake_communicator.h"
#include "server/engine/cuda_ipc_registry.h"
#include "server/engine/owned_buffers.h"
#include "server/engine/single_rank_communicator.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/parts_test_util.h"

namespace canzona::engine_test {
namespace {

constexpr int kDp = 2;

// One DP rank: its trainer, mapped buffers, owned buffers and collectives
// (and the fake IPC layer its buffers are opened through, if any).
struct DpRank {
  FakeCudaIpc ipc;
  std::unique_ptr<CudaIpcRegistry> registry;
  std::unique_ptr<TrainerRank> trainer;
  std::unique_ptr<TrainerBuffers> buffers;
  RankLayout layout;
  std::unique_ptr<Backend> backend;
  OwnedMemory memory;
  OwnedBuffers owned;
  std::unique_ptr<BucketCollectives> collectives;
};

// strategy, trainer layout in bucket order, trainer dtype, fp32 reduce,
// CUDA IPC trainer buffers (through the host).
using Case = std::tuple<std::string, bool, DType, bool, bool>;

class BucketCollectivesTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const auto& [strategy, bucket_order, dtype, reduce_fp32, ipc] = GetParam();
    config_ = MakeJobConfig("bc", kDp, /*tp=*/1, strategy);
    config_.bucket_order = bucket_order;
    config_.dtype = dtype;
    config_.grad_reduce_fp32 = reduce_fp32;
    config_.cuda_ipc = ipc;
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
      TrainerBuffers::Options options;
      if (ipc) {
        r.registry = std::make_unique<CudaIpcRegistry>(&r.ipc);
        options.registry = r.registry.get();
        options.opener = &r.ipc;
        options.cuda_devices = [] { return kFakeGpus; };
      }
      ASSERT_OK_AND_ASSIGN(r.buffers,
                           TrainerBuffers::Map(r.trainer->MakeRegister(),
                                               spec.fragment_numel, options));
      ASSERT_OK_AND_ASSIGN(r.backend, CreateBackend(BackendKind::kCpu));
      ASSERT_OK(AllocateOwned(*jp_, r.layout, *r.buffers,
                              /*device_staging=*/false, *r.backend, &r.memory,
                              &r.owned));
      BucketCollectives::Parts parts;
      parts.copier = CreateHostStagingCopier(&r.backend->allocations());
      parts.dp = group_.TakeCommunicator(d);
      parts.cross = CreateSingleRankCommunicator();
      parts.calibration = std::make_unique<UnevenCalibration>();
      if (!r.layout.sliced) {
        ASSERT_OK_AND_ASSIGN(parts.part,
                             r.backend->Allocate(r.layout.max_slice));
      }
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
      staging.owned = &r.owned;
      staging.who = absl::StrCat("dp ", d);
      r.collectives = std::make_unique<BucketCollectives>(std::move(staging),
                                                          std::move(parts));
      ASSERT_OK(AllocateBucketStaging(r.collectives->slot_bytes(),
                                      r.collectives->scratch_bytes(),
                                      *r.backend, &r.memory, &r.owned));
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

  // A trainer buffer of parameter i as floats.
  std::vector<float> Widened(const void* at, int i) const {
    std::vector<float> out(jp_->params[i].fragment_numel);
    WidenToFloat(config_.dtype, at, static_cast<int64_t>(out.size()),
                 out.data());
    return out;
  }

  // Copies through the IPC layer of bucket b on one rank (CUDA IPC
  // buffers): one per run of parameters `of` (plan indices in bucket order)
  // when the trainer lays them out back to back, else one per parameter.
  int64_t Copies(const std::vector<int>& of) const {
    if (of.empty()) return 0;
    if (!config_.bucket_order) return static_cast<int64_t>(of.size());
    const std::vector<int>& params = BucketParams(of.front());
    const auto first = std::find(params.begin(), params.end(), of.front());
    const bool run = params.end() - first >= static_cast<int64_t>(of.size()) &&
                     std::equal(of.begin(), of.end(), first);
    return run ? 1 : static_cast<int64_t>(of.size());
  }
  // The parameters of the bucket of plan parameter i, in bucket order.
  const std::vector<int>& BucketParams(int i) const {
    for (const plan::BucketPlan& b : jp_->plan.buckets) {
      if (std::find(b.params.begin(), b.params.end(), i) != b.params.end()) {
        return b.params;
      }
    }
    static const std::vector<int> kNone;
    return kNone;
  }
  // Bucket b's parameters that rank r holds, in bucket order.
  std::vector<int> Held(const DpRank& r, const BucketLayout& b) const {
    std::vector<int> held;
    for (int i : jp_->plan.buckets[b.index].params) {
      if (r.owned.grad_at[i] != nullptr) held.push_back(i);
    }
    return held;
  }
  bool ipc() const { return config_.cuda_ipc; }

  JobConfig config_;
  std::shared_ptr<const JobPlan> jp_;
  FakeCommunicatorGroup group_{kDp};
  DpRank ranks_[kDp];
};

TEST_P(BucketCollectivesTest, ReduceSumsWhatEachRankHolds) {
  OnBothRanks([](DpRank& r, int b) { return r.collectives->Reduce(b); },
              Buckets());
  const bool rounds =
      config_.dtype != DType::kFloat32 && !config_.grad_reduce_fp32;
  for (int d = 0; d < kDp; ++d) {
    const DpRank& r = ranks_[d];
    int held = 0;
    for (int i : r.layout.stage_params) {
      const bool mine = !r.layout.sliced || jp_->plan.dp_owner[i] < 0 ||
                        jp_->plan.dp_owner[i] == d;
      ASSERT_EQ(
          r.owned.grad_at[i] != nullptr,
          r.layout.sliced ? mine : static_cast<bool>(r.layout.dp_owned[i]))
          << jp_->params[i].name;
      if (r.owned.grad_at[i] == nullptr) continue;
      ++held;
      std::vector<float> sum = Widened(ranks_[0].buffers->grad(i), i);
      const std::vector<float> other = Widened(ranks_[1].buffers->grad(i), i);
      for (size_t k = 0; k < sum.size(); ++k) sum[k] += other[k];
      if (rounds) sum = Rounded(config_.dtype, std::move(sum));
      const std::vector<float> trainer_param = Widened(r.buffers->param(i), i);
      for (size_t k = 0; k < sum.size(); ++k) {
        ASSERT_EQ(r.owned.grad_at[i][k], sum[k])
            << jp_->params[i].name << "[" << k << "]";
        ASSERT_EQ(r.owned.param_at[i][k], trainer_param[k]);
      }
      // fp32 parameters are updated in the trainer's own memory (when the
      // host staging addresses it).
      EXPECT_EQ(r.owned.master[i] == 0,
                config_.dtype == DType::kFloat32 && !ipc());
      if (!r.owned.master[i]) {
        EXPECT_EQ(static_cast<void*>(r.owned.param_at[i]), r.buffers->param(i));
      }
    }
    EXPECT_GT(held, 0);
  }
  // The trainer's runs in bucket order serve the sliced collectives in
  // place, in its own dtype: no slot.
  const bool in_place =
      config_.bucket_order && ranks_[0].layout.sliced && !ipc() &&
      (config_.dtype == DType::kFloat32 || !config_.grad_reduce_fp32);
  EXPECT_EQ(ranks_[0].collectives->slot_bytes() == 0, in_place);
  // Through the IPC layer: each bucket's gradients (into the slot) and
  // the master copies of what the rank holds, nothing back.
  for (int d = 0; ipc() && d < kDp; ++d) {
    const DpRank& r = ranks_[d];
    int64_t to_host = 0;
    for (const BucketLayout& b : r.layout.buckets) {
      to_host += Copies(jp_->plan.buckets[b.index].params) + Copies(Held(r, b));
    }
    EXPECT_EQ(r.ipc.to_host.load(), to_host) << "rank " << d;
    EXPECT_EQ(r.ipc.from_host.load(), 0) << "rank " << d;
  }
  const DType reduced =
      config_.grad_reduce_fp32 ? DType::kFloat32 : config_.dtype;
  for (const FakeCommCall& c : group_.calls(0)) {
    if (c.op == "ReduceScatterV") EXPECT_EQ(c.dtype, reduced);
  }
}

TEST_P(BucketCollectivesTest, GatherPublishesTheOwnersParameters) {
  OnBothRanks([](DpRank& r, int b) { return r.collectives->Reduce(b); },
              Buckets());
  // Each owner "updates" what it owns: param <- -(d + 1) - (k % 64), exact
  // in every dtype.
  auto marker = [](int owner, int64_t k) {
    return -static_cast<float>(owner < 0 ? 1 : owner + 1) -
           static_cast<float>(k % 64);
  };
  for (int d = 0; d < kDp; ++d) {
    for (int i : ranks_[d].layout.stage_params) {
      if (ranks_[d].owned.param_at[i] == nullptr) continue;
      const int owner = jp_->plan.dp_owner[i];
      if (owner >= 0 && owner != d) continue;
      for (int64_t k = 0; k < jp_->params[i].fragment_numel; ++k) {
        ranks_[d].owned.param_at[i][k] = marker(owner, k);
      }
    }
  }
  int64_t to_host[kDp];
  for (int d = 0; d < kDp; ++d) to_host[d] = ranks_[d].ipc.to_host.load();
  OnBothRanks([](DpRank& r, int b) { return r.collectives->Gather(b); },
              ranks_[0].layout.gather_order);
  // Through the IPC layer: each bucket's parameters (sliced: the gathered
  // bucket; sc: all held here) as one copy per run; the layerwise gather
  // writes each parameter alone.
  for (int d = 0; ipc() && d < kDp; ++d) {
    const DpRank& r = ranks_[d];
    int64_t from_host = 0;
    for (const BucketLayout& b : r.layout.buckets) {
      const std::vector<int>& params = jp_->plan.buckets[b.index].params;
      from_host += jp_->plan.strategy == plan::Strategy::kLayerwise
                       ? static_cast<int64_t>(params.size())
                       : Copies(params);
    }
    EXPECT_EQ(r.ipc.from_host.load(), from_host) << "rank " << d;
    EXPECT_EQ(r.ipc.to_host.load(), to_host[d]) << "rank " << d;
  }
  for (int d = 0; d < kDp; ++d) {
    for (size_t i = 0; i < jp_->params.size(); ++i) {
      const int owner = jp_->plan.dp_owner[i];
      const std::vector<float> p = Widened(
          ranks_[d].buffers->param(static_cast<int>(i)), static_cast<int>(i));
      for (size_t k = 0; k < p.size(); ++k) {
        ASSERT_EQ(p[k], marker(owner, static_cast<int64_t>(k)))
            << "rank " << d << " " << jp_->params[i].name << "[" << k << "]";
      }
    }
  }
  // Sliced: one reduce-scatter per bucket, then one all-gather per bucket
  // in gather order (in the trainer's dtype), the same on both ranks.
  if (ranks_[0].layout.sliced) {
    const std::vector<FakeCommCall> calls = group_.calls(0);
    const size_t buckets = ranks_[0].layout.buckets.size();
    ASSERT_EQ(calls.size(), 2 * buckets);
    for (size_t b = 0; b < buckets; ++b) {
      EXPECT_EQ(calls[b].op, "ReduceScatterV");
      EXPECT_EQ(calls[buckets + b].op, "AllGatherV");
      EXPECT_EQ(calls[buckets + b].dtype, config_.dtype);
    }
  }
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const auto& [strategy, bucket_order, dtype, reduce_fp32, ipc] = info.param;
  return absl::StrCat(strategy, bucket_order ? "_bucket_order" : "_interleaved",
                      "_", DTypeName(dtype), reduce_fp32 ? "_reduce_fp32" : "",
                      ipc ? "_cuda_ipc" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Fp32, BucketCollectivesTest,
    ::testing::Combine(::testing::Values("cost", "sc", "layerwise"),
                       ::testing::Bool(), ::testing::Values(DType::kFloat32),
                       ::testing::Values(false), ::testing::Bool()),
    CaseName);
INSTANTIATE_TEST_SUITE_P(Bf16, BucketCollectivesTest,
                         ::testing::Combine(::testing::Values("cost", "sc"),
                                            ::testing::Bool(),
                                            ::testing::Values(DType::kBFloat16),
                                            ::testing::Bool(),
                                            ::testing::Bool()),
                         CaseName);

}  // namespace
}  // namespace canzona::engine_test
