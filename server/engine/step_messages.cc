#include "server/engine/step_messages.h"

#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace canzona {

absl::StatusOr<RankStepRequest> ToRankStepRequest(
    const canzona::v1::StepRequest& request,
    const std::map<std::string, OptimizerConfig>& configs) {
  RankStepRequest out;
  out.step = request.step();
  for (const auto& [group, lr] : request.lr()) {
    if (!configs.count(group)) {
      return absl::InvalidArgumentError(
          absl::StrCat("lr['", group, "']: unknown group"));
    }
    if (!(lr >= 0) || !std::isfinite(lr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("lr['", group, "']: ", lr, " must be finite and >= 0"));
    }
    out.lr[group] = static_cast<float>(lr);
  }
  for (const auto& [group, scheduled] : request.settings()) {
    auto config = configs.find(group);
    if (config == configs.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("settings['", group, "']: unknown group"));
    }
    const std::map<std::string, double> values(scheduled.values().begin(),
                                               scheduled.values().end());
    absl::StatusOr<OptimizerConfig> settings =
        ScheduleSettings(config->second, values);
    if (!settings.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "settings['", group, "']: ", settings.status().message()));
    }
    out.settings.emplace(group, *std::move(settings));
  }
  out.grad_scale = request.grad_scale();
  out.async_params = request.async_params();
  out.max_grad_norm = request.max_grad_norm();
  out.reload_params.assign(request.reload_params().begin(),
                           request.reload_params().end());
  return out;
}

canzona::v1::PhaseTimes ToPhaseTimes(const PhaseSeconds& seconds) {
  canzona::v1::PhaseTimes out;
  out.set_reduce_scatter(seconds.reduce_scatter);
  out.set_world_reduce(seconds.world_reduce);
  out.set_local_compute(seconds.local_compute);
  out.set_tp_gather(seconds.tp_gather);
  out.set_tp_compute(seconds.tp_compute);
  out.set_tp_scatter(seconds.tp_scatter);
  out.set_all_gather(seconds.all_gather);
  out.set_wait(seconds.wait);
  out.set_total(seconds.total);
  out.set_dp_comm(seconds.dp_comm);
  out.set_dp_comm_exposed(seconds.dp_comm_exposed);
  return out;
}

canzona::v1::StepResponse ToStepResponse(const RankStepResult& result) {
  canzona::v1::StepResponse out;
  *out.mutable_seconds() = ToPhaseTimes(result.seconds);
  out.set_grad_norm(result.grad_norm);
  out.set_update_rms(result.update_rms);
  out.set_skipped_nonfinite(result.skipped_nonfinite);
  out.set_clip_factor(result.clip_factor);
  out.set_host_waits(result.host_waits);
  out.set_pageable_copies(result.pageable_copies);
  return out;
}

}  // namespace canzona
