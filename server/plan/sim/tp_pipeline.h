// The TP micro-group pipeline of one TP group (the T ranks of one DP
// position), scheduled the way the engine runs it (server/DESIGN.md 4.2;
// host_tp_lane.cc, stream_tp_lane.cc):
//
//   communication lane (collective, the same order on every TP rank):
//     G0, G1, S0, G2, S1, ..., G(n-1), S(n-2), S(n-1)
//   compute (each rank's own matrices of the group):
//     C_i on rank t starts when G_i ended and C_(i-1) on t ended;
//   S_i starts when the lane is free and C_i ended on EVERY rank (it is an
//   all-to-all); G0 starts when every rank finished its DP-owned updates.
//   One group runs G0, C0, S0 in sequence (nothing to overlap).
//
// So the gather of group i+1 and the scatter of group i-1 overlap the
// compute of group i ("two deep"). Phase times are counted as the engine
// counts them: a rank's gather and scatter seconds run from the moment its
// lane reached the exchange (for S_i: its own C_i ended) to the exchange's
// end, so waiting for a slower peer counts as communication.
//
// Thread-safety: pure function.
#ifndef CANZONA_SERVER_PLAN_SIM_TP_PIPELINE_H_
#define CANZONA_SERVER_PLAN_SIM_TP_PIPELINE_H_

#include <vector>

namespace canzona::plan::sim {

struct Interval {
  double start = 0;
  double end = 0;
};

// One micro-group: its exchanges' durations and each rank's compute.
struct PipelineGroup {
  double gather_s = 0;
  double scatter_s = 0;
  std::vector<double> compute_s;  // per TP rank
};

struct PipelineSchedule {
  std::vector<Interval> gather;                // per group
  std::vector<Interval> scatter;               // per group
  std::vector<std::vector<Interval>> compute;  // [group][rank]
  std::vector<double> end;                     // per rank
  // Per rank, counted as the engine counts them (see above).
  std::vector<double> gather_s, compute_s, scatter_s;
};

// `ready[t]`: when rank t finished its DP-owned updates. Every group must have
// ready.size() compute entries.
PipelineSchedule ScheduleTpPipeline(const std::vector<PipelineGroup>& groups,
                                    const std::vector<double>& ready);

}  // namespace canzona::plan::sim

#endif  // CANZONA_SERVER_PLAN_SIM_TP_PIPELINE_H_
