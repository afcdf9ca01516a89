#include "server/engine/rank_setup.h"

#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "proto/names/rank_names.h"
#include "server/engine/communicator_factory.h"
#include "server/engine/rank_builder.h"
#include "server/engine/register_request.h"
#include "server/engine/uneven_calibration.h"
#include "spdlog/spdlog.h"

namespace canzona {

int RankGpu(const TrainerBuffers* trainer, int global, int devices) {
  if (trainer != nullptr && trainer->on_device()) return trainer->device();
  return devices > 0 ? global % devices : 0;
}

// The compute backend on the rank's GPU (RankGpu), a cpu backend for host
// work, and where staging lives: host memory (Gloo) or the GPU (NCCL).
absl::Status RankBuilder::CreateBackends(const RankSetup& setup,
                                         RankBackends& b) {
  // The NCCL plane's ranks each have a GPU, even where the cpu backend
  // stands in for it (tests: a fake NCCL keeps them apart as NCCL does).
  const int devices =
      setup.backend == "cpu" && !setup.nccl ? 0 : setup.cuda_devices();
  b.device_ = RankGpu(setup.trainer, setup.global, devices);
  if ((setup.nccl || setup.device_like_cpu) && setup.backend == "cpu") {
    // Only tests run the NCCL plane on the cpu backend (over a fake NCCL,
    // EngineOptions::nccl_api), or ask for it on the Gloo plane
    // (EngineOptions::device_like_cpu). It stands in for the GPU with
    // device memory's rules: kernels and collectives only on its buffers
    // and the registered trainer memory, host memory only across a copy;
    // host work (and Gloo's staging) gets a cpu backend of its own, as
    // beside a GPU.
    CANZONA_ASSIGN_OR_RETURN(b.backend_,
                             CreateCpuBackend(MemorySpace::kDevice));
  } else if (setup.backend == "cpu" && setup.trainer != nullptr &&
             setup.trainer->on_device()) {
    // cpu compute is host staging here, page-locked for the GPU trainer's
    // copies (PinStaging): whole pages of its own.
    CANZONA_ASSIGN_OR_RETURN(
        b.backend_,
        CreateCpuBackend(MemorySpace::kHost, /*page_aligned=*/true));
  } else {
    CANZONA_ASSIGN_OR_RETURN(b.backend_,
                             CreateBackendByName(setup.backend, b.device_));
  }
  if (b.backend_->memory_space() == MemorySpace::kHost) {
    b.host_ = b.backend_.get();
  } else {
    // Host staging beside a GPU gets page-locked (PinStaging): whole pages
    // of its own, not shared with another rank's.
    CANZONA_ASSIGN_OR_RETURN(
        b.host_backend_,
        CreateCpuBackend(MemorySpace::kHost, /*page_aligned=*/true));
    b.host_ = b.host_backend_.get();
  }
  // The GPU the rank works with: its compute device, or where its
  // trainer's buffers live (cpu compute, host staging through IPC).
  const bool on_gpu = b.backend_->kind() != BackendKind::kCpu ||
                      (setup.trainer != nullptr && setup.trainer->on_device());
  if (on_gpu && setup.pci_bus_id) {
    CANZONA_ASSIGN_OR_RETURN(b.pci_bus_id_, setup.pci_bus_id(b.device_));
  }
  b.staging_ = setup.nccl ? b.backend_.get() : b.host_;
  // Trainer memory the data plane addresses in place (shared memory on the
  // host plane, CUDA IPC on the device plane) is the staging backend's to
  // check ranges against; the other kind is on the far side of a copy.
  const TrainerBuffers* trainer = setup.trainer;
  if (trainer != nullptr && trainer->Addressable(setup.nccl)) {
    for (const TrainerBuffers::MemoryRange& r : trainer->MemoryRanges()) {
      CANZONA_ASSIGN_OR_RETURN(
          RegisteredMemory registered,
          b.staging_->RegisterMemory(r.begin, r.bytes,
                                     absl::StrCat("trainer buffers of rank ",
                                                  RankString(setup.coords))));
      b.trainer_memory_.push_back(std::move(registered));
    }
  }
  return absl::OkStatus();
}

// NCCL (the library, one GPU per local rank, streams) or host copiers.
absl::StatusOr<RankBuilder::Copiers> RankBuilder::CreateDataPlane(
    const RankSetup& setup, RankBackends& b) {
  Copiers copiers;
  if (setup.nccl && setup.trainer != nullptr &&
      setup.trainer->mixed_precision() && !setup.trainer->on_device()) {
    // Device staging converts dtypes with kernels, which cannot read a
    // trainer's pageable shared memory.
    return absl::FailedPreconditionError(absl::StrCat(
        "parameters[].dtype: bf16 / fp16 shared-memory buffers need the Gloo "
        "data plane (canzonad --comm gloo) or CUDA tensors; job '",
        setup.job_id, "' runs on comm 'nccl'"));
  }
  if (!setup.nccl) {
    const AllocationRegistry* staging = &b.staging_->allocations();
    copiers.dp = CreateHostStagingCopier(staging);
    copiers.tp = CreateHostStagingCopier(staging);
    copiers.world = CreateHostStagingCopier(staging);
    return copiers;
  }
  NcclApi* api = setup.nccl_api;
  if (api == nullptr) {
    CANZONA_ASSIGN_OR_RETURN(api, RealNcclApi());
    // NCCL runs one rank of a communicator per GPU.
    const int devices = setup.cuda_devices();
    if (setup.local_ranks > devices) {
      return absl::FailedPreconditionError(absl::StrCat(
          "comm 'nccl' needs a GPU per local rank: job '", setup.job_id,
          "' has ", setup.local_ranks, " ranks on this daemon and ", devices,
          " GPU(s); run the daemon with --comm=gloo to share GPUs"));
    }
  }
  b.nccl_api_ = api;
  if (setup.trainer != nullptr && !setup.trainer->on_device()) {
    b.pinned_trainer_memory_ = PinnedHostMemory::Pin(
        api, b.device_, setup.trainer->SharedMemoryMappings());
  }
  for (auto* copier : {&copiers.dp, &copiers.tp, &copiers.world}) {
    CANZONA_ASSIGN_OR_RETURN(
        *copier, CreateDeviceStagingCopier(api, b.device_, setup.step_timeout,
                                           &b.staging_->allocations()));
  }
  return copiers;
}

// DP (same pp, tp; my shard group), TP (same pp, dp), world, and across
// shard groups. Every rank creates them in this order, so the rendezvous
// cannot deadlock.
absl::StatusOr<RankBuilder::Groups> RankBuilder::CreateCommunicators(
    const RankSetup& setup, RankRuntime& rt, const Copiers& copiers,
    UnevenCalibration* calibration) {
  CommunicatorFactory::Options options;
  options.control = setup.control;
  options.job_id = setup.job_id;
  options.rank_label = std::to_string(setup.global);
  options.nccl = rt.backends_.nccl_api();
  options.device = rt.device();
  options.gloo_host = setup.comm_host;
  options.timeout = setup.step_timeout;
  options.metrics = setup.metrics;
  options.staging = &rt.staging().allocations();
  const CommunicatorFactory factory(std::move(options));
  const RankLayout& layout = rt.layout_;
  const int pp = setup.coords.pp_rank(), t = setup.coords.tp_rank();
  const int DP = setup.settings->layout.dp(), TP = layout.tp_size;
  const int S = layout.shard_size, d = layout.shard_pos;
  const NcclCostModel cost = factory.nccl_cost();
  Groups groups;
  const std::string dp_name =
      S == DP ? absl::StrCat("dp.", pp, ".", t)
              : absl::StrCat("dp.", pp, ".", t, ".g", layout.shard_group);
  CANZONA_ASSIGN_OR_RETURN(
      groups.dp, factory.Make(
                     dp_name, d, S, *copiers.dp,
                     [calibration, cost](absl::Span<const int64_t> counts) {
                       return calibration->Choose(counts, cost);
                     },
                     layout.dp_scratch));
  CANZONA_ASSIGN_OR_RETURN(
      groups.tp,
      factory.Make(absl::StrCat("tp.", pp, ".", setup.coords.dp_rank()), t, TP,
                   *copiers.tp));
  CANZONA_ASSIGN_OR_RETURN(
      groups.world, factory.Make("world", setup.global, setup.settings->world,
                                 *copiers.world));
  CANZONA_ASSIGN_OR_RETURN(
      groups.cross, factory.Make(absl::StrCat("xdp.", pp, ".", t, ".p", d),
                                 layout.shard_group, DP / S, *copiers.dp));
  // Reported once all four exist: a failure above destroys the ones made
  // so far here, where nobody else holds them.
  for (const MadeCommunicator* made :
       {&groups.dp, &groups.tp, &groups.world, &groups.cross}) {
    setup.on_communicator(made->comm.get());
  }
  return groups;
}

absl::StatusOr<std::unique_ptr<RankRuntime>> RankBuilder::Build(
    const RankSetup& setup, v1::RegisterResponse* response) {
  std::unique_ptr<RankRuntime> rt(new RankRuntime());
  rt->plan_ = setup.plan;
  CANZONA_RETURN_IF_ERROR(CreateBackends(setup, rt->backends_));
  rt->pending_update_ = PendingUpdate(&rt->compute());
  CANZONA_ASSIGN_OR_RETURN(Copiers copiers,
                           CreateDataPlane(setup, rt->backends_));
  CANZONA_ASSIGN_OR_RETURN(
      rt->layout_, LayoutRank(*setup.plan, *setup.settings, setup.coords));
  auto calibration =
      rt->resident() && rt->layout_.sliced && rt->layout_.shard_size > 1
          ? std::make_unique<UnevenCalibration>(
                static_cast<int>(rt->layout_.buckets.size()))
          : std::make_unique<UnevenCalibration>();
  CANZONA_ASSIGN_OR_RETURN(
      Groups groups,
      CreateCommunicators(setup, *rt, copiers, calibration.get()));
  // From here on, a failed setup destroys communicators another thread may
  // abort (on_communicator): the engine forgets them first.
  absl::Cleanup forget = [&setup] {
    if (setup.on_failure) setup.on_failure();
  };
  rt->world_copier_ = std::move(copiers.world);
  rt->world_ = std::move(groups.world.comm);
  CANZONA_RETURN_IF_ERROR(AllocateOwned(setup, *rt));
  CANZONA_RETURN_IF_ERROR(CreateRules(setup, *rt));
  CANZONA_RETURN_IF_ERROR(BatchUpdates(setup, *rt));
  CANZONA_RETURN_IF_ERROR(CreateBucketCollectives(setup, *rt, copiers, groups,
                                                  std::move(calibration)));
  CANZONA_RETURN_IF_ERROR(CreateTpLane(setup, *rt, copiers, groups));
  PinStaging(setup, *rt);
  if (!rt->backends_.updates_in_place()) {
    spdlog::info("rank {} updates on {}", RankString(setup.coords),
                 rt->compute().description());
  }
  // The step's norm pass once on the zeroed gradients: what it reserves
  // (the cuda backend's segment table and partials) is reserved here, not
  // in step 1.
  std::vector<double> sums;
  CANZONA_RETURN_IF_ERROR(rt->SumGradients(sums));
  // Setup allocated and zero-filled staging on the compute backend's
  // stream; the lanes' copier and NCCL streams use it from the first step
  // on with no event in between.
  CANZONA_RETURN_IF_ERROR(rt->staging().Synchronize());
  CANZONA_RETURN_IF_ERROR(rt->compute().Synchronize());
  AccountMemory(setup, *rt);
  RegisterMetrics(setup, *rt);
  Describe(*rt, response);
  std::move(forget).Cancel();
  spdlog::info(
      "rank ready: job={} rank={} owned={} bytes: master={} state={} "
      "buffers={} micro_groups={}",
      setup.job_id, RankString(setup.coords), rt->owned_params_,
      rt->master_bytes_, rt->state_bytes_, rt->buffer_bytes_,
      rt->layout_.groups.size());
  if (const int64_t pageable = rt->pageable_host_bytes(); pageable > 0) {
    spdlog::warn(
        "rank {} of job {}: {} bytes of host memory the GPU copies to and "
        "from stay pageable (cudaHostRegister refused; raise the memlock "
        "limit, e.g. LimitMEMLOCK=infinity): its steps copy through bounce "
        "buffers (StepResponse.pageable_copies)",
        RankString(setup.coords), setup.job_id, pageable);
  }
  return rt;
}

absl::StatusOr<std::unique_ptr<RankRuntime>> SetupRank(
    const RankSetup& setup, v1::RegisterResponse* response) {
  return RankBuilder::Build(setup, response);
}

}  // namespace canzona
