// The optimizer step's named phases (canzona.v1.PhaseTimes), in the order
// a step runs them, each with its accessor: the one list the metrics, the
// status and the benchmarks report, so a new phase is added once.
//
//   for (const StepPhase& phase : kStepPhases) {
//     Print(phase.name, (times.*phase.seconds)());
//   }
//
// Thread-safety: constant data.
#ifndef CANZONA_PROTO_NAMES_STEP_PHASES_H_
#define CANZONA_PROTO_NAMES_STEP_PHASES_H_

#include <array>
#include <string_view>

#include "canzona/v1/optimizer_service.pb.h"

namespace canzona {

struct StepPhase {
  const char* name;
  double (canzona::v1::PhaseTimes::*seconds)() const;
};

// "wait" (for the daemon's other local ranks to arrive) comes first in
// time but is listed after the work; "total", always last, is the whole
// step, phases and what lies between them.
inline constexpr std::array<StepPhase, 9> kStepPhases = {{
    {"reduce_scatter", &canzona::v1::PhaseTimes::reduce_scatter},
    {"world_reduce", &canzona::v1::PhaseTimes::world_reduce},
    {"local_compute", &canzona::v1::PhaseTimes::local_compute},
    {"tp_gather", &canzona::v1::PhaseTimes::tp_gather},
    {"tp_compute", &canzona::v1::PhaseTimes::tp_compute},
    {"tp_scatter", &canzona::v1::PhaseTimes::tp_scatter},
    {"all_gather", &canzona::v1::PhaseTimes::all_gather},
    {"wait", &canzona::v1::PhaseTimes::wait},
    {"total", &canzona::v1::PhaseTimes::total},
}};
static_assert(std::string_view(kStepPhases.back().name) == "total");

}  // namespace canzona

#endif  // CANZONA_PROTO_NAMES_STEP_PHASES_H_
