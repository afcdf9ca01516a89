// How the engine times a step's phases: Seconds(from, to) into the
// PhaseSeconds of proto/names/step_phases.h (one struct for the step, the
// TP lane, the rank's metrics and the simulator; step_messages.h converts
// it to v1::PhaseTimes at the Engine boundary).
//
//   PhaseSeconds times;
//   times.tp_gather += Seconds(start, absl::Now());
//
// Thread-safety: pure functions.
#ifndef CANZONA_SERVER_ENGINE_PHASE_SECONDS_H_
#define CANZONA_SERVER_ENGINE_PHASE_SECONDS_H_

#include "absl/time/time.h"
#include "proto/names/step_phases.h"

namespace canzona {

// The seconds from `from` to `to`: how every phase is timed.
inline double Seconds(absl::Time from, absl::Time to) {
  return absl::ToDoubleSeconds(to - from);
}

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_PHASE_SECONDS_H_
