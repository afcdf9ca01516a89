#include "server/plan/sim/tp_pipeline.h"

#include <algorithm>

namespace canzona::plan::sim {

PipelineSchedule ScheduleTpPipeline(const std::vector<PipelineGroup>& groups,
                                    const std::vector<double>& ready) {
  const size_t n = groups.size();
  const size_t ranks = ready.size();
  PipelineSchedule p;
  p.gather.resize(n);
  p.scatter.resize(n);
  p.compute.assign(n, std::vector<Interval>(ranks));
  p.end = ready;
  p.gather_s.assign(ranks, 0.0);
  p.compute_s.assign(ranks, 0.0);
  p.scatter_s.assign(ranks, 0.0);
  if (n == 0 || ranks == 0) return p;

  // S_i: the lane is free and every rank's C_i is done; a rank counts from
  // the moment it could start (its own compute done).
  double lane = *std::max_element(ready.begin(), ready.end());
  auto scatter = [&](size_t i) {
    double all_done = lane;
    for (size_t t = 0; t < ranks; ++t) {
      all_done = std::max(all_done, p.compute[i][t].end);
    }
    p.scatter[i] = {all_done, all_done + groups[i].scatter_s};
    for (size_t t = 0; t < ranks; ++t) {
      p.scatter_s[t] += p.scatter[i].end - std::max(lane, p.compute[i][t].end);
    }
    lane = p.scatter[i].end;
  };

  for (size_t i = 0; i < n; ++i) {
    p.gather[i] = {lane, lane + groups[i].gather_s};
    for (size_t t = 0; t < ranks; ++t) {
      // G0 is reached by each rank when its DP-owned updates end.
      p.gather_s[t] += p.gather[i].end - (i == 0 ? ready[t] : lane);
    }
    lane = p.gather[i].end;
    for (size_t t = 0; t < ranks; ++t) {
      const double after = i == 0 ? 0.0 : p.compute[i - 1][t].end;
      const double start = std::max(p.gather[i].end, after);
      p.compute[i][t] = {start, start + groups[i].compute_s[t]};
      p.compute_s[t] += groups[i].compute_s[t];
    }
    if (i >= 1) scatter(i - 1);
  }
  scatter(n - 1);
  std::fill(p.end.begin(), p.end.end(), p.scatter[n - 1].end);
  return p;
}

}  // namespace canzona::plan::sim
