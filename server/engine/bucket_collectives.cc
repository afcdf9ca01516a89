#include "server/engine/bucket_collectives.h"

#include <utility>
#include <vector>

#include "kernels/base/status_macros.h"

namespace canzona {

BucketCollectives::BucketCollectives(Staging staging, Parts parts)
    : staging_(std::move(staging)),
      parts_(std::move(parts)),
      master_set_(staging_.layout->buckets.size(), false) {}

void BucketCollectives::MastersSet(bool set) {
  absl::MutexLock lock(&master_mu_);
  master_set_.assign(master_set_.size(), set);
}

absl::Status BucketCollectives::Reduce(int b) {
  const JobPlan& jp = *staging_.plan;
  const RankLayout& layout = *staging_.layout;
  const TrainerBuffers& trainer = *staging_.trainer;
  StageCopier& copier = *parts_.copier;
  const BucketLayout& bucket = layout.buckets[b];
  // A GPU trainer's gradients are final once its event completed (it
  // records the event after backward wrote them, before GradReady/Step).
  CANZONA_RETURN_IF_ERROR(trainer.WaitGradients(copier, staging_.on_device));
  // fp32 parameters are the trainer's, read every step; the staged fp32
  // values of bf16 / fp16 parameters are the master weights, read from the
  // trainer only until the first step (or a checkpoint) set them.
  bool read_masters = false;
  {
    absl::MutexLock lock(&master_mu_);
    read_masters = !master_set_[b];
    master_set_[b] = true;
  }
  for (int i : jp.plan.buckets[bucket.index].params) {
    const int j = i - layout.first;
    const int64_t n = jp.params[i].local_numel;
    if (n == 0) continue;
    CANZONA_RETURN_IF_ERROR(trainer.Read(trainer.grad(j), j, n,
                                         staging_.grads + layout.offset[i],
                                         copier, staging_.on_device));
    if (trainer.dtype(j) != DType::kFloat32 && !read_masters) continue;
    CANZONA_RETURN_IF_ERROR(trainer.Read(trainer.param(j), j, n,
                                         staging_.params + layout.offset[i],
                                         copier, staging_.on_device));
  }
  float* g = staging_.grads + bucket.base;
  const int d = layout.shard_pos;
  float* slice = parts_.slice.data();
  Communicator& dp = *parts_.dp;
  if (layout.sliced) {
    const int64_t mine = bucket.counts[d];
    CANZONA_RETURN_IF_ERROR(parts_.calibration->Run(
        b, [&] { return dp.ReduceScatterV(g, bucket.counts, slice); }));
    CANZONA_RETURN_IF_ERROR(
        copier.Copy(g + bucket.my_start, slice, mine * sizeof(float)));
    if (parts_.cross->size() > 1 && mine > 0) {
      CANZONA_RETURN_IF_ERROR(
          parts_.cross->AllReduce(g + bucket.my_start, mine));
    }
  } else if (dp.size() > 1) {
    const std::vector<int64_t>& counts = bucket.even_counts;
    CANZONA_RETURN_IF_ERROR(dp.ReduceScatterV(g, counts, slice));
    CANZONA_RETURN_IF_ERROR(
        copier.Copy(g + bucket.even_start, slice, counts[d] * sizeof(float)));
    CANZONA_RETURN_IF_ERROR(dp.AllGatherV(g + bucket.even_start, counts, g));
  }
  return copier.Finish();
}

absl::Status BucketCollectives::Gather(int b) {
  const JobPlan& jp = *staging_.plan;
  const RankLayout& layout = *staging_.layout;
  const TrainerBuffers& trainer = *staging_.trainer;
  StageCopier& copier = *parts_.copier;
  const BucketLayout& bucket = layout.buckets[b];
  if (layout.sliced) {
    float* p = staging_.params + bucket.base;
    CANZONA_RETURN_IF_ERROR(parts_.calibration->Run(b, [&] {
      return parts_.dp->AllGatherV(p + bucket.my_start, bucket.counts, p);
    }));
  } else if (jp.plan.strategy == plan::Strategy::kLayerwise &&
             parts_.dp->size() > 1 && b == layout.gather_order.front()) {
    CANZONA_RETURN_IF_ERROR(GatherLayerwise());
  }
  for (int i : jp.plan.buckets[bucket.index].params) {
    const int64_t n = jp.params[i].local_numel;
    if (n == 0) continue;
    const int j = i - layout.first;
    CANZONA_RETURN_IF_ERROR(trainer.Write(staging_.params + layout.offset[i], j,
                                          n, trainer.param(j), copier,
                                          staging_.on_device));
  }
  CANZONA_RETURN_IF_ERROR(copier.Finish());
  if (b != layout.gather_order.back()) return absl::OkStatus();
  return parts_.calibration->EndRound(
      [&](absl::Span<float> sums) -> absl::Status {
        float* staged = parts_.sums.data();
        const int64_t bytes = static_cast<int64_t>(sums.size() * sizeof(float));
        CANZONA_RETURN_IF_ERROR(copier.Copy(staged, sums.data(), bytes));
        CANZONA_RETURN_IF_ERROR(
            parts_.dp->AllReduce(staged, static_cast<int64_t>(sums.size())));
        CANZONA_RETURN_IF_ERROR(copier.Copy(sums.data(), staged, bytes));
        return copier.Finish();
      },
      staging_.who);
}

absl::Status BucketCollectives::GatherLayerwise() {
  const JobPlan& jp = *staging_.plan;
  const RankLayout& layout = *staging_.layout;
  StageCopier& copier = *parts_.copier;
  const int DP = parts_.dp->size(), d = layout.shard_pos;
  const std::vector<int64_t>& counts = layout.layerwise_counts;
  float* packed = parts_.packed.data();
  int64_t pos = 0;
  for (int i : layout.local_params) {
    if (jp.plan.dp_owner[i] != d) continue;
    const int64_t n = jp.params[i].local_numel;
    CANZONA_RETURN_IF_ERROR(copier.Copy(
        packed + pos, staging_.params + layout.offset[i], n * sizeof(float)));
    pos += n;
  }
  std::vector<int64_t> at(DP, 0);
  for (int r = 1; r < DP; ++r) at[r] = at[r - 1] + counts[r - 1];
  float* gathered = parts_.gathered.data();
  CANZONA_RETURN_IF_ERROR(parts_.dp->AllGatherV(packed, counts, gathered));
  for (int i : layout.local_params) {
    const int owner = jp.plan.dp_owner[i];
    const int64_t n = jp.params[i].local_numel;
    CANZONA_RETURN_IF_ERROR(copier.Copy(staging_.params + layout.offset[i],
                                        gathered + at[owner],
                                        n * sizeof(float)));
    at[owner] += n;
  }
  return absl::OkStatus();
}

}  // namespace canzona
