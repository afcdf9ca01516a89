// PhaseSeconds: the seconds one local rank's step spent in each named
// phase, as the step, the TP lane and the rank's metrics record them: the
// engine's own form of v1::PhaseTimes (step_messages.h converts at the
// Engine boundary). kPhaseSecondsFields gives its field for each of
// kStepPhases (proto/names/step_phases.h names the phases), in that order.
//
//   PhaseSeconds times;
//   times.tp_gather += Seconds(start, absl::Now());
//   for (const PhaseSecondsField& f : kPhaseSecondsFields) times.*f.seconds;
//
// Thread-safety: a plain value.
#ifndef CANZONA_SERVER_ENGINE_PHASE_SECONDS_H_
#define CANZONA_SERVER_ENGINE_PHASE_SECONDS_H_

#include <array>
#include <cstddef>

#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "proto/names/step_phases.h"

namespace canzona {

// The seconds from `from` to `to`: how every phase is timed.
inline double Seconds(absl::Time from, absl::Time to) {
  return absl::ToDoubleSeconds(to - from);
}

struct PhaseSeconds {
  double reduce_scatter = 0;
  double world_reduce = 0;
  double local_compute = 0;
  double tp_gather = 0;
  double tp_compute = 0;
  double tp_scatter = 0;
  double all_gather = 0;
  double wait = 0;
  double total = 0;
  // DP communication that completed since the previous step: its
  // duration on the DP lane, and the part the trainer waited for.
  double dp_comm = 0;
  double dp_comm_exposed = 0;
};

// One of kStepPhases as a PhaseSeconds field (`phase`: its accessor there,
// which ties the two lists together).
struct PhaseSecondsField {
  double (canzona::v1::PhaseTimes::*phase)() const;
  double PhaseSeconds::*seconds;
};

inline constexpr std::array<PhaseSecondsField, kStepPhases.size()>
    kPhaseSecondsFields = {{
        {&canzona::v1::PhaseTimes::reduce_scatter,
         &PhaseSeconds::reduce_scatter},
        {&canzona::v1::PhaseTimes::world_reduce, &PhaseSeconds::world_reduce},
        {&canzona::v1::PhaseTimes::local_compute, &PhaseSeconds::local_compute},
        {&canzona::v1::PhaseTimes::tp_gather, &PhaseSeconds::tp_gather},
        {&canzona::v1::PhaseTimes::tp_compute, &PhaseSeconds::tp_compute},
        {&canzona::v1::PhaseTimes::tp_scatter, &PhaseSeconds::tp_scatter},
        {&canzona::v1::PhaseTimes::all_gather, &PhaseSeconds::all_gather},
        {&canzona::v1::PhaseTimes::wait, &PhaseSeconds::wait},
        {&canzona::v1::PhaseTimes::total, &PhaseSeconds::total},
    }};

namespace phase_seconds_internal {
constexpr bool InStepPhasesOrder() {
  for (size_t i = 0; i < kStepPhases.size(); ++i) {
    if (kPhaseSecondsFields[i].phase != kStepPhases[i].seconds) return false;
  }
  return true;
}
}  // namespace phase_seconds_internal
static_assert(phase_seconds_internal::InStepPhasesOrder(),
              "kPhaseSecondsFields must follow kStepPhases");

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_PHASE_SECONDS_H_
