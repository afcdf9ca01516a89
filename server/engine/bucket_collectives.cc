#include "server/engine/bucket_collectives.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/base/status_macros.h"
#include "spdlog/spdlog.h"

namespace canzona {

BucketCollectives::~BucketCollectives() {
  // A failed step may leave reductions in flight (Reduce does not wait):
  // they end before the staging they write goes.
  (void)FinishAtTeardown();
}

absl::Status BucketCollectives::FinishAtTeardown() {
  if (!finished_at_teardown_.has_value()) {
    finished_at_teardown_ = parts_.copier->Finish();
    if (!finished_at_teardown_->ok()) {
      spdlog::warn("rank {}: DP copies in flight at teardown: {}",
                   staging_.who, finished_at_teardown_->ToString());
    }
  }
  return *finished_at_teardown_;
}

BucketCollectives::BucketCollectives(Staging staging, Parts parts)
    : staging_(std::move(staging)),
      parts_(std::move(parts)),
      master_set_(staging_.layout->buckets.size(), false) {
  const JobPlan& jp = *staging_.plan;
  const RankLayout& layout = *staging_.layout;
  const TrainerBuffers& trainer = *staging_.trainer;
  const int S = parts_.dp->size();
  const bool in_place = trainer.Addressable(staging_.on_device);
  const bool through_host = trainer.ThroughHost(staging_.on_device);
  int64_t scratch = 0;
  if (through_host) {
    // A parameter copied alone and converted (no run, or a first step's
    // bf16 / fp16 master weights) goes through the scratch.
    for (int i : layout.stage_params) {
      const DType dtype = trainer.dtype(j(i));
      if (dtype == DType::kFloat32) continue;
      scratch = std::max(scratch, jp.params[i].fragment_numel *
                                      static_cast<int64_t>(DTypeBytes(dtype)));
    }
  }
  for (const BucketLayout& b : layout.buckets) {
    std::vector<int> js;
    for (int i : jp.plan.buckets[b.index].params) js.push_back(j(i));
    const void* grads = in_place ? trainer.Run(js, /*grads=*/true) : nullptr;
    if (b.reduce_dtype != b.dtype) grads = nullptr;
    void* params =
        in_place ? const_cast<void*>(trainer.Run(js, false)) : nullptr;
    grad_run_.push_back(grads);
    param_run_.push_back(params);
    // One DP rank copies between the trainer and its owned buffers even
    // in place (no collective reads the trainer's memory): one copy per
    // bucket each way where the trainer lays it out in order.
    if (!in_place || S == 1) trainer_runs_.push_back(TrainerRunsOf(b, js));
    if (through_host) {
      const TrainerRuns& runs = trainer_runs_.back();
      if (S > 1 && runs.grads != nullptr && b.reduce_dtype != b.dtype) {
        scratch = std::max(scratch, b.elements * DTypeBytes(b.dtype));
      }
      if (!runs.held.empty()) {
        const DType dtype = trainer.dtype(j(runs.held.front()));
        const int64_t held_bytes = runs.held_elements * DTypeBytes(dtype);
        if (runs.held_grads != nullptr && dtype != DType::kFloat32) {
          scratch = std::max(scratch, held_bytes);
        }
        if (runs.held_params != nullptr &&
            !(runs.masters_in_order && dtype == DType::kFloat32)) {
          scratch = std::max(scratch, held_bytes);
        }
      }
    }
    if (S == 1) continue;  // no collective, so no slot
    int64_t need = 0;
    if (!layout.sliced || grads == nullptr) {
      need = b.elements * DTypeBytes(b.reduce_dtype);
    }
    if (layout.sliced && params == nullptr) {
      need = std::max(need, b.elements * DTypeBytes(b.dtype));
    }
    slot_bytes_ = std::max(slot_bytes_, need);
  }
  scratch_bytes_ = scratch;
}

BucketCollectives::TrainerRuns BucketCollectives::TrainerRunsOf(
    const BucketLayout& b, absl::Span<const int> js) const {
  const JobPlan& jp = *staging_.plan;
  const TrainerBuffers& trainer = *staging_.trainer;
  const OwnedBuffers& owned = *staging_.owned;
  TrainerRuns runs;
  const bool one_rank = parts_.dp->size() == 1;
  if (!one_rank) {
    runs.grads = trainer.Run(js, /*grads=*/true);
    runs.params = const_cast<void*>(trainer.Run(js, /*grads=*/false));
  }
  std::vector<int> held_js;
  bool grads_in_order = true, masters_in_order = true, all_masters = true;
  const float* next_grad = nullptr;
  const float* next_master = nullptr;
  for (int i : jp.plan.buckets[b.index].params) {
    if (owned.grad_at[i] == nullptr) continue;
    if (!runs.held.empty()) {
      grads_in_order = grads_in_order && owned.grad_at[i] == next_grad;
      masters_in_order = masters_in_order && owned.param_at[i] == next_master;
    }
    all_masters = all_masters && owned.master[i];
    const int64_t n = jp.params[i].fragment_numel;
    next_grad = owned.grad_at[i] + n;
    next_master = owned.param_at[i] + n;
    runs.held.push_back(i);
    held_js.push_back(j(i));
    runs.held_elements += n;
  }
  // One DP rank reads the held gradients (the whole bucket) itself; more
  // reduce the slot's.
  if (one_rank && grads_in_order) {
    runs.held_grads = trainer.Run(held_js, /*grads=*/true);
  }
  // Device staging has no scratch to reorder masters through.
  if (all_masters && (masters_in_order || !staging_.on_device)) {
    runs.held_params = const_cast<void*>(trainer.Run(held_js, false));
    runs.masters_in_order = masters_in_order;
  }
  return runs;
}

absl::StatusOr<char*> BucketCollectives::Scratch(int64_t bytes) {
  const absl::Span<char> scratch = this->scratch();
  if (bytes > static_cast<int64_t>(scratch.size())) {
    return absl::InternalError(
        absl::StrCat(staging_.who, ": a copy through the host needs ", bytes,
                     " bytes of scratch, setup sized it to ", scratch.size()));
  }
  return scratch.data();
}

int64_t BucketCollectives::buffer_bytes() const {
  int64_t floats = 0;
  for (const DeviceBuffer* b :
       {&parts_.part, &parts_.packed, &parts_.gathered, &parts_.sums}) {
    floats += b->size();
  }
  return floats * static_cast<int64_t>(sizeof(float));
}

void BucketCollectives::MastersSet(bool set) {
  absl::MutexLock lock(&master_mu_);
  master_set_.assign(master_set_.size(), set);
}

absl::Status BucketCollectives::ReadMasters(int b) {
  const JobPlan& jp = *staging_.plan;
  const TrainerBuffers& trainer = *staging_.trainer;
  const OwnedBuffers& owned = *staging_.owned;
  // fp32 copies are the trainer's values, read every step; bf16 / fp16
  // master weights only until the first step (or a checkpoint) set them.
  bool set = false;
  {
    absl::MutexLock lock(&master_mu_);
    set = master_set_[b];
    master_set_[b] = true;
  }
  StagingCopier& copier = *parts_.copier;
  const TrainerRuns* runs = trainer_runs(b);
  if (runs == nullptr || runs->held_params == nullptr) {
    for (int i : jp.plan.buckets[staging_.layout->buckets[b].index].params) {
      if (!owned.master[i]) continue;
      if (set && trainer.dtype(j(i)) != DType::kFloat32) continue;
      CANZONA_RETURN_IF_ERROR(ReadOne(i, /*grad=*/false));
    }
    return absl::OkStatus();
  }
  // The held parameters in one copy (one dtype: a run).
  const int first = runs->held.front();
  const DType dtype = trainer.dtype(j(first));
  if (set && dtype != DType::kFloat32) return absl::OkStatus();
  if (runs->masters_in_order) {
    return trainer.Read(runs->held_params, j(first), runs->held_elements,
                        DType::kFloat32, owned.param_at[first], copier,
                        staging_.on_device, scratch());
  }
  // The masters lie in another order: into the scratch, then each one.
  const int64_t unit = DTypeBytes(dtype);
  CANZONA_ASSIGN_OR_RETURN(char* host, Scratch(runs->held_elements * unit));
  CANZONA_RETURN_IF_ERROR(trainer.Read(runs->held_params, j(first),
                                       runs->held_elements, dtype, host, copier,
                                       staging_.on_device, {}));
  int64_t at = 0;
  for (int i : runs->held) {
    const int64_t n = jp.params[i].fragment_numel;
    CANZONA_RETURN_IF_ERROR(copier.Convert(
        dtype, host + at * unit, DType::kFloat32, owned.param_at[i], n));
    at += n;
  }
  return absl::OkStatus();
}

absl::Status BucketCollectives::ReadMasterUnlessSet(int i) {
  const JobPlan& jp = *staging_.plan;
  const std::vector<BucketLayout>& buckets = staging_.layout->buckets;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const std::vector<int>& params = jp.plan.buckets[buckets[b].index].params;
    if (std::find(params.begin(), params.end(), i) == params.end()) continue;
    {
      absl::MutexLock lock(&master_mu_);
      if (master_set_[b]) return absl::OkStatus();
    }
    CANZONA_RETURN_IF_ERROR(ReadOne(i, /*grad=*/false));
    return parts_.copier->Finish();
  }
  return absl::OkStatus();
}

absl::Status BucketCollectives::ReloadMasters(absl::Span<const int> params) {
  const TrainerBuffers& trainer = *staging_.trainer;
  const OwnedBuffers& owned = *staging_.owned;
  bool read = false;
  for (int trainer_index : params) {
    const int i = trainer_index + staging_.layout->first;
    if (!owned.master[i] || trainer.dtype(trainer_index) == DType::kFloat32) {
      continue;
    }
    CANZONA_RETURN_IF_ERROR(trainer.ReloadMasters(
        trainer.param(trainer_index), trainer_index,
        staging_.plan->params[i].fragment_numel, owned.param_at[i],
        *parts_.copier, staging_.on_device, scratch()));
    read = true;
  }
  return read ? parts_.copier->Finish() : absl::OkStatus();
}

absl::Status BucketCollectives::ReadOne(int i, bool grad) {
  const TrainerBuffers& trainer = *staging_.trainer;
  const OwnedBuffers& owned = *staging_.owned;
  return trainer.Read(grad ? trainer.grad(j(i)) : trainer.param(j(i)), j(i),
                      staging_.plan->params[i].fragment_numel, DType::kFloat32,
                      grad ? owned.grad_at[i] : owned.param_at[i],
                      *parts_.copier, staging_.on_device, scratch());
}

absl::Status BucketCollectives::ReadHeldGrads(int b) {
  const OwnedBuffers& owned = *staging_.owned;
  const TrainerRuns* runs = trainer_runs(b);
  if (runs != nullptr && runs->held_grads != nullptr) {
    const int first = runs->held.front();
    return staging_.trainer->Read(
        runs->held_grads, j(first), runs->held_elements, DType::kFloat32,
        owned.grad_at[first], *parts_.copier, staging_.on_device, scratch());
  }
  const BucketLayout& bucket = staging_.layout->buckets[b];
  for (int i : staging_.plan->plan.buckets[bucket.index].params) {
    if (owned.grad_at[i] != nullptr) CANZONA_RETURN_IF_ERROR(ReadOne(i, /*grad=*/true));
  }
  return absl::OkStatus();
}

absl::StatusOr<const void*> BucketCollectives::GradSource(int b) {
  if (grad_run_[b] != nullptr) return grad_run_[b];
  const JobPlan& jp = *staging_.plan;
  const TrainerBuffers& trainer = *staging_.trainer;
  const BucketLayout& bucket = staging_.layout->buckets[b];
  char* slot = static_cast<char*>(staging_.owned->slot);
  const std::vector<int>& params = jp.plan.buckets[bucket.index].params;
  const TrainerRuns* runs = trainer_runs(b);
  if (runs != nullptr && runs->grads != nullptr) {
    // The bucket's gradients lie in the slot's order: one copy.
    CANZONA_RETURN_IF_ERROR(trainer.Read(
        runs->grads, j(params.front()), bucket.elements, bucket.reduce_dtype,
        slot, *parts_.copier, staging_.on_device, scratch()));
    return slot;
  }
  const int64_t unit = DTypeBytes(bucket.reduce_dtype);
  for (int i : params) {
    CANZONA_RETURN_IF_ERROR(
        trainer.Read(trainer.grad(j(i)), j(i), jp.params[i].fragment_numel,
                     bucket.reduce_dtype, slot + pos(i, bucket) * unit,
                     *parts_.copier, staging_.on_device, scratch()));
  }
  return slot;
}

void BucketCollectives::CaptureGradients(int64_t step,
                                         absl::Span<const int> buckets) {
  if (parts_.snapshots == nullptr) return;
  const absl::Status captured = parts_.snapshots->Capture(step, buckets);
  if (!captured.ok()) {
    spdlog::warn("{}: step {}: no snapshot of the gradients event ({}); "
                 "those buckets wait for its last record",
                 staging_.who, step, captured.ToString());
  }
}

absl::Status BucketCollectives::WaitForTrainer(NcclEvent snapshot) {
  // On the NCCL plane the copier's stream waits on the device, unless NCCL
  // work follows on it (DP or cross-group collectives): ncclCommAbort
  // synchronizes with everything enqueued before its kernels, so a trainer
  // whose GPU never reaches its record (killed, or hung in its own
  // collective) would hold the step timeout's abort, and every Abort
  // behind its lock, for as long. There the host polls, bounded by the
  // step timeout; the lane waits for each of those collectives anyway.
  const bool on_device =
      staging_.on_device && parts_.dp->size() == 1 && parts_.cross->size() == 1;
  if (snapshot == nullptr) {
    return staging_.trainer->WaitGradients(*parts_.copier, on_device);
  }
  if (on_device) return parts_.copier->WaitEvent(snapshot);
  if (staging_.on_device) {
    return parts_.copier->AwaitEvent(
        snapshot, "the trainer's gradients-written event (as of GradReady)");
  }
  // The Gloo plane's copier is the host's: the snapshot is polled here, as
  // WaitGradients polls the trainer's event, with the same deadline.
  return parts_.snapshots->Await(
      snapshot, absl::Now() + staging_.trainer->event_timeout());
}

absl::Status BucketCollectives::Reduce(int b, int64_t step) {
  // A GPU trainer's gradients are final once its event completed (it
  // records the event after backward wrote them, before GradReady/Step):
  // the record GradReady saw (GradientSnapshots), else the latest.
  CANZONA_RETURN_IF_ERROR(WaitForTrainer(
      parts_.snapshots != nullptr ? parts_.snapshots->For(step, b) : nullptr));
  CANZONA_RETURN_IF_ERROR(ReadMasters(b));
  // No wait: the step's work follows the reductions on the device
  // (RankRuntime::AfterReductions).
  if (staging_.layout->sliced) return ReduceSliced(b);
  return ReduceUnsliced(b);
}

absl::Status BucketCollectives::ReduceSliced(int b) {
  const RankLayout& layout = *staging_.layout;
  const BucketLayout& bucket = layout.buckets[b];
  const OwnedBuffers& owned = *staging_.owned;
  Communicator& dp = *parts_.dp;
  const int64_t mine = bucket.counts[layout.shard_pos];
  float* sums = owned.grads + bucket.owned_base;
  if (dp.size() == 1) {
    // One rank's slice is the whole bucket: every gradient held.
    CANZONA_RETURN_IF_ERROR(ReadHeldGrads(b));
  } else {
    CANZONA_ASSIGN_OR_RETURN(const void* src, GradSource(b));
    const DType type = bucket.reduce_dtype;
    void* out = type == DType::kFloat32 ? sums : owned.reduced;
    CANZONA_RETURN_IF_ERROR(parts_.calibration->Run(b, [&] {
      return dp.ReduceScatterVTyped(type, src, bucket.counts, out);
    }));
    if (out != sums) {
      CANZONA_RETURN_IF_ERROR(
          parts_.copier->Convert(type, out, DType::kFloat32, sums, mine));
    }
  }
  if (parts_.cross->size() > 1 && mine > 0) {
    CANZONA_RETURN_IF_ERROR(parts_.cross->AllReduce(sums, mine));
  }
  return absl::OkStatus();
}

absl::Status BucketCollectives::ReduceUnsliced(int b) {
  const JobPlan& jp = *staging_.plan;
  const RankLayout& layout = *staging_.layout;
  const BucketLayout& bucket = layout.buckets[b];
  const OwnedBuffers& owned = *staging_.owned;
  StagingCopier& copier = *parts_.copier;
  Communicator& dp = *parts_.dp;
  const std::vector<int>& params = jp.plan.buckets[bucket.index].params;
  if (dp.size() == 1) return ReadHeldGrads(b);
  // Every rank needs the sums of its parameters, which may be anywhere in
  // the bucket: the whole bucket is all-reduced into the slot.
  const DType type = bucket.reduce_dtype;
  const int64_t unit = DTypeBytes(type);
  CANZONA_ASSIGN_OR_RETURN(const void* src, GradSource(b));
  char* slot = static_cast<char*>(owned.slot);
  const std::vector<int64_t>& counts = bucket.even_counts;
  char* part = reinterpret_cast<char*>(parts_.part.data());
  CANZONA_RETURN_IF_ERROR(dp.ReduceScatterVTyped(type, src, counts, part));
  char* my_part = slot + bucket.even_start * unit;
  CANZONA_RETURN_IF_ERROR(
      copier.Copy(my_part, part, counts[layout.shard_pos] * unit));
  CANZONA_RETURN_IF_ERROR(dp.AllGatherVTyped(type, my_part, counts, slot));
  for (int i : params) {
    if (owned.grad_at[i] == nullptr) continue;
    CANZONA_RETURN_IF_ERROR(copier.Convert(type, slot + pos(i, bucket) * unit,
                                           DType::kFloat32, owned.grad_at[i],
                                           jp.params[i].fragment_numel));
  }
  return absl::OkStatus();
}

absl::Status BucketCollectives::WriteBack(int i) {
  const OwnedBuffers& owned = *staging_.owned;
  if (!owned.master[i]) return absl::OkStatus();  // updated in place
  const TrainerBuffers& trainer = *staging_.trainer;
  return trainer.Write(DType::kFloat32, owned.param_at[i], j(i),
                       staging_.plan->params[i].fragment_numel,
                       trainer.param(j(i)), *parts_.copier, staging_.on_device,
                       scratch());
}

absl::Status BucketCollectives::WriteHeld(int b) {
  const JobPlan& jp = *staging_.plan;
  const OwnedBuffers& owned = *staging_.owned;
  const TrainerBuffers& trainer = *staging_.trainer;
  StagingCopier& copier = *parts_.copier;
  const TrainerRuns* runs = trainer_runs(b);
  if (runs == nullptr || runs->held_params == nullptr) {
    const BucketLayout& bucket = staging_.layout->buckets[b];
    for (int i : jp.plan.buckets[bucket.index].params) {
      CANZONA_RETURN_IF_ERROR(WriteBack(i));
    }
    return absl::OkStatus();
  }
  // The held parameters in one copy (one dtype: a run).
  const int first = runs->held.front();
  if (runs->masters_in_order) {
    return trainer.Write(DType::kFloat32, owned.param_at[first], j(first),
                         runs->held_elements, runs->held_params, copier,
                         staging_.on_device, scratch());
  }
  // The masters lie in another order: each one into the scratch (rounded),
  // then the run.
  const DType dtype = trainer.dtype(j(first));
  const int64_t unit = DTypeBytes(dtype);
  CANZONA_ASSIGN_OR_RETURN(char* host, Scratch(runs->held_elements * unit));
  int64_t at = 0;
  for (int i : runs->held) {
    const int64_t n = jp.params[i].fragment_numel;
    CANZONA_RETURN_IF_ERROR(copier.Convert(DType::kFloat32, owned.param_at[i],
                                           dtype, host + at * unit, n));
    at += n;
  }
  return trainer.Write(dtype, host, j(first), runs->held_elements,
                       runs->held_params, copier, staging_.on_device, {});
}

absl::Status BucketCollectives::Gather(int b) {
  const JobPlan& jp = *staging_.plan;
  const RankLayout& layout = *staging_.layout;
  if (layout.sliced && parts_.dp->size() > 1) {
    CANZONA_RETURN_IF_ERROR(GatherSliced(b));
  } else if (jp.plan.strategy == plan::Strategy::kLayerwise &&
             parts_.dp->size() > 1) {
    if (b == layout.gather_order.front()) {
      CANZONA_RETURN_IF_ERROR(GatherLayerwise());
    }
  } else {
    // Every parameter of the bucket is held here (sc, or one DP rank).
    CANZONA_RETURN_IF_ERROR(WriteHeld(b));
  }
  StagingCopier& copier = *parts_.copier;
  // The bucket's answer: the trainer's stream waits for its "parameters
  // written" event on the device, or the host waits here.
  if (parts_.params_written != nullptr) {
    CANZONA_RETURN_IF_ERROR(
        copier.RecordEvent(parts_.params_written->event(b)));
  } else {
    CANZONA_RETURN_IF_ERROR(copier.Finish());
  }
  if (b != layout.gather_order.back()) return absl::OkStatus();
  return parts_.calibration->EndRound(
      [&](absl::Span<float> sums) {
        return SumThroughStaging(copier, *parts_.dp, parts_.sums.data(),
                                 *parts_.host_sums, sums);
      },
      staging_.who);
}

absl::Status BucketCollectives::GatherSliced(int b) {
  const JobPlan& jp = *staging_.plan;
  const RankLayout& layout = *staging_.layout;
  const BucketLayout& bucket = layout.buckets[b];
  const OwnedBuffers& owned = *staging_.owned;
  const TrainerBuffers& trainer = *staging_.trainer;
  StagingCopier& copier = *parts_.copier;
  const DType type = bucket.dtype;
  const int64_t unit = DTypeBytes(type);
  // In place in the trainer's buffer, or through the slot.
  char* run = static_cast<char*>(param_run_[b]);
  char* dst = run != nullptr ? run : static_cast<char*>(owned.slot);
  const std::vector<int>& params = jp.plan.buckets[bucket.index].params;
  for (int i : params) {
    if (owned.param_at[i] == nullptr) continue;
    // fp32 values updated in place in the trainer's run are there already.
    if (run != nullptr && !owned.master[i]) continue;
    CANZONA_RETURN_IF_ERROR(copier.Convert(DType::kFloat32, owned.param_at[i],
                                           type, dst + pos(i, bucket) * unit,
                                           jp.params[i].fragment_numel));
  }
  char* mine = dst + bucket.my_start * unit;
  CANZONA_RETURN_IF_ERROR(parts_.calibration->Run(b, [&] {
    return parts_.dp->AllGatherVTyped(type, mine, bucket.counts, dst);
  }));
  if (run != nullptr) return absl::OkStatus();
  const TrainerRuns* runs = trainer_runs(b);
  if (runs != nullptr && runs->params != nullptr) {
    // The whole gathered bucket in one copy (every held
    // parameter has a master copy there: none was updated in the trainer).
    return trainer.Write(type, dst, j(params.front()), bucket.elements,
                         runs->params, copier, staging_.on_device, scratch());
  }
  for (int i : params) {
    // fp32 values updated in place in the trainer need no copy back.
    if (owned.param_at[i] != nullptr && !owned.master[i]) continue;
    CANZONA_RETURN_IF_ERROR(trainer.Write(
        type, dst + pos(i, bucket) * unit, j(i), jp.params[i].fragment_numel,
        trainer.param(j(i)), copier, staging_.on_device, scratch()));
  }
  return absl::OkStatus();
}

absl::Status BucketCollectives::GatherLayerwise() {
  const JobPlan& jp = *staging_.plan;
  const RankLayout& layout = *staging_.layout;
  const OwnedBuffers& owned = *staging_.owned;
  const TrainerBuffers& trainer = *staging_.trainer;
  StagingCopier& copier = *parts_.copier;
  const int DP = parts_.dp->size(), d = layout.shard_pos;
  const std::vector<int64_t>& counts = layout.layerwise_counts;
  float* packed = parts_.packed.data();
  int64_t at_packed = 0;
  for (int i : layout.stage_params) {
    if (jp.plan.dp_owner[i] != d) continue;
    const int64_t n = jp.params[i].fragment_numel;
    CANZONA_RETURN_IF_ERROR(
        copier.Copy(packed + at_packed, owned.param_at[i], n * sizeof(float)));
    at_packed += n;
  }
  std::vector<int64_t> at(DP, 0);
  for (int r = 1; r < DP; ++r) at[r] = at[r - 1] + counts[r - 1];
  float* gathered = parts_.gathered.data();
  CANZONA_RETURN_IF_ERROR(parts_.dp->AllGatherV(packed, counts, gathered));
  for (int i : layout.stage_params) {
    const int owner = jp.plan.dp_owner[i];
    const int64_t n = jp.params[i].fragment_numel;
    const float* value = gathered + at[owner];
    at[owner] += n;
    if (owner == d) {
      CANZONA_RETURN_IF_ERROR(WriteBack(i));
      continue;
    }
    CANZONA_RETURN_IF_ERROR(trainer.Write(DType::kFloat32, value, j(i), n,
                                          trainer.param(j(i)), copier,
                                          staging_.on_device, scratch()));
  }
  return absl::OkStatus();
}

}  // namespace canzona
