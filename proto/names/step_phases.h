// The optimizer step's named phases (canzona.v1.PhaseTimes), in the order
// a step runs them, each with its accessor and its PhaseSeconds field: the
// one list the metrics, the status, the benchmarks and the simulator
// report, so a new phase is added once.
//
//   for (const StepPhase& phase : kStepPhases) {
//     Print(phase.name, (times.*phase.seconds)());   // v1::PhaseTimes
//     Print(phase.name, seconds.*phase.value);       // PhaseSeconds
//   }
//
// Thread-safety: constant data.
#ifndef CANZONA_PROTO_NAMES_STEP_PHASES_H_
#define CANZONA_PROTO_NAMES_STEP_PHASES_H_

#include <array>
#include <string_view>

#include "canzona/v1/optimizer_service.pb.h"

namespace canzona {

// The seconds of each phase as plain numbers, where the daemon's step and
// the planner's simulator keep them (v1::PhaseTimes is their wire form):
// every one of kStepPhases, and the DP communication that completed since
// the previous step (its duration on the DP lane, and the part the trainer
// waited for), which the daemon measures and the simulator does not.
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
  double dp_comm = 0;
  double dp_comm_exposed = 0;
};

struct StepPhase {
  const char* name;
  double (canzona::v1::PhaseTimes::*seconds)() const;
  double PhaseSeconds::*value;
};

// "wait" (for the daemon's other local ranks to arrive) comes first in
// time but is listed after the work; "total", always last, is the whole
// step, phases and what lies between them.
inline constexpr std::array<StepPhase, 9> kStepPhases = {{
    {"reduce_scatter", &canzona::v1::PhaseTimes::reduce_scatter,
     &PhaseSeconds::reduce_scatter},
    {"world_reduce", &canzona::v1::PhaseTimes::world_reduce,
     &PhaseSeconds::world_reduce},
    {"local_compute", &canzona::v1::PhaseTimes::local_compute,
     &PhaseSeconds::local_compute},
    {"tp_gather", &canzona::v1::PhaseTimes::tp_gather,
     &PhaseSeconds::tp_gather},
    {"tp_compute", &canzona::v1::PhaseTimes::tp_compute,
     &PhaseSeconds::tp_compute},
    {"tp_scatter", &canzona::v1::PhaseTimes::tp_scatter,
     &PhaseSeconds::tp_scatter},
    {"all_gather", &canzona::v1::PhaseTimes::all_gather,
     &PhaseSeconds::all_gather},
    {"wait", &canzona::v1::PhaseTimes::wait, &PhaseSeconds::wait},
    {"total", &canzona::v1::PhaseTimes::total, &PhaseSeconds::total},
}};
static_assert(std::string_view(kStepPhases.back().name) == "total");

}  // namespace canzona

#endif  // CANZONA_PROTO_NAMES_STEP_PHASES_H_
