// The NCCL data plane (EngineOptions::comm "nccl") without a GPU: the
// engine's device-resident step runs over FakeNcclApi in data mode
// (collectives summed in rank order) with the cpu backend standing in for
// the GPU under device memory's rules: its buffers are device-like memory
// the host cannot dereference, every kernel, copy, conversion and
// collective range is checked against the allocations as a driver would,
// and host work has a cpu backend of its own (server/DESIGN.md 4.6).
// Checked: every strategy's steps are bitwise equal to the single-process
// reference; the translation of the plan into NCCL calls (one
// reduce-scatter-v per bucket in bucket order, one all-gather-v per bucket
// in reverse order, their element counts, the same sequence on every rank,
// one world all-reduce); uneven buckets timed per-root and padded, then run
// the way the DP group measured faster; no allocation in steady-state
// steps; CUDA IPC buffers copied on the stream after a
// stream wait on the trainer's event, never through the host; shared-memory
// trainer buffers page-locked while their rank lives; settings validated.
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/device_like_memory.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/pageable_copies.h"
#include "server/engine/engine_impl.h"
#include "server/engine/gradient_snapshots.h"
#include "server/metrics/registry.h"
#include "tests/matchers/exposed_samples.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::FakeNcclApi;
using ::canzona::testing::FakeNcclCall;
using ::canzona::testing::IsOkAndHolds;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

FakeNcclApi::Options DataMode() {
  FakeNcclApi::Options o;
  o.simulate_data = true;
  return o;
}

struct Layout {
  std::string name;
  int dp, tp;
  std::string strategy;
  int shard_group_size;
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

// One job on two engines whose data plane is NCCL over a data-mode fake.
class NcclJobTest : public ::testing::Test {
 protected:
  void SetUp() override { SetCpuBlasThreads(1); }
  // Creates the job's buffers and registers all its ranks.
  absl::Status Register(const JobConfig& config) {
    run_ = std::make_unique<JobRun>(config);
    CANZONA_RETURN_IF_ERROR(run_->Init());
    return run_->RegisterAll(cluster_);
  }

  FakeNcclApi nccl_{DataMode()};
  Cluster cluster_{absl::Seconds(20), absl::Seconds(20), "cpu", nullptr,
                   &nccl_};
  std::unique_ptr<JobRun> run_;
};

class NcclEngineLayoutTest : public NcclJobTest,
                             public ::testing::WithParamInterface<Layout> {};

TEST_P(NcclEngineLayoutTest, StepsAreBitwiseEqualToTheReference) {
  const Layout& l = GetParam();
  JobConfig config = MakeJobConfig("nccl-" + l.name, l.dp, l.tp, l.strategy);
  config.shard_group_size = l.shard_group_size;
  ASSERT_OK(Register(config));
  JobRun& run = *run_;
  // dp, tp, world and cross communicators of every rank, groups of one
  // included (device memory needs NCCL there too).
  EXPECT_EQ(nccl_.calls_named("ncclCommInitRank").size(), 4u * config.world());
  ASSERT_OK(run.RunSteps(cluster_, 1, 3));
  ASSERT_OK(run.RunStepsOverlapped(cluster_, 4, 5, /*shuffled=*/true, 11));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 5, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  for (const auto& per_rank : run.responses) {
    for (size_t k = 0; k < per_rank.size(); ++k) {
      EXPECT_GT(per_rank[k].grad_norm(), 0);
      // Each step reports the update of the one before.
      if (k == 0) {
        EXPECT_EQ(per_rank[k].update_rms(), 0);
      } else {
        EXPECT_GT(per_rank[k].update_rms(), 0);
      }
    }
  }
  ASSERT_OK(run.Deregister(cluster_));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, NcclEngineLayoutTest,
    ::testing::Values(Layout{"one_rank", 1, 1, "cost", 0},
                      Layout{"cost_dp2_tp2", 2, 2, "cost", 0},
                      Layout{"sc_dp2_tp2", 2, 2, "sc", 0},
                      Layout{"layerwise_dp2_tp2", 2, 2, "layerwise", 0},
                      Layout{"cost_dp4_hierarchical", 4, 1, "cost", 2}),
    [](const ::testing::TestParamInfo<Layout>& info) {
      return info.param.name;
    });

// One NCCL operation or one ncclGroupStart/End of them, as the DP
// communicator issued it.
struct Unit {
  bool reduce = false;   // ncclReduce / ncclReduceScatter, else a gather
  bool even = false;     // one ncclReduceScatter / ncclAllGather
  int64_t elements = 0;  // moved per rank (padded: nranks * max slice)
  std::vector<std::tuple<std::string, int64_t, int>> ops;  // op, count, root
};

// The DP units of communicator rank `rank` (every NCCL data call but the
// world's all-reduces, which are the only all-reduces in a flat DP-only
// job), in order.
std::vector<Unit> DpUnits(const std::vector<FakeNcclCall>& calls, int rank,
                          int nranks) {
  std::vector<Unit> units;
  int64_t open_group = -1;
  for (const FakeNcclCall& c : calls) {
    if (c.comm_rank != rank || c.op == "ncclAllReduce" ||
        c.op == "ncclGroupStart" || c.op == "ncclGroupEnd") {
      continue;
    }
    if (c.group == 0 || c.group != open_group) {
      units.emplace_back();
      open_group = c.group == 0 ? -1 : c.group;
    }
    Unit& u = units.back();
    u.ops.emplace_back(c.op, c.count, c.root);
    u.reduce = c.op == "ncclReduce" || c.op == "ncclReduceScatter";
    if (c.op == "ncclReduceScatter" || c.op == "ncclAllGather") {
      u.even = true;
      u.elements += c.count * nranks;
    } else {
      u.elements += c.count;
    }
  }
  return units;
}

TEST_F(NcclJobTest, PlanBecomesOneCollectivePerBucketInPipelineOrder) {
  const JobConfig config = MakeJobConfig("nccl-calls", 2, 1, "cost");
  ASSERT_OK(Register(config));
  JobRun& run = *run_;
  nccl_.ClearCalls();
  ASSERT_OK(run.RunSteps(cluster_, 1, 1));
  const std::vector<FakeNcclCall> calls = nccl_.nccl_calls();

  // The world's one reduction per rank and step: [non-finite flag, the
  // gradient's and the previous update's sums of squares, the clip norm
  // and how many ranks clip].
  std::map<int64_t, int> all_reduces;
  for (const FakeNcclCall& c : calls) {
    if (c.op == "ncclAllReduce") ++all_reduces[c.count];
  }
  EXPECT_EQ(all_reduces, (std::map<int64_t, int>{{5, 2}}));

  const v1::RegisterResponse& reg = run.registered[0];
  const int buckets = reg.buckets_size();
  ASSERT_GE(buckets, 2) << "the model should span several buckets";
  std::vector<Unit> per_rank[2] = {DpUnits(calls, 0, 2), DpUnits(calls, 1, 2)};
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("dp rank ", r));
    ASSERT_EQ(per_rank[r].size(), 2u * buckets);
    for (int b = 0; b < buckets; ++b) {
      // Reductions in bucket (backward) order, then the gathers from the
      // last bucket, the order the next forward needs.
      const Unit& red = per_rank[r][b];
      const Unit& gat = per_rank[r][buckets + (buckets - 1 - b)];
      const int64_t elements = reg.buckets(b).elements();
      EXPECT_TRUE(red.reduce) << "bucket " << b;
      EXPECT_FALSE(gat.reduce) << "bucket " << b;
      for (const Unit* u : {&red, &gat}) {
        if (u->even) {  // even or padded: nranks slices of the largest
          EXPECT_GE(u->elements, elements) << "bucket " << b;
          EXPECT_LT(u->elements, 2 * elements) << "bucket " << b;
        } else {  // one ncclReduce / ncclBroadcast per root, in root order
          EXPECT_EQ(u->elements, elements) << "bucket " << b;
          for (size_t k = 1; k < u->ops.size(); ++k) {
            EXPECT_LT(std::get<2>(u->ops[k - 1]), std::get<2>(u->ops[k]));
          }
        }
      }
    }
  }
  // NCCL needs every rank to issue the same sequence.
  for (size_t k = 0; k < per_rank[0].size(); ++k) {
    EXPECT_EQ(per_rank[0][k].ops, per_rank[1][k].ops) << "unit " << k;
  }
  ASSERT_OK(run.Deregister(cluster_));
}

TEST_F(NcclJobTest, UnevenBucketsAreTimedBothWaysThenRunTheFasterOne) {
  const JobConfig config = MakeJobConfig("nccl-calibrate", 2, 1, "cost");
  ASSERT_OK(Register(config));
  JobRun& run = *run_;
  const int buckets = run.registered[0].buckets_size();
  // Per step, rank 0's DP units and the calibration all-reduces.
  std::vector<std::vector<Unit>> units(6);
  std::vector<int> sums(6, 0);
  for (int k = 1; k <= 5; ++k) {
    nccl_.ClearCalls();
    ASSERT_OK(run.RunSteps(cluster_, k, k));
    const std::vector<FakeNcclCall> calls = nccl_.nccl_calls();
    units[k] = DpUnits(calls, 0, 2);
    ASSERT_EQ(units[k].size(), 2u * buckets) << "step " << k;
    const std::vector<Unit> other = DpUnits(calls, 1, 2);
    for (size_t j = 0; j < other.size(); ++j) {
      EXPECT_EQ(units[k][j].ops, other[j].ops) << "step " << k;
    }
    for (const FakeNcclCall& c : calls) {
      sums[k] += c.op == "ncclAllReduce" && c.count == 2 * buckets;
    }
  }
  // Step 2 runs every bucket per-root: the uneven ones show up as
  // ncclReduce groups (even buckets are one ncclReduceScatter regardless).
  std::vector<int> uneven;
  for (int b = 0; b < buckets; ++b) {
    if (!units[2][b].even) uneven.push_back(b);
  }
  ASSERT_FALSE(uneven.empty()) << "the plan should cut some bucket unevenly";
  for (int b : uneven) {
    SCOPED_TRACE(absl::StrCat("bucket ", b));
    // Step 3 pads them: one ncclReduceScatter / ncclAllGather of the
    // largest slice.
    EXPECT_TRUE(units[3][b].even);
    EXPECT_TRUE(units[3][2 * buckets - 1 - b].even);
    EXPECT_FALSE(units[2][2 * buckets - 1 - b].even);
    // From step 4 the choice is made and stays.
    EXPECT_EQ(units[4][b].even, units[5][b].even);
    EXPECT_EQ(units[4][b].ops, units[5][b].ops);
  }
  // The DP group summed the times once, after step 3 (both ranks).
  EXPECT_EQ(sums, (std::vector<int>{0, 0, 0, 2, 0, 0}));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 5, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster_));
}

TEST_F(NcclJobTest, MicroGroupPipelineIsOrderedByEventsOnTwoStreams) {
  const JobConfig config = MakeJobConfig("nccl-events", 1, 2, "cost");
  ASSERT_OK(Register(config));
  JobRun& run = *run_;
  nccl_.ClearCalls();
  ASSERT_OK(run.RunSteps(cluster_, 1, 1));
  // Per TP rank: the tp stream waits for the DP-owned updates once and for
  // each micro group's compute before its scatter; the all-to-alls (send /
  // recv pairs) run on that stream, which no other communicator uses.
  std::map<NcclStream, int> stream_waits;
  for (const FakeNcclCall& c : nccl_.calls_named("cudaStreamWaitEvent")) {
    ++stream_waits[c.stream];
  }
  std::map<NcclStream, int> sends;
  for (const FakeNcclCall& c : nccl_.calls_named("ncclSend")) ++sends[c.stream];
  ASSERT_EQ(sends.size(), 2u) << "one tp stream per rank";
  for (const auto& [stream, count] : sends) {
    // Each group: one send to the peer for the gather, one for the scatter.
    const int groups = count / 2;
    EXPECT_GE(groups, 1);
    EXPECT_EQ(stream_waits[stream], groups + 1);
  }
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 1, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster_));
}

TEST_F(NcclJobTest, SteadyStateStepsAllocateNothing) {
  // MoE experts: same-shape Muon matrices step in batches.
  const JobConfig config =
      MakeJobConfig("nccl-alloc", 2, 2, "cost", MoeModel(8));
  ASSERT_OK(Register(config));
  JobRun& run = *run_;
  // NCCL's scratch too is sized at registration (for the largest padded
  // collective), and the batched Muon updates' workspace and scratch, so
  // not even the first step allocates device memory.
  const size_t mallocs = nccl_.calls_named("cudaMalloc").size();
  const int64_t allocations = BackendAllocationCount();
  ASSERT_OK(run.RunSteps(cluster_, 1, 5));
  ASSERT_OK(run.RunStepsOverlapped(cluster_, 6, 7, /*shuffled=*/false, 3));
  EXPECT_EQ(nccl_.calls_named("cudaMalloc").size(), mallocs);
  EXPECT_EQ(BackendAllocationCount(), allocations);
  // And the work really went through the streams.
  EXPECT_GT(nccl_.calls_named("cudaMemcpyAsync").size(), 0u);
  ASSERT_OK(run.Deregister(cluster_));
}

// One GPU's step makes no host round trip but the sums its skip and clip
// decision read and the gathers' per-bucket answers
// (StepResponse.host_waits): the DP lane hands its reductions to the step
// and the step its updates to the gathers with events, the last step's
// update size rides on this step's sums, and a world of one rank reduces
// nothing. The cpu backend standing in for the GPU has no stream, so the
// two hand-overs wait on the host here (2); a GPU's compute stream waits
// on the device (StagingCopierTest.HandOversAreEventsNotHostWaits). The
// count does not grow with the parameters or the buckets. The fake defers
// the lane's copies until a wait, as a GPU would: a step that read the
// owned buffers before the hand-over would read the last step's bytes.
TEST(NcclEngineTest, OneRankStepWaitsOnceBesidesTheGathers) {
  SetCpuBlasThreads(1);
  // Shared-memory trainers (fp32 only on this plane) and CUDA IPC ones.
  for (const auto& [bucket_order, bucket_size, dtype, cuda_ipc] :
       {std::tuple{true, int64_t{20000}, DType::kFloat32, false},
        std::tuple{false, int64_t{20000}, DType::kFloat32, false},
        std::tuple{true, int64_t{1} << 30, DType::kFloat32, false},
        std::tuple{true, int64_t{20000}, DType::kFloat32, true},
        std::tuple{true, int64_t{20000}, DType::kBFloat16, true}}) {
    SCOPED_TRACE(absl::StrCat(bucket_order ? "bucket order" : "interleaved",
                              ", bucket size ", bucket_size, ", ",
                              DTypeName(dtype), cuda_ipc ? ", CUDA IPC" : ""));
    FakeCudaIpc ipc;
    FakeNcclApi nccl({.simulate_data = true, .defer_copies = true});
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
    // Muon and AdamW (Shampoo and SOAP read their solvers' results on the
    // host).
    JobConfig config = MakeJobConfig("nccl-waits", 1, 1, "cost", MuonModel());
    config.bucket_order = bucket_order;
    config.bucket_size = bucket_size;
    config.dtype = dtype;
    config.cuda_ipc = cuda_ipc;
    // Shared memory is the host's: a trainer there asking for the
    // parameters-written events gets none, and the answers wait.
    config.params_event = !cuda_ipc;
    // Clipping scales on the device.
    config.max_grad_norm = 0.5 * ReferenceGradNorm(config, 1);
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 4));
    const int buckets = run.registered[0].buckets_size();
    ASSERT_GE(buckets, 1);
    for (const v1::Bucket& bucket : run.registered[0].buckets()) {
      EXPECT_TRUE(bucket.params_event_handle().empty());
    }
    const std::vector<v1::StepResponse>& steps = run.responses[0];
    ASSERT_EQ(steps.size(), 4u);
    EXPECT_LT(steps[0].clip_factor(), 1);
    for (size_t k = 0; k < steps.size(); ++k) {
      SCOPED_TRACE(absl::StrCat("step ", k + 1));
      EXPECT_EQ(steps[k].host_waits(), 1 + 2 + buckets);
      if (k > 0) EXPECT_GT(steps[k].update_rms(), 0);
    }
    if (dtype == DType::kFloat32) {
      // As close as clipping allows (its factor from a float norm).
      ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 4, {}));
      EXPECT_OK(run.Compare(reference, /*bitwise=*/false, 1e-5f));
    }
    ASSERT_OK(run.Deregister(cluster));
  }
}

// A GPU trainer that asks for the daemon's "parameters written" events
// (RegisterRequest.params_events) gets every answer without a wait for the
// device: the daemon records bucket b's event after the bucket's writes
// and the trainer's stream waits for it. One rank on the cpu stand-in then
// waits only for the sums and the two hand-overs (3; on a GPU 1: the
// sums), whatever the buckets, for synchronous steps and per-bucket
// WaitParams alike, and the parameters the trainer sees after its waits
// are the reference's. The events are the daemon's, one per bucket, and
// go with the rank.
TEST(NcclEngineTest, TheParamsEventLeavesOnlyTheSumsWait) {
  SetCpuBlasThreads(1);
  for (const auto& [bucket_order, bucket_size, dtype, overlapped] :
       {std::tuple{true, int64_t{20000}, DType::kFloat32, false},
        std::tuple{false, int64_t{20000}, DType::kFloat32, false},
        std::tuple{true, int64_t{1} << 30, DType::kFloat32, false},
        std::tuple{true, int64_t{20000}, DType::kBFloat16, false},
        std::tuple{false, int64_t{20000}, DType::kBFloat16, true}}) {
    SCOPED_TRACE(absl::StrCat(bucket_order ? "bucket order" : "interleaved",
                              ", bucket size ", bucket_size, ", ",
                              DTypeName(dtype),
                              overlapped ? ", WaitParams per bucket" : ""));
    FakeCudaIpc ipc;
    FakeNcclApi nccl({.simulate_data = true, .defer_copies = true});
    auto cluster = std::make_unique<Cluster>(
        absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
    JobConfig config =
        MakeJobConfig("nccl-params-event", 1, 1, "cost", MuonModel());
    config.bucket_order = bucket_order;
    config.bucket_size = bucket_size;
    config.dtype = dtype;
    config.cuda_ipc = true;
    config.params_event = true;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(*cluster));
    if (overlapped) {
      ASSERT_OK(run.RunStepsOverlapped(*cluster, 1, 4, false, 7));
    } else {
      ASSERT_OK(run.RunSteps(*cluster, 1, 4));
    }
    const v1::RegisterResponse& reg = run.registered[0];
    ASSERT_GE(reg.buckets_size(), 1);
    std::set<std::string> handles;
    for (const v1::Bucket& bucket : reg.buckets()) {
      EXPECT_EQ(bucket.params_event_handle().size(), 64u);
      handles.insert(bucket.params_event_handle());
    }
    EXPECT_EQ(handles.size(), static_cast<size_t>(reg.buckets_size()));
    const std::vector<v1::StepResponse>& steps = run.responses[0];
    ASSERT_EQ(steps.size(), 4u);
    for (size_t k = 0; k < steps.size(); ++k) {
      EXPECT_EQ(steps[k].host_waits(), 1 + 2) << "step " << k + 1;
    }
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 4, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/dtype == DType::kFloat32));
    ASSERT_OK(run.Deregister(*cluster));
    cluster.reset();
    EXPECT_EQ(nccl.exported_events(), 0);
  }
}

// The step's updates wait for the trainer's last "gradients written"
// event (the one Step reports), not only for the ones each bucket's
// GradReady saw: trainer work queued after its last GradReady (on its
// parameters, say) comes before the daemon's writes. Every bucket reported
// through GradReady: per step one wait per bucket reduced and one before
// the updates.
TEST(NcclEngineTest, UpdatesWaitForTheTrainersLastEvent) {
  SetCpuBlasThreads(1);
  FakeCudaIpc ipc;
  FakeNcclApi nccl({.simulate_data = true});
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
  JobConfig config =
      MakeJobConfig("nccl-last-event", 1, 1, "cost", MuonModel());
  config.bucket_order = true;
  config.cuda_ipc = true;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  ASSERT_OK(run.RunStepsOverlapped(cluster, 1, 3, /*shuffled=*/false, 3));
  const int buckets = run.registered[0].buckets_size();
  // FakeCudaIpc's opened events are the fake itself.
  int waits = 0;
  for (const FakeNcclCall& c : nccl.calls_named("cudaStreamWaitEvent")) {
    if (c.send == static_cast<const void*>(&ipc)) ++waits;
  }
  EXPECT_EQ(waits, 3 * (buckets + 1));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster));
}

// A trainer's host runs ahead of its GPU and records its one gradients
// event again for every bucket it reports, so by the time the DP lane
// takes bucket b the event's latest record may be a later bucket's: a
// reduction waiting for it would wait for nearly all of backward. The
// daemon snapshots the event at each GradReady instead (GradientSnapshots):
// a stream of its own waits for the trainer's event then and records the
// bucket's event, and the bucket's reduction waits for that. The trainer's
// event itself is waited for directly only before the updates (the record
// Step reported).
TEST(NcclEngineTest, ReductionsWaitForTheRecordTheirGradReadySaw) {
  SetCpuBlasThreads(1);
  FakeCudaIpc ipc;
  FakeNcclApi nccl({.simulate_data = true});
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
  JobConfig config = MakeJobConfig("nccl-snapshots", 1, 1, "cost", MuonModel());
  config.bucket_order = true;
  config.cuda_ipc = true;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  nccl.ClearCalls();
  constexpr int kSteps = 3;
  ASSERT_OK(run.RunStepsOverlapped(cluster, 1, kSteps, /*shuffled=*/false, 5));
  const int buckets = run.registered[0].buckets_size();
  ASSERT_GE(buckets, 2);
  // Per stream, in order: the waits on the trainer's event (FakeCudaIpc's
  // opened events are the fake itself) and the events recorded or waited
  // for.
  const void* trainer = static_cast<const void*>(&ipc);
  std::map<NcclStream, int> trainer_waits;
  std::map<NcclStream, std::vector<FakeNcclCall>> on;
  for (const FakeNcclCall& c : nccl.calls()) {
    if (c.op != "cudaStreamWaitEvent" && c.op != "cudaEventRecord") continue;
    on[c.stream].push_back(c);
    if (c.op == "cudaStreamWaitEvent" && c.send == trainer) {
      ++trainer_waits[c.stream];
    }
  }
  // Two streams wait for it: the snapshots' (once per bucket reported)
  // and the copier's (once per step, before the updates).
  ASSERT_EQ(trainer_waits.size(), 2u);
  NcclStream snapshots = trainer_waits.begin()->first;
  NcclStream copier = std::next(trainer_waits.begin())->first;
  if (trainer_waits[snapshots] < trainer_waits[copier]) {
    std::swap(snapshots, copier);
  }
  EXPECT_EQ(trainer_waits[snapshots], kSteps * buckets);
  EXPECT_EQ(trainer_waits[copier], kSteps);
  // The snapshots' stream: each bucket's event recorded right after a wait
  // for the trainer's, in the order GradReady reported them.
  std::vector<const void*> recorded;
  const std::vector<FakeNcclCall>& taken = on[snapshots];
  ASSERT_EQ(taken.size(), 2u * kSteps * buckets);
  for (size_t i = 0; i < taken.size(); i += 2) {
    EXPECT_EQ(taken[i].op, "cudaStreamWaitEvent");
    EXPECT_EQ(taken[i].send, trainer);
    EXPECT_EQ(taken[i + 1].op, "cudaEventRecord");
    recorded.push_back(taken[i + 1].send);
  }
  // The copier waits for those events, each bucket for its own, in the
  // same order (the lane reduces in the order the buckets came).
  std::vector<const void*> waited;
  for (const FakeNcclCall& c : on[copier]) {
    if (c.op != "cudaStreamWaitEvent") continue;
    if (std::find(recorded.begin(), recorded.end(), c.send) != recorded.end()) {
      waited.push_back(c.send);
    }
  }
  EXPECT_EQ(waited, recorded);
  EXPECT_EQ(std::set<const void*>(recorded.begin(), recorded.end()).size(),
            static_cast<size_t>(buckets));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, kSteps, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster));
}

// A snapshot answers only for the step it was taken for, and none after
// the job moved to another step (a checkpoint loaded): a step number seen
// again must not find an old, long complete snapshot of a bucket not
// reported again, whose reduction would then not wait for backward.
TEST(GradientSnapshotsTest, OnlyTheirStepAndNoneAfterAMove) {
  FakeNcclApi nccl;
  int trainer_event = 0;
  ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<GradientSnapshots> snapshots,
      GradientSnapshots::Create(
          &nccl, 0, reinterpret_cast<NcclEvent>(&trainer_event), 3));
  EXPECT_EQ(snapshots->For(0, 1), nullptr);
  const std::vector<int> one = {1};
  ASSERT_OK(snapshots->Capture(5, one));
  EXPECT_NE(snapshots->For(5, 1), nullptr);
  EXPECT_EQ(snapshots->For(5, 0), nullptr);
  EXPECT_EQ(snapshots->For(6, 1), nullptr);
  snapshots->Forget();
  EXPECT_EQ(snapshots->For(5, 1), nullptr);
}

// The negative control: the answer comes before the parameters land (a
// GPU that has not reached the copies), so a trainer that skips the wait
// reads the old values; after its wait, the step's.
TEST(NcclEngineTest, TheParamsEventAnswersBeforeTheParametersLand) {
  SetCpuBlasThreads(1);
  FakeCudaIpc ipc;
  FakeNcclApi nccl({.simulate_data = true, .defer_copies = true});
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
  // bf16: every parameter is written from its master copy by the copier.
  JobConfig config =
      MakeJobConfig("nccl-params-early", 1, 1, "cost", MuonModel());
  config.bucket_order = true;
  config.dtype = DType::kBFloat16;
  config.cuda_ipc = true;
  config.params_event = true;
  config.skip_params_event_wait = true;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  ASSERT_OK(run.RunSteps(cluster, 1, 1));
  TrainerRank& rank = *run.ranks()[0];
  for (size_t i = 0; i < config.params.size(); ++i) {
    const ModelParam& p = config.params[i];
    EXPECT_EQ(rank.ParamBuffer(static_cast<int>(i)),
              Rounded(config.dtype, InitialParam(config, p)))
        << p.name;
  }
  ASSERT_OK(run.AwaitParams(cluster, rank, -1));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 1, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/false));
  ASSERT_OK(run.Deregister(cluster));
}

// What an early answer leaves in flight is the parameters' writes only:
// the daemon has read every gradient by then (its one wait, for the sums,
// comes after the reductions), so a trainer may overwrite its gradients
// right after the answer, before waiting for the events (canzona.torch's
// zero_grad, the next backward) without changing the step. The fake runs
// the copier's copies only at a wait, so a gradient read still pending at
// the answer would read the overwritten values here.
TEST(NcclEngineTest, TheGradientsAreReadBeforeAnEarlyAnswer) {
  SetCpuBlasThreads(1);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    FakeCudaIpc ipc;
    FakeNcclApi nccl({.simulate_data = true, .defer_copies = true});
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
    JobConfig config =
        MakeJobConfig("nccl-grads-read", 1, 1, "cost", MuonModel());
    config.bucket_order = true;
    config.dtype = dtype;
    config.cuda_ipc = true;
    config.params_event = true;
    config.skip_params_event_wait = true;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 1));
    TrainerRank& rank = *run.ranks()[0];
    rank.WriteGrads(/*step=*/7);  // another step's gradients, at once
    ASSERT_OK(run.AwaitParams(cluster, rank, -1));
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 1, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/dtype == DType::kFloat32));
    ASSERT_OK(run.Deregister(cluster));
  }
}

// With TP the step's waits stay as many: the TP owners' update sizes
// queue on the device with the DP-owned ones (one wait per TP-owned matrix
// before), whatever the number of matrices a rank owns. DP1 x TP2, two
// ranks: the sums, the two hand-overs (host waits on the cpu stand-in), the
// world's sum and one per bucket gathered.
TEST(NcclEngineTest, TpStepWaitsDoNotGrowWithTheMatrices) {
  SetCpuBlasThreads(1);
  for (int layers : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(layers, " layers"));
    FakeNcclApi nccl({.simulate_data = true, .defer_copies = true});
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", nullptr,
                    &nccl);
    // Muon and AdamW only (Shampoo and SOAP read their solvers on the host).
    JobConfig config =
        MakeJobConfig("nccl-tp-waits", 1, 2, "cost", MoeModel(2, layers));
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 3));
    for (int g = 0; g < config.world(); ++g) {
      const int buckets = run.registered[g].buckets_size();
      for (const v1::StepResponse& r : run.responses[g]) {
        EXPECT_EQ(r.host_waits(), 1 + 2 + 1 + buckets) << "rank " << g;
      }
      EXPECT_GT(run.responses[g].back().update_rms(), 0);
    }
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
    ASSERT_OK(run.Deregister(cluster));
  }
}

// Host (shared-memory) trainer buffers on the NCCL plane are page-locked
// for the device while their rank lives, each mapped object once, so that
// the staging copies are asynchronous DMA; a deregistered rank unpins them
// when it goes (after its linger, JobRegistry::Options::linger, 5 s).
TEST_F(NcclJobTest, SharedMemoryTrainerBuffersArePinnedWhileTheRankLives) {
  const JobConfig config = MakeJobConfig("nccl-pinned", 2, 1, "cost");
  ASSERT_OK(Register(config));
  JobRun& run = *run_;
  const std::vector<FakeNcclCall> pins = nccl_.calls_named("cudaHostRegister");
  EXPECT_GE(pins.size(), static_cast<size_t>(config.world()));
  EXPECT_EQ(nccl_.host_registered(), static_cast<int64_t>(pins.size()));
  for (const FakeNcclCall& c : pins) EXPECT_GT(c.count, 0);
  ASSERT_OK(run.RunSteps(cluster_, 1, 2));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 2, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster_));
  Eventually([&] { return nccl_.host_registered() == 0; }, absl::Seconds(30));
  EXPECT_EQ(nccl_.host_registered(), 0);
  EXPECT_EQ(nccl_.calls_named("cudaHostUnregister").size(), pins.size());
}

// The jobs whose copies meet host memory on the NCCL plane: a shared-memory
// fp32 trainer at DP2 x TP2 (the TP lane's copies too), or a CUDA IPC bf16
// one at DP2 with its buckets in order.
JobConfig HostCopiesConfig(const std::string& name, bool ipc_bf16) {
  JobConfig config = MakeJobConfig(name + (ipc_bf16 ? "-ipc" : "-shm"), 2,
                                   ipc_bf16 ? 1 : 2, "cost");
  if (ipc_bf16) {
    config.dtype = DType::kBFloat16;
    config.cuda_ipc = true;
    config.bucket_order = true;
  }
  return config;
}

// Every copy or conversion with a side in host memory reads or writes
// page-locked memory: a trainer's shared memory (fp32), and the daemon's
// own host floats, the world sums and the uneven calibration's, with a
// shared-memory fp32 trainer and a CUDA IPC bf16 one. A pageable side makes
// cudaMemcpyAsync wait inside the driver: before the copy, or, into
// pageable memory, until the copy and the all-reduce before it finished,
// a wait outside the copier's timeout that no count of waits shows (the
// world sums' 5 floats went so, each way, every step at DP > 1).
TEST(NcclEngineTest, HostSidesOfEveryCopyArePageLocked) {
  SetCpuBlasThreads(1);
  for (bool ipc_bf16 : {false, true}) {
    SCOPED_TRACE(ipc_bf16 ? "CUDA IPC bf16" : "shared memory fp32");
    FakeCudaIpc ipc;
    FakeNcclApi nccl(DataMode());
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
    JobConfig config = HostCopiesConfig("nccl-pinned", ipc_bf16);
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    nccl.ClearCalls();
    // RunSteps also fails on a copy of the compute backend's own between
    // the host and the "GPU" from or to pageable memory.
    ASSERT_OK(run.RunSteps(cluster, 1, 3));
    int64_t host_sides = 0;
    auto expect_pinned = [&](const FakeNcclCall& c, const void* side,
                             int64_t bytes, const char* which) {
      if (device_like::HostAlias(side) != nullptr ||
          nccl.DeviceAllocated(side, bytes) ||
          ipc.InsideOpened(side, static_cast<size_t>(bytes))) {
        return;  // device memory: the backend's, NCCL's, the trainer's
      }
      ++host_sides;
      EXPECT_TRUE(nccl.HostRegistered(side, bytes))
          << c.op << " " << c.dtype << " " << which << " " << side << " +"
          << bytes << " bytes is pageable";
    };
    for (const FakeNcclCall& c : nccl.calls_named("cudaMemcpyAsync")) {
      expect_pinned(c, c.send, c.count, "src");
      expect_pinned(c, c.recv, c.count, "dst");
    }
    for (const FakeNcclCall& c : nccl.calls_named("ConvertDTypeAsync")) {
      const bool widen = c.dtype == "bf16->fp32";
      expect_pinned(c, c.send, c.count * (widen ? 2 : 4), "src");
      expect_pinned(c, c.recv, c.count * (widen ? 4 : 2), "dst");
    }
    // The world sums, each way, every step, on both ranks.
    EXPECT_GE(host_sides, 2 * 3 * config.world());
    // And so the ranks report (StepResponse.pageable_copies,
    // RegisterResponse.pageable_host_bytes).
    EXPECT_THAT(run.ReportedPageableCopies(0), IsOkAndHolds(0));
    for (const v1::RegisterResponse& r : run.registered) {
      EXPECT_EQ(r.pageable_host_bytes(), 0);
    }
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/!ipc_bf16));
    ASSERT_OK(run.Deregister(cluster));
  }
}

// Where the driver refuses to page-lock (cudaHostRegister failing, as a
// memlock limit too small makes it), the steps still run and match the
// reference, and every rank reports its copies from and to pageable memory
// in each answer (StepResponse.pageable_copies, the metric and alert
// CanzonaPageableCopies): the compute backend's, the copier's (the
// trainer's shared memory, the world sums' host floats) and the trainer's
// CUDA IPC copies, each the one the process-wide count saw, none missed.
TEST(NcclEngineTest,
     RanksReportCopiesFromPageableMemoryWhenPageLockingIsRefused) {
  SetCpuBlasThreads(1);
  for (bool ipc_bf16 : {false, true}) {
    SCOPED_TRACE(ipc_bf16 ? "CUDA IPC bf16" : "shared memory fp32");
    FakeCudaIpc ipc;
    FakeNcclApi nccl(DataMode());
    nccl.RefuseHostRegister();
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
    cluster.page_locked = false;  // RunSteps: pageable copies are expected
    JobConfig config = HostCopiesConfig("nccl-refused", ipc_bf16);
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    EXPECT_EQ(nccl.host_registered(), 0);
    // Registration says so first: the sums' floats at least, a page each,
    // and the trainer's shared memory where it has some.
    const int64_t page = sysconf(_SC_PAGESIZE);
    for (const v1::RegisterResponse& r : run.registered) {
      EXPECT_GE(r.pageable_host_bytes(), ipc_bf16 ? page : 2 * page);
    }
    // And the gauge of each rank, on the daemon that runs it, says the same.
    int gauges = 0;
    for (const MetricsRegistry& metrics : cluster.metrics) {
      const std::map<std::string, double> samples =
          ExposedSamples(metrics.Expose());
      for (size_t g = 0; g < run.registered.size(); ++g) {
        const std::string series =
            absl::StrCat("canzona_rank_pageable_host_bytes{job=\"",
                         config.job_id, "\",rank=\"", g, "\"}");
        auto it = samples.find(series);
        if (it == samples.end()) continue;
        ++gauges;
        EXPECT_EQ(it->second,
                  static_cast<double>(run.registered[g].pageable_host_bytes()))
            << series;
      }
    }
    EXPECT_EQ(gauges, static_cast<int>(run.registered.size()));
    const int64_t before = PageableCopies();
    ASSERT_OK(run.RunSteps(cluster, 1, 3));
    // The world sums' floats at least, to the GPU and back, every answer.
    ASSERT_OK_AND_ASSIGN(int64_t reported, run.ReportedPageableCopies(2));
    EXPECT_EQ(reported, PageableCopies() - before) << LastPageableCopy();
    // And the daemons' status (canzonactl status) shows both, per rank.
    int64_t in_status = 0;
    for (const std::unique_ptr<Engine>& engine : cluster.engines) {
      const v1::GetStatusResponse status = engine->GetStatus();
      for (const v1::JobStatus& job : status.jobs()) {
        for (const v1::RankStatus& rank : job.local_ranks()) {
          EXPECT_GE(rank.pageable_host_bytes(), page);
          in_status += rank.pageable_copies();
        }
      }
    }
    EXPECT_EQ(in_status, reported);
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/!ipc_bf16));
    ASSERT_OK(run.Deregister(cluster));
  }
}

// Copies between the device staging and a trainer's shared memory (one
// side host memory, not device-like) in one step: where the trainer lays
// its buckets out in bucket order, one per bucket each for the gradients,
// the masters' fp32 values and the gathered parameters, whatever the
// number of parameters; interleaved, one per parameter.
TEST_F(NcclJobTest, SharedMemoryBucketsInBucketOrderMoveInOneCopyEach) {
  int64_t copies[2] = {0, 0};
  for (bool bucket_order : {false, true}) {
    SCOPED_TRACE(bucket_order ? "bucket order" : "interleaved");
    JobConfig config = MakeJobConfig(
        bucket_order ? "nccl-runs-b" : "nccl-runs-i", 2, 1, "cost");
    config.bucket_order = bucket_order;
    ASSERT_OK(Register(config));
    JobRun& run = *run_;
    ASSERT_OK(run.RunSteps(cluster_, 1, 1));
    nccl_.ClearCalls();
    ASSERT_OK(run.RunSteps(cluster_, 2, 2));
    int64_t buckets = 0;
    for (const v1::RegisterResponse& r : run.registered) {
      buckets += r.buckets_size();
    }
    for (const FakeNcclCall& c : nccl_.calls_named("cudaMemcpyAsync")) {
      if (device_like::HostAlias(c.send) == nullptr ||
          device_like::HostAlias(c.recv) == nullptr) {
        ++copies[bucket_order];
      }
    }
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 2, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
    if (bucket_order) {
      // Gradients, masters and parameters per bucket, and the uneven
      // calibration's sums to and from the host on the last gather.
      EXPECT_LE(copies[1], 3 * buckets + 2 * config.world());
    }
    ASSERT_OK(run.Deregister(cluster_));
  }
  const int64_t params = static_cast<int64_t>(MegatronModel().size());
  EXPECT_GE(copies[0], 2 * params);  // per parameter
  EXPECT_LT(copies[1], copies[0] / 2);
}

// One DP rank over a GPU trainer's CUDA IPC buffers in bucket order (what
// canzona.torch gives it) moves each bucket in one copy each way, though
// the trainer's memory is addressable in place: no collective reads it, so
// the gradients go to the owned ones and (bf16) the rounded masters back
// as runs. Before, one copy or conversion per parameter each way (620 a
// step for Qwen3-0.6B's 310 tensors, with bf16).
TEST(NcclEngineTest, OneRankIpcBucketsMoveInOneCopyEachWay) {
  SetCpuBlasThreads(1);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    FakeCudaIpc ipc;
    FakeNcclApi nccl(DataMode());
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
    JobConfig config =
        MakeJobConfig("nccl-ipc-runs", 1, 1, "cost", MegatronModel());
    config.bucket_order = true;
    config.bucket_size = 20000;
    config.dtype = dtype;
    config.cuda_ipc = true;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 1));  // bf16: reads the masters once
    nccl.ClearCalls();
    ASSERT_OK(run.RunSteps(cluster, 2, 3));
    const int64_t buckets = run.registered[0].buckets_size();
    ASSERT_GE(buckets, 2);
    const int64_t moves = nccl.calls_named("cudaMemcpyAsync").size() +
                          nccl.calls_named("ConvertDTypeAsync").size();
    // fp32: the gradients (updated in place); bf16: and the parameters.
    EXPECT_EQ(moves, 2 * buckets * (dtype == DType::kFloat32 ? 1 : 2));
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/dtype == DType::kFloat32));
    ASSERT_OK(run.Deregister(cluster));
  }
}

// A DP group of one runs no DP collective, so it reserves none of their
// memory: no NCCL scratch for the largest padded collective (the largest
// bucket: 1.6 GB at Qwen3-0.6B, 3.1 GB at Qwen3-8B) and no 16-bit
// reduce-scatter output for a bf16 trainer. Its buffers then weigh no
// more than an fp32 trainer's (the same buckets, the same owned fp32
// gradients).
TEST(NcclEngineTest, OneRankReservesNoCollectiveMemory) {
  SetCpuBlasThreads(1);
  int64_t buffer_bytes[2] = {0, 0};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    FakeCudaIpc ipc;
    FakeNcclApi nccl(DataMode());
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
    JobConfig config =
        MakeJobConfig("nccl-one-rank-memory", 1, 1, "cost", MegatronModel());
    config.dtype = dtype;
    config.cuda_ipc = true;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    int64_t reserved = 0;
    for (const FakeNcclCall& c : nccl.calls_named("cudaMalloc")) {
      reserved += c.count;
    }
    // The communicators' barrier floats only.
    EXPECT_LE(reserved, 64);
    buffer_bytes[dtype == DType::kBFloat16] = run.registered[0].buffer_bytes();
    ASSERT_OK(run.RunSteps(cluster, 1, 2));
    ASSERT_OK(run.Deregister(cluster));
  }
  EXPECT_LE(buffer_bytes[1], buffer_bytes[0]);
}

// With and without the trainer's "parameters written" event (recorded,
// rather than waited for, after the gathers: DP2 x TP2, sync and
// overlapped steps).
// Device-side waits of a stream that runs NCCL work for the trainer: for
// an event the fake never recorded (the trainer's), or for one recorded
// on a stream that waited for such (a GradientSnapshots event).
int NcclStreamWaitsForTheTrainer(const FakeNcclApi& nccl) {
  const std::vector<FakeNcclCall> calls = nccl.calls();
  std::set<const void*> recorded, trainers;
  std::set<NcclStream> waited_for_trainer, runs_nccl;
  for (const FakeNcclCall& c : calls) {
    if (c.op == "cudaEventRecord") recorded.insert(c.send);
  }
  for (const FakeNcclCall& c : calls) {
    if (c.op == "cudaStreamWaitEvent" && recorded.count(c.send) == 0) {
      trainers.insert(c.send);
      waited_for_trainer.insert(c.stream);
    }
  }
  for (const FakeNcclCall& c : calls) {
    if (c.op == "cudaEventRecord" && waited_for_trainer.count(c.stream) > 0) {
      trainers.insert(c.send);
    }
  }
  for (const FakeNcclCall& c : nccl.nccl_calls()) {
    if (c.stream != nullptr) runs_nccl.insert(c.stream);
  }
  int waits = 0;
  for (const FakeNcclCall& c : calls) {
    waits += c.op == "cudaStreamWaitEvent" && trainers.count(c.send) > 0 &&
             runs_nccl.count(c.stream) > 0;
  }
  return waits;
}

// CUDA IPC buffers move on the DP lane's stream, never through host
// memory. At DP1 the daemon's streams wait for the trainer's event on the
// device; at DP > 1, where NCCL work follows on that stream, the host
// polls it (or the snapshot of it GradReady took) instead: ncclCommAbort
// synchronizes with everything enqueued before its kernels, so a stream
// that waited for a trainer whose GPU never reaches its record would hold
// the step timeout's abort for as long.
TEST(NcclEngineTest, IpcBuffersMoveOnTheStreamAfterWaitingForTheEvent) {
  SetCpuBlasThreads(1);
  for (const auto& [dp, params_event] :
       {std::pair{2, false}, std::pair{2, true}, std::pair{1, true}}) {
    SCOPED_TRACE(absl::StrCat(
        "DP", dp,
        params_event ? ", parameters event" : ", no parameters event"));
    FakeCudaIpc ipc;
    FakeNcclApi nccl(DataMode());
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
    JobConfig config = MakeJobConfig("nccl-ipc", dp, 2, "cost");
    config.cuda_ipc = true;
    config.params_event = params_event;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 2));
    ASSERT_OK(run.RunStepsOverlapped(cluster, 3, 4, /*shuffled=*/true, 5));
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 4, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
    EXPECT_GT(nccl.calls_named("cudaStreamWaitEvent").size(), 0u);
    EXPECT_EQ(NcclStreamWaitsForTheTrainer(nccl), 0);
    if (dp == 1) {
      EXPECT_EQ(ipc.event_waits.load(), 0);
    } else {
      EXPECT_GT(ipc.event_waits.load(), 0);
    }
    EXPECT_EQ(ipc.copied_bytes.load(), 0);
    // The trainer's device memory needs no pinning: only the daemon's own
    // host floats are (SumThroughStaging's: a page each).
    for (const FakeNcclCall& c : nccl.calls_named("cudaHostRegister")) {
      EXPECT_EQ(c.count, sysconf(_SC_PAGESIZE));
    }
    ASSERT_OK(run.Deregister(cluster));
  }
}

TEST(NcclEngineTest, MissingPeerGivesAStatusAndAbortsNotAHang) {
  SetCpuBlasThreads(1);
  FakeNcclApi nccl(DataMode());
  const absl::Duration timeout = absl::Seconds(2);
  Cluster cluster(timeout, absl::Seconds(20), "cpu", nullptr, &nccl);
  JobRun run(MakeJobConfig("nccl-dead", 2, 1, "cost"));
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 1));
  // Rank 0 steps, rank 1 (the other daemon) never does: rank 0's first
  // NCCL collective cannot complete.
  TrainerRank& alive = *run.ranks()[0];
  alive.WriteGrads(2);
  const absl::Time start = absl::Now();
  Result<v1::StepResponse> step;
  cluster.engines[alive.engine_index()]->Step(alive.MakeStep(2),
                                              step.callback());
  const absl::StatusOr<v1::StepResponse> result = step.Get();
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_LT(absl::Now() - start, 2 * timeout + absl::Seconds(2));
  EXPECT_FALSE(nccl.calls_named("ncclCommAbort").empty());
  // The daemons keep serving another job on the NCCL plane.
  JobRun other(MakeJobConfig("nccl-after", 2, 1, "sc"));
  ASSERT_OK(other.Init());
  ASSERT_OK(other.RunAll(cluster, 2));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(other.config(), 2, {}));
  EXPECT_OK(other.Compare(reference, /*bitwise=*/true));
  EXPECT_OK(other.Deregister(cluster));
}

// One GPU at DP1 waits on the device for its trainer's "gradients
// written" event, then on the host for the step's sums. A trainer that
// died or hangs (in its own collective) before its GPU reaches the record
// leaves that stream waiting, maybe for good (the bundle's
// AWaitForADeadTrainersEventEndsByItsDeadline asks the driver). The
// device-like stand-in's work "never finishes" the same way: the step
// ends at the step timeout with DEADLINE_EXCEEDED instead of holding the
// rank's worker, the rank leaves without waiting on the stalled stream,
// and the daemon keeps serving. (Without the step's wait timeout the
// stand-in's unbounded wait fails after 20 s, where a GPU's would
// never return.)
TEST(NcclEngineTest, AStreamThatNeverFinishesEndsTheStepAtTheTimeout) {
  SetCpuBlasThreads(1);
  FakeCudaIpc ipc;
  FakeNcclApi nccl(DataMode());
  const absl::Duration timeout = absl::Seconds(2);
  Cluster cluster(timeout, absl::Seconds(20), "cpu", &ipc, &nccl);
  JobConfig config = MakeJobConfig("nccl-stalled", 1, 1, "cost", MuonModel());
  config.bucket_order = true;
  config.cuda_ipc = true;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  ASSERT_OK(run.RunSteps(cluster, 1, 1));
  SetDeviceLikeWorkBlocked(true);
  absl::Cleanup unblock = [] { SetDeviceLikeWorkBlocked(false); };
  const absl::Time start = absl::Now();
  EXPECT_THAT(run.RunSteps(cluster, 2, 2),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("did not finish within the wait timeout")));
  EXPECT_LT(absl::Now() - start, 2 * timeout + absl::Seconds(2));
  EXPECT_OK(run.Deregister(cluster));
  EXPECT_LT(absl::Now() - start, 4 * timeout + absl::Seconds(2));
  SetDeviceLikeWorkBlocked(false);
  JobRun other(MakeJobConfig("nccl-after-stall", 1, 1, "cost"));
  ASSERT_OK(other.Init());
  ASSERT_OK(other.RunAll(cluster, 2));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(other.config(), 2, {}));
  EXPECT_OK(other.Compare(reference, /*bitwise=*/true));
  EXPECT_OK(other.Deregister(cluster));
}

// NCCL runs one rank of a communicator per GPU; two trainers of a job on
// one GPU (a missing torch.cuda.set_device) are refused at registration,
// naming the ranks and the GPU, before NCCL (the fake as the library)
// would fail them after connecting. The daemons keep serving.
TEST(NcclEngineTest, TwoRanksOnOneGpuAreRefusedAtRegistration) {
  SetCpuBlasThreads(1);
  FakeCudaIpc ipc;
  FakeNcclApi nccl(DataMode());
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
  JobConfig config = MakeJobConfig("nccl-one-gpu", 4, 1, "cost");
  config.cuda_ipc = true;
  config.pci_bus_id = FakeCudaIpc::BusId(3);
  JobRun run(config);
  ASSERT_OK(run.Init());
  // The rank whose registration completes the pair is refused; the other,
  // when its answer comes after, reports the job that refusal failed
  // (ABORTED with the same cause): which one RegisterAll returns is a race.
  const auto cause =
      AllOf(HasSubstr("one rank per GPU"), HasSubstr("both use GPU 3"),
            HasSubstr("param.cuda_ipc.pci_bus_id"));
  EXPECT_THAT(run.RegisterAll(cluster),
              AnyOf(StatusIs(absl::StatusCode::kFailedPrecondition, cause),
                    StatusIs(absl::StatusCode::kAborted, cause)));
  EXPECT_TRUE(nccl.calls_named("ncclCommInitRank").empty());
  // Each rank on a GPU of its own (the default bus ids): it runs.
  JobConfig apart = MakeJobConfig("nccl-own-gpus", 4, 1, "cost");
  apart.cuda_ipc = true;
  JobRun other(apart);
  ASSERT_OK(other.Init());
  ASSERT_OK(other.RunAll(cluster, 2));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(apart, 2, {}));
  EXPECT_OK(other.Compare(reference, /*bitwise=*/true));
  EXPECT_OK(other.Deregister(cluster));
}

TEST(NcclEngineTest, SettingsAreValidated) {
  InMemoryKvStore kv;
  EngineOptions bad;
  bad.control = &kv;
  bad.comm = "mpi";
  EXPECT_THAT(CreateEngine(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("comm 'mpi'")));
  if (CudaDeviceCount() == 0) {
    EngineOptions nccl;
    nccl.control = &kv;
    nccl.comm = "nccl";
    nccl.backend = "auto";
    absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(nccl);
    ASSERT_FALSE(engine.ok());
    EXPECT_THAT(engine.status().message(), HasSubstr("comm 'nccl'"));
  }
}

TEST(NcclEngineTest, DaemonsWithDifferentDataPlanesCannotShareAJob) {
  FakeNcclApi nccl(DataMode());
  Cluster cluster(absl::Seconds(20), absl::Seconds(3), "cpu", nullptr, &nccl);
  // Daemon 1 on Gloo instead.
  cluster.engines[1]->Shutdown();
  EngineOptions gloo;
  gloo.control = &cluster.kv;
  gloo.daemon_id = "daemon1-gloo";
  gloo.register_timeout = absl::Seconds(3);
  ASSERT_OK_AND_ASSIGN(cluster.engines[1], CreateEngine(gloo));
  JobRun run(MakeJobConfig("nccl-mixed", 2, 1, "cost"));
  ASSERT_OK(run.Init());
  Result<v1::RegisterResponse> done[2];
  for (int r = 0; r < 2; ++r) {
    TrainerRank& rank = *run.ranks()[r];
    cluster.engines[rank.engine_index()]->Register(
        rank.MakeRegister(), PeerInfo{}, done[r].callback());
  }
  int disagreements = 0;
  for (auto& d : done) {
    absl::StatusOr<v1::RegisterResponse> result = d.Get();
    EXPECT_FALSE(result.ok());
    if (result.status().code() == absl::StatusCode::kFailedPrecondition &&
        absl::StrContains(result.status().message(), "comm=")) {
      ++disagreements;
    }
  }
  EXPECT_EQ(disagreements, 1);
}

}  // namespace
}  // namespace canzona::engine_test
