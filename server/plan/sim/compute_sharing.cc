#include "server/plan/sim/compute_sharing.h"

#include <algorithm>
#include <numeric>

namespace canzona::plan::sim {

std::vector<double> SharedFinishTimes(const std::vector<double>& work,
                                      int units, double background) {
  std::vector<size_t> order(work.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return work[a] < work[b]; });
  std::vector<double> finish(work.size(), 0.0);
  size_t active = 0;
  for (double w : work) active += w > 0 ? 1 : 0;
  double now = 0, done = 0;  // work done so far by every job still active
  for (size_t i : order) {
    if (work[i] <= 0) continue;
    const double rate = std::min(
        1.0, static_cast<double>(std::max(units, 1)) / (active + background));
    now += (work[i] - done) / rate;
    done = work[i];
    finish[i] = now;
    --active;
  }
  return finish;
}

double SharingSlowdown(int busy, int units, double background) {
  const double threads = busy + background;
  return threads > units ? threads / std::max(units, 1) : 1.0;
}

}  // namespace canzona::plan::sim
