// RankMetrics: the metric children of one rank (server/metrics/README.md),
// looked up once at setup so that a step records with atomics only.
//
//   RankMetrics metrics(CanzonaMetrics::Register(registry), "job1", "3");
//   metrics.RecordStep(result, tp_comm_s, tp_hidden_s);
//
// Thread-safety: RecordStep on the rank's worker; the children are atomic.
#ifndef CANZONA_SERVER_ENGINE_RANK_METRICS_H_
#define CANZONA_SERVER_ENGINE_RANK_METRICS_H_

#include <array>
#include <string>

#include "proto/names/step_phases.h"
#include "server/engine/rank_step_messages.h"
#include "server/metrics/canzona_metrics.h"

namespace canzona {

class RankMetrics {
 public:
  RankMetrics(const CanzonaMetrics& m, const std::string& job,
              const std::string& rank);

  void RecordStep(const RankStepResult& result, double tp_comm_s,
                  double tp_hidden_s);

 private:
  std::array<Histogram*, kStepPhases.size()> phase_ = {};  // kStepPhases
  Counter* steps_ = nullptr;
  Counter* skipped_ = nullptr;
  Counter* host_waits_ = nullptr;
  Counter* pageable_copies_ = nullptr;
  Gauge* overlap_ = nullptr;
  Counter* dp_comm_ = nullptr;
  Counter* dp_comm_exposed_ = nullptr;
  Gauge* grad_norm_ = nullptr;
  Gauge* clip_factor_ = nullptr;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_METRICS_H_
