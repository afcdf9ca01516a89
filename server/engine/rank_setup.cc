#include "server/engine/rank_setup.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "proto/names/rank_names.h"
#include "server/comm/gloo_communicator.h"
#include "server/engine/communicator_factory.h"
#include "server/engine/register_request.h"
#include "server/engine/uneven_calibration.h"
#include "server/metrics/canzona_metrics.h"
#include "spdlog/spdlog.h"

namespace canzona {

// SetupRank's named steps, each filling in part of the runtime it builds
// (RankRuntime and RankBackends let it in). Stateless: what one setup
// passes from step to step is in Build's locals.
class RankBuilder {
 public:
  static absl::StatusOr<std::unique_ptr<RankRuntime>> Build(
      const RankSetup& setup, v1::RegisterResponse* response);

 private:
  // The copiers (streams) of the DP lane, the TP lane and the world sums.
  struct Copiers {
    std::unique_ptr<StagingCopier> dp, tp, world;
  };
  struct Groups {
    MadeCommunicator dp, tp, world, cross;
  };

  static absl::Status CreateBackends(const RankSetup& setup, RankBackends& b);
  static absl::StatusOr<Copiers> CreateDataPlane(const RankSetup& setup,
                                                 RankBackends& b);
  static absl::StatusOr<Groups> CreateCommunicators(
      const RankSetup& setup, RankRuntime& rt, const Copiers& copiers,
      UnevenCalibration* calibration);
  static absl::Status AllocateOwned(const RankSetup& setup, RankRuntime& rt);
  static absl::Status CreateRules(const RankSetup& setup, RankRuntime& rt);
  static absl::Status BatchUpdates(const RankSetup& setup, RankRuntime& rt);
  static absl::Status CreateBucketCollectives(
      const RankSetup& setup, RankRuntime& rt, Copiers& copiers, Groups& groups,
      std::unique_ptr<UnevenCalibration> cal);
  static absl::Status CreateTpLane(const RankSetup& setup, RankRuntime& rt,
                                   Copiers& copiers, Groups& groups);
  static void PinStaging(const RankSetup& setup, RankRuntime& rt);
  static void RegisterMetrics(const RankSetup& setup, RankRuntime& rt);
  static void AccountMemory(const RankSetup& setup, RankRuntime& rt);
  static void Describe(const RankRuntime& rt, v1::RegisterResponse* response);
};

namespace {

// The fp32 bytes of `buffer`.
int64_t Bytes(const DeviceBuffer& buffer) {
  return buffer.size() * static_cast<int64_t>(sizeof(float));
}

}  // namespace

// The compute backend on the rank's GPU, a cpu backend for host work, and
// where staging lives: host memory (Gloo) or the GPU (NCCL). The rank's GPU
// is the one its trainer's buffers live on (found by PCI bus id); a trainer
// with host buffers gets its global rank modulo the devices present (a
// node's trainers are its consecutive global ranks).
absl::Status RankBuilder::CreateBackends(const RankSetup& setup,
                                         RankBackends& b) {
  const int devices = setup.backend == "cpu" ? 0 : setup.cuda_devices();
  if (setup.trainer != nullptr && setup.trainer->on_device()) {
    b.device_ = setup.trainer->device();
  } else {
    b.device_ = devices > 0 ? setup.global % devices : 0;
  }
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
  } else {
    CANZONA_ASSIGN_OR_RETURN(b.backend_,
                             CreateBackendByName(setup.backend, b.device_));
  }
  if (b.backend_->memory_space() == MemorySpace::kHost) {
    b.host_ = b.backend_.get();
  } else {
    CANZONA_ASSIGN_OR_RETURN(b.host_backend_, CreateBackend(BackendKind::kCpu));
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

// ZeRO-1: the owned gradients and master copies of what the rank holds
// (owned_buffers.h), and the whole-matrix work buffers.
absl::Status RankBuilder::AllocateOwned(const RankSetup& setup,
                                        RankRuntime& rt) {
  const RankLayout& layout = rt.layout_;
  Backend& staging = rt.staging();
  CANZONA_RETURN_IF_ERROR(
      canzona::AllocateOwned(*rt.plan_, layout, *setup.trainer, rt.resident(),
                             staging, &rt.owned_memory_, &rt.owned_));
  // Where the DP-owned updates run (in staging, or OwnedDeviceCopy's).
  CANZONA_ASSIGN_OR_RETURN(rt.before_,
                           rt.compute().Allocate(layout.max_counted_local));
  CANZONA_ASSIGN_OR_RETURN(rt.scalars_,
                           staging.Allocate(RankRuntime::kWorldValues));
  CANZONA_ASSIGN_OR_RETURN(rt.redundant_send_,
                           staging.Allocate(2 * layout.max_redundant));
  CANZONA_ASSIGN_OR_RETURN(
      rt.redundant_recv_,
      staging.Allocate(2 * layout.max_redundant * layout.tp_size));
  CANZONA_ASSIGN_OR_RETURN(rt.whole_grad_, staging.Allocate(layout.max_whole));
  CANZONA_ASSIGN_OR_RETURN(rt.whole_param_, staging.Allocate(layout.max_whole));
  if (!rt.backends_.updates_in_place()) {
    CANZONA_ASSIGN_OR_RETURN(rt.device_param_,
                             rt.compute().Allocate(layout.max_state));
    CANZONA_ASSIGN_OR_RETURN(rt.device_grad_,
                             rt.compute().Allocate(layout.max_state));
  }
  return absl::OkStatus();
}

// The update rules, and their state, only where the rank keeps state; one
// scratch for all of them (they step one at a time), the largest first so
// that its block fits every later one.
absl::Status RankBuilder::CreateRules(const RankSetup& setup, RankRuntime& rt) {
  const JobPlan& jp = *rt.plan_;
  std::vector<int> order;
  for (int i : rt.layout_.stage_params) {
    if (!rt.layout_.state_shape[i].empty()) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return NumElements(rt.layout_.state_shape[a]) >
           NumElements(rt.layout_.state_shape[b]);
  });
  rt.rule_scratch_ = std::make_unique<SharedScratch>(&rt.compute());
  rt.block_gather_ = std::make_unique<SharedScratch>(&rt.compute());
  for (int i : order) {
    const ParamMeta& m = jp.params[i];
    // Blocks apply to whole matrices (element-wise fragments have none).
    const bool whole = rt.layout_.state_shape[i] == m.shape;
    absl::StatusOr<std::unique_ptr<UpdateRule>> rule =
        UpdateRule::CreateBlocked(
            setup.settings->configs.at(m.group), rt.layout_.state_shape[i],
            whole ? m.blocks : BlockSpec{}, m.name, &rt.compute(),
            rt.rule_scratch_.get(), rt.block_gather_.get());
    if (!rule.ok()) {
      return absl::Status(
          rule.status().code(),
          absl::StrCat("parameter '", m.name, "': ", rule.status().message()));
    }
    rt.state_bytes_ += (*rule)->state_bytes();
    ++rt.owned_params_;
    rt.rules_.emplace(i, *std::move(rule));
  }
  return absl::OkStatus();
}

// Same-shape Muon updates step together; a batch's old values (for the
// update RMS) need `before` to hold all its members.
absl::Status RankBuilder::BatchUpdates(const RankSetup& setup,
                                       RankRuntime& rt) {
  const OwnedBuffers* values = &rt.owned_;
  if (!rt.backends_.updates_in_place()) {
    // cuda compute, host staging: the DP-owned updates run on the GPU's
    // copy of their owned buffers (OwnedDeviceCopy).
    std::vector<int> params;
    for (const UpdateBatch& b : BatchDpOwnedUpdates(
             *rt.plan_, rt.layout_, rt.rules_, rt.owned_, {.enabled = false})) {
      params.insert(params.end(), b.params.begin(), b.params.end());
    }
    CANZONA_ASSIGN_OR_RETURN(
        rt.device_copy_,
        OwnedDeviceCopy::Create(*rt.plan_, rt.layout_, rt.owned_, params,
                                rt.compute()));
    values = &rt.device_copy_->view();
  }
  rt.dp_owned_batches_ =
      BatchDpOwnedUpdates(*rt.plan_, rt.layout_, rt.rules_, *values,
                          {.enabled = setup.batch_updates});
  int64_t largest = 0;
  for (const UpdateBatch& b : rt.dp_owned_batches_) {
    if (b.params.size() > 1) largest = std::max(largest, b.elements);
  }
  if (largest > rt.before_.size()) {
    CANZONA_ASSIGN_OR_RETURN(rt.before_, rt.compute().Allocate(largest));
  }
  return absl::OkStatus();
}

// The DP collectives (DP lane) with their scratch and calibration.
absl::Status RankBuilder::CreateBucketCollectives(
    const RankSetup& setup, RankRuntime& rt, Copiers& copiers, Groups& groups,
    std::unique_ptr<UnevenCalibration> cal) {
  const RankLayout& layout = rt.layout_;
  Backend& staging = rt.staging();
  BucketCollectives::Parts parts;
  if (!layout.sliced) {
    CANZONA_ASSIGN_OR_RETURN(parts.part, staging.Allocate(layout.max_slice));
  }
  if (cal->enabled()) {
    CANZONA_ASSIGN_OR_RETURN(
        parts.sums,
        staging.Allocate(2 * static_cast<int64_t>(layout.buckets.size())));
  }
  if (!layout.layerwise_counts.empty()) {
    CANZONA_ASSIGN_OR_RETURN(
        parts.packed,
        staging.Allocate(layout.layerwise_counts[layout.shard_pos]));
    CANZONA_ASSIGN_OR_RETURN(parts.gathered,
                             staging.Allocate(layout.layerwise_total));
  }
  parts.copier = std::move(copiers.dp);
  parts.dp = std::move(groups.dp.comm);
  parts.cross = std::move(groups.cross.comm);
  parts.calibration = std::move(cal);
  BucketCollectives::Staging view;
  view.plan = rt.plan_;
  view.layout = &rt.layout_;
  view.trainer = setup.trainer;
  view.on_device = rt.resident();
  view.owned = &rt.owned_;
  view.who = RankString(setup.coords);
  rt.buckets_ =
      std::make_unique<BucketCollectives>(std::move(view), std::move(parts));
  // The slot: only for buckets the trainer's memory cannot take in place.
  const int64_t slot = rt.buckets_->slot_bytes();
  CANZONA_ASSIGN_OR_RETURN(
      rt.owned_memory_.slot,
      staging.Allocate((slot + sizeof(float) - 1) / sizeof(float)));
  rt.owned_.slot = rt.owned_memory_.slot.data();
  return absl::OkStatus();
}

// The TP micro-group pipeline with one set of buffers per group.
absl::Status RankBuilder::CreateTpLane(const RankSetup& setup, RankRuntime& rt,
                                       Copiers& copiers, Groups& groups) {
  const RankLayout& layout = rt.layout_;
  Backend& staging = rt.staging();
  TpLane::Parts parts;
  for (const GroupLayout& g : layout.groups) {
    GroupBuffers b;
    CANZONA_ASSIGN_OR_RETURN(b.send, staging.Allocate(2 * g.local));
    CANZONA_ASSIGN_OR_RETURN(
        b.recv, staging.Allocate(2 * g.tp_owned_here * layout.tp_size));
    CANZONA_ASSIGN_OR_RETURN(
        b.back, staging.Allocate(g.tp_owned_here * layout.tp_size));
    CANZONA_ASSIGN_OR_RETURN(b.back_in, staging.Allocate(g.local));
    parts.buffers.push_back(std::move(b));
  }
  parts.copier = std::move(copiers.tp);
  parts.tp = std::move(groups.tp);
  TpLane::Staging view;
  view.plan = rt.plan_;
  view.layout = &rt.layout_;
  view.owned = &rt.owned_;
  view.backend = &rt.staging();
  if (!setup.nccl) {
    rt.tp_ = TpLane::CreateHost(std::move(view), std::move(parts));
    return absl::OkStatus();
  }
  TpLane::Streams streams;
  streams.api = rt.backends_.nccl_api();
  streams.device = rt.device();
  streams.compute = static_cast<NcclStream>(rt.compute().native_stream());
  streams.timeout = setup.step_timeout;
  CANZONA_ASSIGN_OR_RETURN(
      rt.tp_, TpLane::CreateDevice(std::move(view), std::move(parts), streams));
  return absl::OkStatus();
}

void RankBuilder::RegisterMetrics(const RankSetup& setup, RankRuntime& rt) {
  if (setup.metrics == nullptr) return;
  const CanzonaMetrics m = CanzonaMetrics::Register(setup.metrics);
  const std::string g = std::to_string(setup.global);
  rt.metrics_ = std::make_unique<RankMetrics>(m, setup.job_id, g);
  const RankLayout& layout = rt.layout_;
  const plan::Plan& plan = rt.plan_->plan;
  const size_t at =
      (static_cast<size_t>(setup.coords.pp_rank()) * layout.shard_size +
       layout.shard_pos) *
          layout.tp_size +
      layout.tp_rank;
  if (at < plan.per_gpu.size()) {
    m.rank_compute_flops->WithLabels({setup.job_id, g})
        ->Set(plan.per_gpu[at].flops);
  }
  m.optimizer_state_bytes->WithLabels({setup.job_id, g})
      ->Set(static_cast<double>(rt.state_bytes_));
  m.rank_memory_bytes->WithLabels({setup.job_id, g, "master"})
      ->Set(static_cast<double>(rt.master_bytes_));
  m.rank_memory_bytes->WithLabels({setup.job_id, g, "state"})
      ->Set(static_cast<double>(rt.state_bytes_));
  m.rank_memory_bytes->WithLabels({setup.job_id, g, "buffers"})
      ->Set(static_cast<double>(rt.buffer_bytes_));
  if (!rt.pci_bus_id().empty()) {
    m.rank_device_info
        ->WithLabels(
            {setup.job_id, g, std::to_string(rt.device()), rt.pci_bus_id()})
        ->Set(1);
  }
}

// Host staging that copies to and from a GPU is page-locked, so that those
// copies are DMA at the link's rate and enqueue without waits: on the Gloo
// plane, with cuda compute (OwnedDeviceCopy) or a trainer's CUDA IPC
// buffers (the bucket copies), the owned gradients, the master weights and
// the bucket slot. Only where the GPU is a real one (cuda compute) or tests
// pass a fake (EngineOptions::nccl_api): a cpu daemon never starts CUDA.
void RankBuilder::PinStaging(const RankSetup& setup, RankRuntime& rt) {
  const bool gpu = rt.compute().memory_space() == MemorySpace::kDevice ||
                   (setup.trainer != nullptr && setup.trainer->on_device());
  if (setup.nccl || !gpu) return;
  NcclApi* api = setup.nccl_api;
  if (api == nullptr) {
    if (rt.compute().kind() != BackendKind::kCuda) return;
    absl::StatusOr<NcclApi*> real = RealNcclApi();
    if (!real.ok()) {
      spdlog::warn("host staging stays pageable: {}",
                   std::string(real.status().message()));
      return;
    }
    api = *real;
  }
  std::vector<TrainerBuffers::MemoryRange> ranges;
  const OwnedMemory& owned = rt.owned_memory_;
  for (const DeviceBuffer* b : {&owned.grads, &owned.masters, &owned.slot}) {
    if (b->size() > 0) ranges.push_back({b->data(), Bytes(*b)});
  }
  rt.pinned_staging_ = PinnedHostMemory::Pin(api, rt.device(), ranges);
}

// The daemon's bytes for the rank by kind: what setup allocated, plus the
// DP communicator's scratch (Gloo: the reduce-scatter's received slices;
// NCCL: the padded collectives' reservation).
void RankBuilder::AccountMemory(const RankSetup& setup, RankRuntime& rt) {
  const RankLayout& layout = rt.layout_;
  const OwnedMemory& owned = rt.owned_memory_;
  rt.master_bytes_ = Bytes(owned.masters);
  int64_t buffers = 0;
  for (const DeviceBuffer* b : std::initializer_list<const DeviceBuffer*>{
           &owned.grads, &owned.slot, &owned.reduced, &rt.before_,
           &rt.redundant_send_, &rt.redundant_recv_, &rt.whole_grad_,
           &rt.whole_param_, &rt.scalars_, &rt.device_param_,
           &rt.device_grad_}) {
    buffers += Bytes(*b);
  }
  buffers += rt.buckets_->buffer_bytes();
  if (rt.device_copy_ != nullptr) buffers += rt.device_copy_->bytes();
  buffers += rt.rule_scratch_->bytes();
  buffers += rt.block_gather_->bytes();
  buffers += rt.compute().workspace_bytes();
  for (int g = 0; g < rt.tp_->groups(); ++g) {
    const GroupBuffers& b = rt.tp_->buffers(g);
    for (const DeviceBuffer* d : std::initializer_list<const DeviceBuffer*>{
             &b.send, &b.recv, &b.back, &b.back_in}) {
      buffers += Bytes(*d);
    }
  }
  const int S = layout.shard_size;
  if (S > 1 && setup.nccl) {
    buffers += layout.dp_scratch * static_cast<int64_t>(sizeof(float));
  } else if (S > 1) {
    int64_t scratch = 0;
    for (const BucketLayout& b : layout.buckets) {
      const std::vector<int64_t>& counts =
          layout.sliced ? b.counts : b.even_counts;
      scratch =
          std::max(scratch, GlooReduceScatterChunk(counts, b.reduce_dtype) * S *
                                DTypeBytes(b.reduce_dtype));
    }
    buffers += scratch;
  }
  rt.buffer_bytes_ = buffers;
}

// The trainer's view: the plan digest, what it owns, its buckets.
void RankBuilder::Describe(const RankRuntime& rt,
                           v1::RegisterResponse* response) {
  const plan::Plan& plan = rt.plan_->plan;
  for (const BucketLayout& b : rt.layout_.buckets) {
    v1::Bucket* out = response->add_buckets();
    for (int i : plan.buckets[b.index].params) {
      out->add_parameters(i - rt.layout_.first);
    }
    out->set_elements(b.elements);
  }
  response->set_plan_digest(plan.digest);
  response->set_owned_parameters(rt.owned_params_);
  response->set_state_bytes(rt.state_bytes_);
  response->set_master_bytes(rt.master_bytes_);
  response->set_buffer_bytes(rt.buffer_bytes_);
}

absl::StatusOr<std::unique_ptr<RankRuntime>> RankBuilder::Build(
    const RankSetup& setup, v1::RegisterResponse* response) {
  std::unique_ptr<RankRuntime> rt(new RankRuntime());
  rt->plan_ = setup.plan;
  CANZONA_RETURN_IF_ERROR(CreateBackends(setup, rt->backends_));
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
  return rt;
}

absl::StatusOr<std::unique_ptr<RankRuntime>> SetupRank(
    const RankSetup& setup, v1::RegisterResponse* response) {
  return RankBuilder::Build(setup, response);
}

}  // namespace canzona
