// GPU trainers' CUDA IPC buffers without a GPU: the registry's refcounting
// and validation, and the engine's IPC path end to end over FakeCudaIpc
// (host memory standing in for device allocations): every step bitwise
// equal to the reference, the trainer's event waited on, allocations
// opened once per rank and closed after it leaves, and on the Gloo plane
// one synchronous copy per bucket each way where the trainer lays its
// buckets out in bucket order (one per parameter otherwise).
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "server/engine/cuda_ipc_registry.h"
#include "server/engine/job_plan.h"
#include "server/engine/rank_layout.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/engine/engine_test_util.h"
#include "tests/unit/engine/parts_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::FakeNcclApi;
using ::canzona::testing::FakeNcclCall;
using ::canzona::testing::IsOkAndHolds;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

v1::CudaIpcBufferRef Ref(const std::string& handle, uint64_t offset,
                         uint64_t bytes, int device = 0) {
  v1::CudaIpcBufferRef r;
  r.set_mem_handle(handle);
  r.set_offset(offset);
  r.set_bytes(bytes);
  r.set_device(device);
  return r;
}

TEST(CudaIpcRegistryTest, OpensEachAllocationOnceAndClosesAfterTheLast) {
  FakeCudaIpc fake;
  std::vector<float> memory(1024);
  const std::string handle = FakeCudaIpc::Handle(memory.data(), 4096);
  CudaIpcRegistry registry(&fake);
  ASSERT_OK_AND_ASSIGN(
      CudaIpcRegistry::Mapping a,
      registry.Map("a", Ref(handle, 0, 64), 64, 4, /*device=*/0, 1));
  ASSERT_OK_AND_ASSIGN(
      CudaIpcRegistry::Mapping b,
      registry.Map("b", Ref(handle, 256, 128), 128, 4, /*device=*/0, 1));
  EXPECT_EQ(a.data(), memory.data());
  EXPECT_EQ(b.data(), memory.data() + 64);
  EXPECT_EQ(fake.opens.load(), 1);
  EXPECT_EQ(registry.open_allocations(), 1);
  a.Reset();
  EXPECT_EQ(fake.closes.load(), 0);
  CudaIpcRegistry::Mapping moved = std::move(b);
  moved.Reset();
  EXPECT_EQ(fake.closes.load(), 1);
  EXPECT_EQ(registry.open_allocations(), 0);
}

TEST(CudaIpcRegistryTest, BadReferencesNameTheFieldAndLeaveNothingOpen) {
  FakeCudaIpc fake;
  std::vector<float> memory(1024);
  const std::string handle = FakeCudaIpc::Handle(memory.data(), 4096);
  CudaIpcRegistry registry(&fake);
  EXPECT_THAT(
      registry.Map("p.grad", Ref("short", 0, 64), 64, 4, /*device=*/0, 1),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("p.grad.cuda_ipc.mem_handle")));
  EXPECT_THAT(
      registry.Map("p.grad", Ref(handle, 0, 64, 2), 64, 4, /*device=*/2, 2 - 1),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("cuda_ipc.device: 2 outside [0, 1)")));
  EXPECT_THAT(
      registry.Map("p.grad", Ref(handle, 2, 64), 64, 4, /*device=*/0, 1),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("p.grad.cuda_ipc.offset: 2 is not 4-byte aligned")));
  EXPECT_THAT(
      registry.Map("p.grad", Ref(handle, 3, 64), 64, 2, /*device=*/0, 1),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("p.grad.cuda_ipc.offset: 3 is not 2-byte aligned")));
  EXPECT_THAT(
      registry.Map("p.grad", Ref(handle, 0, 60), 64, 4, /*device=*/0, 1),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("cuda_ipc.bytes: 60")));
  EXPECT_THAT(
      registry.Map("p.grad", Ref(handle, 4064, 64), 64, 4, /*device=*/0, 1),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("leaves the exported allocation of 4096")));
  EXPECT_EQ(registry.open_allocations(), 0);
  EXPECT_EQ(fake.opens.load(), fake.closes.load());
}

JobConfig IpcConfig(const std::string& stem, int dp, int tp) {
  JobConfig c = MakeJobConfig(stem, dp, tp, "cost");
  c.cuda_ipc = true;
  return c;
}

TEST(CudaIpcEngineTest, StepsOnIpcBuffersAreBitwiseAndReleaseTheirMemory) {
  SetCpuBlasThreads(1);
  // Interleaved buffers (copied per parameter) and buckets in bucket order
  // (one copy per bucket), overlapped steps included.
  for (bool bucket_order : {false, true}) {
    SCOPED_TRACE(bucket_order ? "bucket order" : "interleaved");
    FakeCudaIpc fake;
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &fake);
    JobConfig config = IpcConfig("ipc", 2, 2);
    config.bucket_order = bucket_order;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    EXPECT_EQ(fake.opens.load(), config.world());  // one object per rank
    EXPECT_EQ(fake.events_open.load(), config.world());
    ASSERT_OK(run.RunSteps(cluster, 1, 3));
    ASSERT_OK(run.RunStepsOverlapped(cluster, 4, 6, true, 9));
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 6, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
    EXPECT_GT(fake.event_waits.load(), 0);
    EXPECT_GT(fake.copied_bytes.load(), 0);
    ASSERT_OK(run.Deregister(cluster));
    // Closed once the ranks stopped lingering (at most 5 s).
    Eventually([&] { return fake.closes.load() >= fake.opens.load(); },
               absl::Seconds(15));
    EXPECT_EQ(fake.closes.load(), fake.opens.load());
    EXPECT_EQ(fake.events_open.load(), 0);
  }
}

// A job whose every rank lived on one daemon, all of them gone: no peer can
// still read from their communicators, so the ranks go at the watcher's
// next round (200 ms) once their lanes drained, not after the linger (5 s)
// that protects peers on other daemons: a next job on the same GPU gets
// the memory at once.
TEST(CudaIpcEngineTest, ASingleDaemonJobReleasesItsMemoryBeforeTheLinger) {
  FakeCudaIpc fake;
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &fake);
  JobRun run(IpcConfig("ipc-local", 1, 1));
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  ASSERT_OK(run.RunSteps(cluster, 1, 2));
  ASSERT_OK(run.Deregister(cluster));
  Eventually([&] { return fake.closes.load() >= fake.opens.load(); },
             absl::Milliseconds(2500));
  EXPECT_EQ(fake.closes.load(), fake.opens.load());
  EXPECT_EQ(fake.events_open.load(), 0);
}

// The synchronous copies through the IPC layer (FakeCudaIpc's counters).
struct IpcCopies {
  int64_t to_host = 0, to_host_bytes = 0;
  int64_t from_host = 0, from_host_bytes = 0;
  bool operator==(const IpcCopies&) const = default;
};

std::ostream& operator<<(std::ostream& os, const IpcCopies& c) {
  return os << "{to_host " << c.to_host << " (" << c.to_host_bytes
            << " bytes), from_host " << c.from_host << " (" << c.from_host_bytes
            << " bytes)}";
}

IpcCopies CopiesOf(const FakeCudaIpc& fake) {
  return {fake.to_host.load(), fake.to_host_bytes.load(), fake.from_host.load(),
          fake.from_host_bytes.load()};
}

IpcCopies operator-(const IpcCopies& a, const IpcCopies& b) {
  return {a.to_host - b.to_host, a.to_host_bytes - b.to_host_bytes,
          a.from_host - b.from_host, a.from_host_bytes - b.from_host_bytes};
}

// What one step of every rank of `config` (a GPU trainer on the Gloo plane,
// strategies that hold whole buckets or slices of them) copies: every
// bucket's gradients in, and its parameters out (one DP rank or sc: the
// held ones, which are all; sliced: the gathered bucket); with `masters`
// (fp32 trainers every step, bf16 / fp16 ones on the first) the held
// parameters' master copies in. In bucket order one copy per bucket each,
// else one per parameter.
absl::StatusOr<IpcCopies> ExpectedCopies(const JobConfig& config,
                                         bool masters) {
  CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<const JobPlan> jp, PlanOf(config));
  const int64_t unit = DTypeBytes(config.dtype);
  IpcCopies c;
  for (int g = 0; g < config.world(); ++g) {
    CANZONA_ASSIGN_OR_RETURN(RankSpec spec, SpecOf(config, g));
    CANZONA_ASSIGN_OR_RETURN(RankLayout layout,
                             LayoutRank(*jp, spec.settings, spec.coords));
    for (const BucketLayout& b : layout.buckets) {
      const std::vector<int>& params = jp->plan.buckets[b.index].params;
      const int64_t copies =
          config.bucket_order ? 1 : static_cast<int64_t>(params.size());
      c.to_host += copies;
      c.to_host_bytes += b.elements * unit;
      c.from_host += copies;
      c.from_host_bytes += b.elements * unit;
      int64_t held = 0, held_elements = 0;
      for (int i : params) {
        if (layout.owned_offset[i] < 0) continue;
        ++held;
        held_elements += jp->params[i].fragment_numel;
      }
      if (masters && held > 0) {
        c.to_host += config.bucket_order ? 1 : held;
        c.to_host_bytes += held_elements * unit;
      }
    }
  }
  return c;
}

// strategy, dp, trainer dtype, fp32 reduce, trainer layout in bucket order.
using CopyCase = std::tuple<std::string, int, DType, bool, bool>;

class IpcBucketCopiesTest : public ::testing::TestWithParam<CopyCase> {};

TEST_P(IpcBucketCopiesTest, OneCopyPerBucketEachWayInBucketOrder) {
  SetCpuBlasThreads(1);
  const auto& [strategy, dp, dtype, reduce_fp32, bucket_order] = GetParam();
  JobConfig config = MakeJobConfig("ipc-copies", dp, /*tp=*/1, strategy);
  config.cuda_ipc = true;
  config.dtype = dtype;
  config.grad_reduce_fp32 = reduce_fp32;
  config.bucket_order = bucket_order;
  constexpr int kSteps = 3;
  std::vector<IpcCopies> expected;
  for (int step = 1; step <= kSteps; ++step) {
    // bf16 / fp16 master weights are read once; fp32 values every step.
    ASSERT_OK_AND_ASSIGN(
        IpcCopies e,
        ExpectedCopies(config, step == 1 || dtype == DType::kFloat32));
    expected.push_back(e);
  }
  FakeCudaIpc fake;
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &fake);
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  for (int step = 1; step <= kSteps; ++step) {
    const IpcCopies before = CopiesOf(fake);
    ASSERT_OK(run.RunSteps(cluster, step, step));
    EXPECT_EQ(CopiesOf(fake) - before, expected[step - 1]) << "step " << step;
  }
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, kSteps, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster));
}

std::string CopyCaseName(const ::testing::TestParamInfo<CopyCase>& info) {
  const auto& [strategy, dp, dtype, reduce_fp32, bucket_order] = info.param;
  return absl::StrCat(strategy, "_dp", dp, "_", DTypeName(dtype),
                      reduce_fp32 ? "_reduce_fp32" : "",
                      bucket_order ? "_bucket_order" : "_interleaved");
}

INSTANTIATE_TEST_SUITE_P(Fp32, IpcBucketCopiesTest,
                         ::testing::Combine(::testing::Values("cost", "sc"),
                                            ::testing::Values(1, 2),
                                            ::testing::Values(DType::kFloat32),
                                            ::testing::Values(false),
                                            ::testing::Bool()),
                         CopyCaseName);
INSTANTIATE_TEST_SUITE_P(Bf16, IpcBucketCopiesTest,
                         ::testing::Combine(::testing::Values("cost", "sc"),
                                            ::testing::Values(1, 2),
                                            ::testing::Values(DType::kBFloat16),
                                            ::testing::Bool(),
                                            ::testing::Bool()),
                         CopyCaseName);

// Runs `body` once per data plane, with GPU trainers over FakeCudaIpc:
// the Gloo plane, then the NCCL plane over a FakeNcclApi that moves data.
void OnBothDataPlanes(
    const std::function<void(bool nccl_plane, Cluster& cluster)>& body) {
  for (const bool nccl_plane : {false, true}) {
    SCOPED_TRACE(nccl_plane ? "NCCL plane" : "Gloo plane");
    FakeCudaIpc ipc;
    FakeNcclApi nccl({.simulate_data = true, .defer_copies = true});
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc,
                    nccl_plane ? &nccl : nullptr);
    body(nccl_plane, cluster);
  }
}

// A bf16 job of GPU trainers laid out as canzona.torch lays them out
// (bucket order): DP1 on the NCCL plane, DP2 on the Gloo plane.
JobConfig Bf16IpcJob(const std::string& stem, bool nccl_plane,
                     std::vector<ModelParam> model) {
  JobConfig config =
      MakeJobConfig(stem, nccl_plane ? 1 : 2, 1, "cost", std::move(model));
  config.dtype = DType::kBFloat16;
  config.cuda_ipc = true;
  config.bucket_order = true;
  return config;
}

// A bf16 model packed back to back, as canzona.torch packs it, where a
// parameter of odd size puts every later one 2 bytes past a 4-byte
// boundary: registered and stepped bitwise on both data planes (the GPU
// run's torch models had even sizes only; a 4-byte rule refused these).
TEST(CudaIpcEngineTest, Bfloat16TensorsAtTwoByteOffsetsStepBitwise) {
  SetCpuBlasThreads(1);
  std::vector<ModelParam> model = {
      {"embed.weight", {96, 32}, 0, "adamw"},
      {"layers.0.norm.weight", {33}, -1, "adamw"},
      {"layers.0.attn.weight", {64, 32}, 0, "muon"},
      {"layers.0.gate.bias", {7}, -1, "adamw"},
      {"layers.0.mlp.weight", {32, 64}, 1, "muon"}};
  OnBothDataPlanes([&](bool nccl_plane, Cluster& cluster) {
    const JobConfig config = Bf16IpcJob("ipc-odd", nccl_plane, model);
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 3));
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
    ASSERT_OK(run.Deregister(cluster));
  });
}

// bf16 weights a GPU trainer loads between steps become the masters on
// both data planes (StepRequest.reload_params; the NCCL plane's reads are
// the daemon's device copies), and only when listed.
TEST(CudaIpcEngineTest, Bfloat16ParametersTheTrainerChangedBecomeTheMasters) {
  SetCpuBlasThreads(1);
  OnBothDataPlanes([](bool nccl_plane, Cluster& cluster) {
    const JobConfig config =
        Bf16IpcJob("ipc-reload", nccl_plane, MegatronModel());
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 2));
    const int all = config.world() * static_cast<int>(config.params.size());
    EXPECT_THAT(StepAfterLoadingParams(cluster, run, 3, /*reload=*/false),
                IsOkAndHolds(0));
    EXPECT_THAT(StepAfterLoadingParams(cluster, run, 4, /*reload=*/true),
                IsOkAndHolds(all));
    ASSERT_OK(run.Deregister(cluster));
  });
}

// The same for values that round to the masters: listed as changed, the
// masters keep their fp32 bits on both data planes (the NCCL plane
// compares in its device copier's kernel).
TEST(CudaIpcEngineTest,
     Bfloat16ReloadedParametersThatRoundToTheirMastersKeepThem) {
  SetCpuBlasThreads(1);
  OnBothDataPlanes([](bool nccl_plane, Cluster& cluster) {
    const JobConfig config =
        Bf16IpcJob("ipc-keep", nccl_plane, MegatronModel());
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 1));
    ASSERT_OK(run.RunSteps(cluster, 2, 3,
                           [&](const TrainerRank& rank, v1::StepRequest& r) {
                             ReloadEveryHeldParam(config.params, rank, r);
                           }));
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 3, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
    if (nccl_plane) {
      // The comparison ran in the device copier's kernel.
      auto* fake = dynamic_cast<FakeNcclApi*>(cluster.nccl);
      ASSERT_NE(fake, nullptr);
      EXPECT_FALSE(fake->calls_named("ReloadMastersAsync").empty());
    }
    ASSERT_OK(run.Deregister(cluster));
  });
}

TEST(CudaIpcEngineTest, MixedOrUnservableBuffersAreRejected) {
  FakeCudaIpc fake;
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &fake);
  JobRun run(IpcConfig("ipc-mixed", 1, 1));
  ASSERT_OK(run.Init());
  v1::RegisterRequest request = run.ranks()[0]->MakeRegister();
  // One shm buffer among IPC ones.
  v1::RegisterRequest mixed = request;
  mixed.mutable_parameters(1)->mutable_grad()->mutable_shm()->set_name("/x");
  Result<v1::RegisterResponse> done;
  cluster.engines[0]->Register(mixed, PeerInfo{}, done.callback());
  EXPECT_THAT(done.Get(), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("parameters[1]")));
  // Different event handles on one rank.
  v1::RegisterRequest events = request;
  events.mutable_parameters(2)
      ->mutable_grad()
      ->mutable_cuda_ipc()
      ->set_event_handle(FakeCudaIpc::EventHandle(77));
  Result<v1::RegisterResponse> done2;
  cluster.engines[0]->Register(events, PeerInfo{}, done2.callback());
  EXPECT_THAT(done2.Get(), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("one event per rank")));
  EXPECT_EQ(fake.opens.load(), fake.closes.load());
  EXPECT_EQ(fake.events_open.load(), 0);
  EXPECT_EQ(cluster.engines[0]->GetStatus().jobs_size(), 0);
}

// Under CUDA_VISIBLE_DEVICES or a device plugin every trainer sees its GPU
// as device 0; the PCI bus id names it for the daemon, which sees all.
TEST(CudaIpcEngineTest, TheTrainersGpuIsFoundByItsPciBusId) {
  SetCpuBlasThreads(1);
  FakeCudaIpc fake;
  fake.devices = 4;
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &fake);
  JobConfig config = IpcConfig("ipc-bus", 1, 1);
  config.pci_bus_id = FakeCudaIpc::BusId(2);
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  EXPECT_EQ(fake.last_open_device.load(), 2);
  ASSERT_OK(run.RunSteps(cluster, 1, 2));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 2, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  const v1::GetStatusResponse status = cluster.engines[0]->GetStatus();
  ASSERT_EQ(status.jobs_size(), 1);
  ASSERT_EQ(status.jobs(0).local_ranks_size(), 1);
  EXPECT_EQ(status.jobs(0).local_ranks(0).device(), 2);
  EXPECT_EQ(status.jobs(0).local_ranks(0).pci_bus_id(), "0000:02:00.0");
  ASSERT_OK(run.Deregister(cluster));
}

// A trainer that died before its GPU reached its "gradients written"
// record may leave the event pending for good. The Gloo plane waits for it
// on the host (the DP lane, per bucket): the wait ends at the step timeout
// with an error instead of holding the lane, and with it the rank's
// removal, forever.
// On the Gloo plane, and on the NCCL plane at DP > 1 (where the host
// polls the event before NCCL work: nccl_engine_test's
// IpcBuffersMoveOnTheStreamAfterWaitingForTheEvent says why).
TEST(CudaIpcEngineTest, APendingTrainerEventEndsTheStepAtTheTimeout) {
  SetCpuBlasThreads(1);
  for (const bool nccl_plane : {false, true}) {
    SCOPED_TRACE(nccl_plane ? "NCCL plane, DP2" : "Gloo plane");
    FakeCudaIpc fake;
    FakeNcclApi nccl({.simulate_data = true});
    const absl::Duration timeout = absl::Seconds(2);
    Cluster cluster(timeout, absl::Seconds(20), "cpu", &fake,
                    nccl_plane ? &nccl : nullptr);
    JobConfig config = IpcConfig("ipc-pending", nccl_plane ? 2 : 1, 1);
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(run.RunSteps(cluster, 1, 1));
    fake.events_complete = false;
    const absl::Time start = absl::Now();
    EXPECT_THAT(run.RunSteps(cluster, 2, 2),
                StatusIs(absl::StatusCode::kDeadlineExceeded));
    EXPECT_LT(absl::Now() - start, 4 * timeout);
    EXPECT_OK(run.Deregister(cluster));
    EXPECT_LT(absl::Now() - start, 8 * timeout);
  }
}

// On the Gloo plane too, a GPU trainer's gradients event is snapshot at
// each GradReady (GradientSnapshots): a stream of the daemon's waits for
// the record as of then and records the bucket's own event, and bucket b's
// reduction polls that on the host. Before, each reduction waited on the
// host for the event's latest record, often the last bucket's (the
// trainer's host runs ahead of its GPU): every reduction waited for nearly
// all of backward, and none overlapped it. The trainer's event itself is
// waited for once a step, before the updates (the record Step reported).
TEST(CudaIpcEngineTest, GlooReductionsWaitForTheRecordTheirGradReadySaw) {
  SetCpuBlasThreads(1);
  FakeCudaIpc ipc;
  FakeNcclApi cuda({.simulate_data = true});  // the CUDA runtime's calls
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &ipc, &cuda,
                  /*batch_updates=*/true, /*device_like_cpu=*/false,
                  /*gloo=*/true);
  JobConfig config = IpcConfig("ipc-gloo-snapshots", 2, 1);
  config.bucket_order = true;
  JobRun run(config);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  EXPECT_TRUE(cuda.calls_named("ncclCommInitRank").empty()) << "Gloo plane";
  cuda.ClearCalls();
  ipc.event_waits = 0;
  constexpr int kSteps = 3;
  ASSERT_OK(run.RunStepsOverlapped(cluster, 1, kSteps, /*shuffled=*/false, 5));
  int64_t buckets = 0;
  for (const v1::RegisterResponse& r : run.registered) {
    buckets += r.buckets_size();
  }
  ASSERT_GE(buckets, 2 * config.world());
  // Each rank's snapshot stream waits for its trainer's event (one
  // FakeCudaIpc opened) once per bucket reported, and records that bucket's
  // event; the reductions poll those (cudaEventQuery: the only events
  // polled on this plane).
  std::set<const void*> recorded;
  int64_t snapshot_waits = 0;
  for (const FakeNcclCall& c : cuda.calls()) {
    if (c.op == "cudaStreamWaitEvent" && ipc.IsOpenEvent(c.send)) {
      ++snapshot_waits;
    }
    if (c.op == "cudaEventRecord") recorded.insert(c.send);
  }
  EXPECT_EQ(snapshot_waits, kSteps * buckets);
  EXPECT_EQ(recorded.size(), static_cast<size_t>(buckets));
  EXPECT_GE(cuda.poll_count(), kSteps * buckets);
  // The host waits for the trainer's event itself: once a step per rank
  // (was once per bucket more).
  EXPECT_EQ(ipc.event_waits.load(), kSteps * config.world());
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, kSteps, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  ASSERT_OK(run.Deregister(cluster));
}

TEST(CudaIpcEngineTest, AGpuTheDaemonCannotSeeIsNamedByItsBusId) {
  FakeCudaIpc fake;
  fake.devices = 2;
  Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", &fake);
  JobConfig config = IpcConfig("ipc-unseen", 1, 1);
  config.pci_bus_id = FakeCudaIpc::BusId(9);
  JobRun run(config);
  ASSERT_OK(run.Init());
  Result<v1::RegisterResponse> done;
  cluster.engines[0]->Register(run.ranks()[0]->MakeRegister(), PeerInfo{},
                               done.callback());
  EXPECT_THAT(done.Get(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("param.cuda_ipc.pci_bus_id"),
                             HasSubstr("0000:09:00.0 is not visible"))));
  EXPECT_EQ(fake.opens.load(), fake.closes.load());
  EXPECT_EQ(cluster.engines[0]->GetStatus().jobs_size(), 0);
}

TEST(CudaIpcEngineTest, DaemonWithoutDevicesRefusesIpcBuffers) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a GPU";
  Cluster cluster;  // the real CUDA layer: no device here
  JobRun run(IpcConfig("ipc-nodev", 1, 1));
  ASSERT_OK(run.Init());
  Result<v1::RegisterResponse> done;
  cluster.engines[0]->Register(run.ranks()[0]->MakeRegister(), PeerInfo{},
                               done.callback());
  EXPECT_THAT(done.Get(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("cuda_ipc: this daemon has no usable CUDA")));
}

}  // namespace
}  // namespace canzona::engine_test
