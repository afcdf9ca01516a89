// RankBuilder's steps for what the rank holds (rank_builder.h): the owned
// buffers, the rules and their batches, the lanes, the page-locked staging.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "proto/names/rank_names.h"
#include "server/engine/rank_builder.h"
#include "spdlog/spdlog.h"

namespace canzona {

using rank_setup_internal::Bytes;

// ZeRO-1: the owned gradients and master copies of what the rank holds
// (owned_buffers.h), and the whole-matrix work buffers.
absl::Status RankBuilder::AllocateOwned(const RankSetup& setup,
                                        RankRuntime& rt) {
  const RankLayout& layout = rt.layout_;
  Backend& staging = rt.staging();
  CANZONA_RETURN_IF_ERROR(
      canzona::AllocateOwned(*rt.plan_, layout, *setup.trainer, rt.resident(),
                             staging, &rt.owned_memory_, &rt.owned_));
  for (int i : layout.stage_params) {
    if (rt.owned_.grad_at[i] != nullptr) rt.held_grads_.push_back(i);
  }
  CANZONA_ASSIGN_OR_RETURN(rt.scalars_,
                           staging.Allocate(RankRuntime::kWorldValues));
  CANZONA_ASSIGN_OR_RETURN(
      rt.host_scalars_,
      PinnedHostFloats::Create(rt.backends_.nccl_api(), rt.device(),
                               RankRuntime::kWorldValues));
  CANZONA_ASSIGN_OR_RETURN(rt.redundant_send_,
                           staging.Allocate(2 * layout.max_redundant));
  CANZONA_ASSIGN_OR_RETURN(
      rt.redundant_recv_,
      staging.Allocate(2 * layout.max_redundant * layout.tp_size));
  // The whole matrices the TP owner and the redundant updates assemble: the
  // largest, or beside a GPU a micro group's (RankRuntime::UpdateWhole: one
  // copy each way and one wait per group; in place, the buffers stay one
  // matrix large and a group's matrices go as many at a time as fit).
  const bool in_place = rt.backends_.updates_in_place();
  const int64_t whole =
      in_place ? layout.max_whole
               : std::max(layout.max_whole, layout.max_group_whole);
  CANZONA_ASSIGN_OR_RETURN(rt.whole_grad_, staging.Allocate(whole));
  CANZONA_ASSIGN_OR_RETURN(rt.whole_param_, staging.Allocate(whole));
  if (!in_place) {
    // Their device copies (the DP-owned updates run on OwnedDeviceCopy):
    // sized for those matrices, not for every state (an embedding: 1.24 GB
    // at Qwen3-0.6B).
    CANZONA_ASSIGN_OR_RETURN(rt.device_param_, rt.compute().Allocate(whole));
    CANZONA_ASSIGN_OR_RETURN(rt.device_grad_, rt.compute().Allocate(whole));
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
  for (const UpdateBatch& b : rt.dp_owned_batches_) {
    if (b.rules[0]->config().kind != OptimizerKind::kMuon) continue;
    CANZONA_RETURN_IF_ERROR(ReserveMuonBatch(b.rules));
  }
  // The old values of the batches that count their updates from a copy,
  // where the updates run (in staging, or OwnedDeviceCopy's).
  int64_t largest = 0;
  for (const UpdateBatch& b : rt.dp_owned_batches_) {
    if (b.counting == UpdateBatch::Counting::kFromCopy) {
      largest = std::max(largest, b.elements);
    }
  }
  CANZONA_ASSIGN_OR_RETURN(rt.before_, rt.compute().Allocate(largest));
  return absl::OkStatus();
}

// The CUDA calls that snapshot a GPU trainer's gradients event at each
// GradReady (GradientSnapshots): the NCCL plane's, or on the Gloo plane the
// CUDA runtime's, where the event was opened through it (a test's fake
// event means nothing to real CUDA). Null: no snapshots, each reduction
// waits for the event's latest record.
NcclApi* RankBuilder::SnapshotApi(const RankSetup& setup,
                                  const RankRuntime& rt) {
  if (setup.trainer == nullptr || setup.trainer->grad_event() == nullptr) {
    return nullptr;
  }
  if (rt.resident()) return rt.backends_.nccl_api();
  if (setup.nccl_api != nullptr) return setup.nccl_api;
  if (!setup.trainer->opened_by_cuda()) return nullptr;
  absl::StatusOr<NcclApi*> real = RealNcclApi();
  if (!real.ok()) {
    spdlog::warn("rank {}: no gradients-event snapshots: {}",
                 RankString(setup.coords), real.status().ToString());
    return nullptr;
  }
  return *real;
}

// The DP collectives (DP lane) with their scratch and calibration.
absl::Status RankBuilder::CreateBucketCollectives(
    const RankSetup& setup, RankRuntime& rt, Copiers& copiers, Groups& groups,
    std::unique_ptr<UnevenCalibration> cal) {
  const RankLayout& layout = rt.layout_;
  Backend& staging = rt.staging();
  BucketCollectives::Parts parts;
  if (!layout.sliced && layout.shard_size > 1) {
    CANZONA_ASSIGN_OR_RETURN(parts.part, staging.Allocate(layout.max_slice));
  }
  if (cal->enabled()) {
    const int64_t sums = 2 * static_cast<int64_t>(layout.buckets.size());
    CANZONA_ASSIGN_OR_RETURN(parts.sums, staging.Allocate(sums));
    CANZONA_ASSIGN_OR_RETURN(
        parts.host_sums,
        PinnedHostFloats::Create(rt.backends_.nccl_api(), rt.device(), sums));
  }
  if (!layout.layerwise_counts.empty()) {
    CANZONA_ASSIGN_OR_RETURN(
        parts.packed,
        staging.Allocate(layout.layerwise_counts[layout.shard_pos]));
    CANZONA_ASSIGN_OR_RETURN(parts.gathered,
                             staging.Allocate(layout.layerwise_total));
  }
  if (rt.resident() && setup.trainer != nullptr &&
      setup.trainer->waits_for_params_events()) {
    absl::StatusOr<std::unique_ptr<ExportedEvents>> written =
        ExportedEvents::Create(rt.backends_.nccl_api(), rt.device(),
                               static_cast<int>(layout.buckets.size()));
    if (written.ok()) {
      parts.params_written = *std::move(written);
    } else {
      // Not granted: the answers wait for the writes, as without them.
      spdlog::warn("rank {}: no parameters-written events: {}",
                   RankString(setup.coords), written.status().ToString());
    }
  }
  NcclApi* snapshot_api = SnapshotApi(setup, rt);
  if (snapshot_api != nullptr) {
    absl::StatusOr<std::unique_ptr<GradientSnapshots>> snapshots =
        GradientSnapshots::Create(
            snapshot_api, rt.device(),
            static_cast<NcclEvent>(setup.trainer->grad_event()),
            static_cast<int>(layout.buckets.size()));
    if (snapshots.ok()) {
      parts.snapshots = *std::move(snapshots);
    } else {
      // The reductions then wait for the event's latest record.
      spdlog::warn("rank {}: no gradients-event snapshots: {}",
                   RankString(setup.coords), snapshots.status().ToString());
    }
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
  // The slot: only for buckets the trainer's memory cannot take in place;
  // the scratch in staging, so that PinStaging page-locks it with the rest.
  return AllocateBucketStaging(rt.buckets_->slot_bytes(),
                               rt.buckets_->scratch_bytes(), staging,
                               &rt.owned_memory_, &rt.owned_);
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

// Host staging that copies to and from a GPU is page-locked, so that those
// copies are DMA at the link's rate and enqueue without waits: on the Gloo
// plane, with cuda compute (OwnedDeviceCopy) or a trainer's CUDA IPC
// buffers (the bucket copies), the owned gradients, the master weights,
// the bucket slot and the conversions' scratch, and with cuda compute an
// fp32 shm trainer's values.
// Only where the GPU is a real one: a cpu daemon without GPU trainers never
// starts CUDA, and the device-like cpu backend of tests pins nothing.
void RankBuilder::PinStaging(const RankSetup& setup, RankRuntime& rt) {
  const bool ipc = setup.trainer != nullptr && setup.trainer->on_device();
  const bool gpu = rt.compute().memory_space() == MemorySpace::kDevice || ipc;
  if (setup.nccl || !gpu) return;
  NcclApi* api = setup.nccl_api;
  if (api == nullptr) {
    // A GPU to page-lock for: cuda compute, or a GPU trainer's buffers
    // beside cpu compute (not the cpu backend standing in for a GPU).
    if (setup.device_like_cpu ||
        (rt.compute().kind() != BackendKind::kCuda && !ipc)) {
      return;
    }
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
  std::vector<const DeviceBuffer*> buffers = {&owned.grads, &owned.masters,
                                              &owned.slot, &owned.scratch};
  if (!rt.backends_.updates_in_place()) {
    // The TP owner's and the redundant updates' whole matrices go to the
    // GPU and back each step (RankRuntime::Update).
    buffers.push_back(&rt.whole_grad_);
    buffers.push_back(&rt.whole_param_);
  }
  // A GPU trainer's fp32 parameters come from the layerwise gather's
  // buffer (bf16 ones through the pinned scratch).
  if (ipc) buffers.push_back(&rt.buckets().gathered());
  for (const DeviceBuffer* b : buffers) {
    if (b->size() > 0) ranges.push_back({b->data(), Bytes(*b)});
  }
  // Values updated in place in the trainer's shared memory (its fp32
  // parameters: a bf16 model's fp32 norms too) go to the GPU and back each
  // step (OwnedDeviceCopy).
  bool in_place = false;
  for (size_t i = 0; i < rt.owned_.param_at.size(); ++i) {
    in_place |= rt.owned_.param_at[i] != nullptr && !rt.owned_.master[i];
  }
  if (!rt.backends_.updates_in_place() && setup.trainer != nullptr &&
      !setup.trainer->on_device() && in_place) {
    // The mappings whole, as the NCCL plane pins them.
    for (const TrainerBuffers::MemoryRange& m :
         setup.trainer->SharedMemoryMappings()) {
      ranges.push_back(m);
    }
  }
  rt.pinned_staging_ = PinnedHostMemory::Pin(api, rt.device(), ranges);
}

}  // namespace canzona
