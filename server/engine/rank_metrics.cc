#include "server/engine/rank_metrics.h"

namespace canzona {

RankMetrics::RankMetrics(const CanzonaMetrics& m, const std::string& job,
                         const std::string& rank) {
  for (size_t i = 0; i < kStepPhases.size(); ++i) {
    phase_[i] = m.step_phase_seconds->Shared({job, rank, kStepPhases[i].name});
  }
  steps_ = m.steps_total->Shared({job, rank});
  skipped_ = m.steps_skipped_total->Shared({job, rank});
  host_waits_ = m.step_host_waits_total->Shared({job, rank});
  pageable_copies_ = m.step_pageable_copies_total->Shared({job, rank});
  overlap_ = m.tp_overlap_ratio->Shared({job, rank});
  dp_comm_ = m.dp_comm_seconds_total->Shared({job, rank});
  dp_comm_exposed_ = m.dp_comm_exposed_seconds_total->Shared({job, rank});
  grad_norm_ = m.grad_norm->Shared({job, rank});
  clip_factor_ = m.clip_factor->Shared({job, rank});
}

void RankMetrics::RecordStep(const RankStepResult& result, double tp_comm_s,
                             double tp_hidden_s) {
  const PhaseSeconds& t = result.seconds;
  for (size_t i = 0; i < kStepPhases.size(); ++i) {
    phase_[i]->Observe(t.*kStepPhases[i].value);
  }
  steps_->Increment();
  host_waits_->Increment(static_cast<double>(result.host_waits));
  pageable_copies_->Increment(static_cast<double>(result.pageable_copies));
  if (result.skipped_nonfinite) {
    skipped_->Increment();
  } else {
    grad_norm_->Set(result.grad_norm);
    clip_factor_->Set(result.clip_factor);
  }
  overlap_->Set(tp_comm_s > 0 ? tp_hidden_s / tp_comm_s : 0);
  dp_comm_->Increment(t.dp_comm);
  dp_comm_exposed_->Increment(t.dp_comm_exposed);
}

}  // namespace canzona
