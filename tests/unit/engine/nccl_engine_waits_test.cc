// The NCCL data plane's waits (the cpu backend standing in for the GPU, as
// in nccl_engine_test.cc): one GPU's step waits on the host only for its
// sums and the gathers' answers, whatever the buckets or the matrices; the
// trainer's "gradients written" events are waited for on the device, each
// bucket's reduction for the record its GradReady saw (GradientSnapshots)
// and the updates for the last; the "parameters written" events let the
// answer come before the writes land, never before the gradients are read;
// and no stream that runs NCCL work waits on the device for a trainer.

#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/engine/engine_impl.h"
#include "server/engine/gradient_snapshots.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/engine/engine_test_util.h"
#include "tests/unit/engine/nccl_engine_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::FakeNcclApi;
using ::canzona::testing::FakeNcclCall;

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
  int waits = 0;
  for (const FakeNcclCall& c : nccl.calls_named("cudaStreamWaitEvent")) {
    if (ipc.IsOpenEvent(c.send)) ++waits;
  }
  EXPECT_EQ(waits, 3 * (buckets + 1));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster));
}

// A bf16 trainer that loads new weights on its GPU between its last
// GradReady and Step (StepRequest.reload_params) wrote them before the
// event Step reports, not before the records the reductions waited for:
// the copier reads them again (ReloadMastersAsync) only after waiting
// for that last event. Before, it read them first and waited after, so on
// a GPU the masters could take the old values, which the update then
// wrote over the trainer's edit.
TEST(NcclEngineTest, ReloadedMastersWaitForTheTrainersLastEvent) {
  SetCpuBlasThreads(1);
  FakeCudaIpc ipc;
  FakeNcclApi nccl({.simulate_data = true});
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &nccl);
  JobConfig config = MakeJobConfig("nccl-reload", 1, 1, "cost", MuonModel());
  config.dtype = DType::kBFloat16;
  config.bucket_order = true;
  config.cuda_ipc = true;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  ASSERT_OK(run.RunStepsOverlapped(cluster, 1, 1, /*shuffled=*/false, 7));
  nccl.ClearCalls();
  ASSERT_OK(run.RunStepsOverlapped(
      cluster, 2, 2, /*shuffled=*/false, 7,
      [&](const TrainerRank& rank, v1::StepRequest& request) {
        ReloadEveryHeldParam(config.params, rank, request);
      }));
  // On the stream that reloads: the first reload comes after a wait for
  // the trainer's own event, with none of the snapshot waits (GradReady's
  // records) between them.
  NcclStream copier = nullptr;
  for (const FakeNcclCall& c : nccl.calls_named("ReloadMastersAsync")) {
    copier = c.stream;
  }
  ASSERT_NE(copier, nullptr);
  std::string last_wait = "none";
  bool reloaded = false;
  for (const FakeNcclCall& c : nccl.calls()) {
    if (c.stream != copier) continue;
    if (c.op == "cudaStreamWaitEvent") {
      last_wait = ipc.IsOpenEvent(c.send) ? "the trainer's event"
                                          : "a GradReady record";
    } else if (c.op == "ReloadMastersAsync") {
      EXPECT_EQ(last_wait, "the trainer's event");
      reloaded = true;
      break;
    }
  }
  EXPECT_TRUE(reloaded);
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
  // Per stream, in order: the waits on the trainer's event (the one
  // FakeCudaIpc opened) and the events recorded or waited for.
  std::map<NcclStream, int> trainer_waits;
  std::map<NcclStream, std::vector<FakeNcclCall>> on;
  for (const FakeNcclCall& c : nccl.calls()) {
    if (c.op != "cudaStreamWaitEvent" && c.op != "cudaEventRecord") continue;
    on[c.stream].push_back(c);
    if (c.op == "cudaStreamWaitEvent" && ipc.IsOpenEvent(c.send)) {
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
    EXPECT_TRUE(ipc.IsOpenEvent(taken[i].send));
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
// With and without the trainer's "parameters written" event (recorded,
// rather than waited for, after the gathers), DP2 x TP2 and DP1, sync and
// overlapped steps.
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

}  // namespace
}  // namespace canzona::engine_test
