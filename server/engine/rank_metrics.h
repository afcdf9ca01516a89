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
#include <memory>
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
  std::array<std::shared_ptr<Histogram>, kStepPhases.size()>
      phase_;  // kStepPhases
  std::shared_ptr<Counter> steps_;
  std::shared_ptr<Counter> skipped_;
  std::shared_ptr<Counter> host_waits_;
  std::shared_ptr<Counter> pageable_copies_;
  std::shared_ptr<Gauge> overlap_;
  std::shared_ptr<Counter> dp_comm_;
  std::shared_ptr<Counter> dp_comm_exposed_;
  std::shared_ptr<Gauge> grad_norm_;
  std::shared_ptr<Gauge> clip_factor_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_METRICS_H_
