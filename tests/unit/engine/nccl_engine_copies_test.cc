// The NCCL data plane's copies between device staging and host memory (the
// cpu backend standing in for the GPU, as in nccl_engine_test.cc): a
// shared-memory trainer's buffers are page-locked while its rank lives;
// every copy with a host side reads or writes page-locked memory, and
// where the driver refuses to page-lock, every rank reports its pageable
// copies and bytes; buckets laid out in bucket order move in one copy each
// way; and a DP group of one reserves no collective memory.

#include <unistd.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/device_like_memory.h"
#include "kernels/pageable_copies.h"
#include "server/engine/engine_impl.h"
#include "server/metrics/registry.h"
#include "tests/matchers/exposed_samples.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/engine/engine_test_util.h"
#include "tests/unit/engine/nccl_engine_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::FakeNcclApi;
using ::canzona::testing::FakeNcclCall;
using ::canzona::testing::IsOkAndHolds;

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

}  // namespace
}  // namespace canzona::engine_test
