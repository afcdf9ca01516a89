#include "server/plan/sim/trainer_iteration.h"

#include <algorithm>

namespace canzona::plan::sim {

SimOverlap SimulateIteration(const LaneSteps& lane, const SimOptions& options) {
  SimOverlap o;
  o.forward_s = options.forward_s;
  o.backward_s = options.backward_s;
  double reduce = 0, gather = 0;
  for (double x : lane.reduce_s) reduce += x;
  for (double x : lane.gather_s) gather += x;
  o.dp_comm_s = reduce + gather;
  o.update_span_s = lane.update_span_s;
  o.plain_iteration_s = o.backward_s + lane.step_s + o.forward_s;
  o.plain_exposed_s = o.dp_comm_s;
  if (!options.overlap) return o;
  // Reductions start as backward finishes each bucket.
  const size_t nb = std::max<size_t>(1, lane.reduce_s.size());
  double at = 0;
  for (size_t b = 0; b < lane.reduce_s.size(); ++b) {
    const double ready = o.backward_s * (b + 1) / nb;
    at = std::max(at, ready) + lane.reduce_s[b];
  }
  const double exposed_reduce = std::max(0.0, at - o.backward_s);
  const double step_end = o.backward_s + exposed_reduce + o.update_span_s;
  // Forward waits for each bucket's gather, in gather order.
  double gathered = step_end, forward = step_end, waited = 0;
  const size_t ng = std::max<size_t>(1, lane.gather_s.size());
  for (double x : lane.gather_s) {
    gathered += x;
    if (gathered > forward) {
      waited += gathered - forward;
      forward = gathered;
    }
    forward += o.forward_s / ng;
  }
  if (lane.gather_s.empty()) forward += o.forward_s;
  o.overlap_iteration_s = forward;
  o.overlap_wait_params_s = waited;
  o.overlap_exposed_s = exposed_reduce + waited;
  return o;
}

}  // namespace canzona::plan::sim
