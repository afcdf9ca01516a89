// How the ranks of one node share its compute units: a rank computes at
// its full (calibrated) rate while no more ranks than units compute at
// once; beyond that the units are shared equally among the busy ranks
// (processor sharing). On a GPU node every rank has its own GPU, so the
// rates hold; on a CPU machine with one BLAS thread per rank, N ranks on
// C cores each get C / N of a core while all of them are busy. A shared
// machine's other work counts as `background` busy threads that never
// finish: N ranks then get C / (N + background) each.
//
// Thread-safety: pure functions.
#ifndef CANZONA_SERVER_PLAN_SIM_COMPUTE_SHARING_H_
#define CANZONA_SERVER_PLAN_SIM_COMPUTE_SHARING_H_

#include <vector>

namespace canzona::plan::sim {

// Finish times of jobs that all start at 0, `work[i]` seconds each at the
// full rate, sharing `units` units with `background` other threads
// (processor sharing). Zero work finishes at 0.
std::vector<double> SharedFinishTimes(const std::vector<double>& work,
                                      int units, double background = 0);

// The slowdown of work that `busy` ranks of a node run at the same time.
double SharingSlowdown(int busy, int units, double background = 0);

}  // namespace canzona::plan::sim

#endif  // CANZONA_SERVER_PLAN_SIM_COMPUTE_SHARING_H_
