#include "server/engine/tp_lane.h"

#include <utility>

#include "kernels/base/status_macros.h"

namespace canzona {

TpLane::TpLane(Staging staging, Parts parts)
    : staging_(std::move(staging)), parts_(std::move(parts)) {}

absl::Status TpLane::Pack(int i) {
  const JobPlan& jp = *staging_.plan;
  const RankLayout& layout = *staging_.layout;
  StagingCopier& copier = *parts_.copier;
  float* send = parts_.buffers[i].send.data();
  for (int h = 0; h < layout.tp_size; ++h) {
    for (int p : group(i).group->params) {
      if (jp.plan.tp_owner[p] != h) continue;
      const int64_t n = jp.params[p].fragment_numel;
      CANZONA_RETURN_IF_ERROR(
          copier.Copy(send, staging_.owned->grad_at[p], n * sizeof(float)));
      CANZONA_RETURN_IF_ERROR(copier.Copy(send + n, staging_.owned->param_at[p],
                                          n * sizeof(float)));
      send += 2 * n;
    }
  }
  return absl::OkStatus();
}

absl::Status TpLane::Unpack(int i) {
  const JobPlan& jp = *staging_.plan;
  const RankLayout& layout = *staging_.layout;
  StagingCopier& copier = *parts_.copier;
  const float* in = parts_.buffers[i].back_in.data();
  for (int h = 0; h < layout.tp_size; ++h) {
    for (int p : group(i).group->params) {
      if (jp.plan.tp_owner[p] != h) continue;
      const int64_t n = jp.params[p].fragment_numel;
      CANZONA_RETURN_IF_ERROR(
          copier.Copy(staging_.owned->param_at[p], in, n * sizeof(float)));
      in += n;
    }
  }
  return absl::OkStatus();
}

}  // namespace canzona
