// The NCCL data plane (EngineOptions::comm "nccl") without a GPU: the
// engine's device-resident step runs over FakeNcclApi in data mode
// (collectives summed in rank order) with the cpu backend standing in for
// the GPU under device memory's rules: its buffers are device-like memory
// the host cannot dereference, every kernel, copy, conversion and
// collective range is checked against the allocations as a driver would,
// and host work has a cpu backend of its own (server/DESIGN.md 4.6).
// This file checks the plan and the failures: every strategy's steps are
// bitwise equal to the single-process reference; the translation of the
// plan into NCCL calls (one reduce-scatter-v per bucket in bucket order,
// one all-gather-v per bucket in reverse order, their element counts, the
// same sequence on every rank, one world all-reduce); uneven buckets timed
// per-root and padded, then run the way the DP group measured faster; no
// allocation in steady-state steps; a missing peer, a stalled stream, two
// ranks on one GPU and bad settings. The step's waits are in
// nccl_engine_waits_test.cc, its copies to and from host memory in
// nccl_engine_copies_test.cc.

#include <map>
#include <memory>
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
#include "kernels/cuda/cuda_backend.h"
#include "server/engine/engine_impl.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/engine/engine_test_util.h"
#include "tests/unit/engine/nccl_engine_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::FakeNcclApi;
using ::canzona::testing::FakeNcclCall;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

struct Layout {
  std::string name;
  int dp, tp;
  std::string strategy;
  int shard_group_size;
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

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
  EXPECT_OK(RunMatchesReference(cluster, other, 2, /*bitwise=*/true,
                                /*deregister=*/true));
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
  const int closed = ipc.closes.load();
  const size_t destroyed = nccl.calls_named("cudaStreamDestroy").size();
  EXPECT_OK(run.Deregister(cluster));
  EXPECT_LT(absl::Now() - start, 4 * timeout + absl::Seconds(2));
  // The rank is gone (its streams destroyed) with its device work still
  // queued: the trainer's CUDA IPC mappings, which that work may read once
  // it runs, stay open instead of being closed under it.
  Eventually(
      [&] { return nccl.calls_named("cudaStreamDestroy").size() > destroyed; },
      absl::Seconds(30));
  EXPECT_EQ(ipc.closes.load(), closed);
  SetDeviceLikeWorkBlocked(false);
  JobRun other(MakeJobConfig("nccl-after-stall", 1, 1, "cost"));
  EXPECT_OK(RunMatchesReference(cluster, other, 2, /*bitwise=*/true,
                                /*deregister=*/true));
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
  EXPECT_OK(RunMatchesReference(cluster, other, 2, /*bitwise=*/true,
                                /*deregister=*/true));
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
