#include "server/plan/sim/world_reduction.h"

#include <algorithm>
#include <vector>

#include "server/plan/sim/link_model.h"

namespace canzona::plan::sim::internal {

void WorldReduction::Reduce() {
  std::vector<int> world;
  for (int r = 0; r < in_.place.world(); ++r) world.push_back(r);
  const Link link = in_.LinkOf(world);
  const double collective =
      AllReduce(in_.profile.comm, link, in_.place.world(), 5 * 4.0);
  double start = 0;
  std::vector<double> began(gpus_.size());
  for (size_t i = 0; i < gpus_.size(); ++i) {
    GpuState& g = gpus_[i];
    began[i] = g.worker;
    g.worker +=
        2 * kStagingBytes * g.owned_elements / in_.memory_bps * g.slowdown;
    start = std::max(start, g.worker);
  }
  for (size_t i = 0; i < gpus_.size(); ++i) {
    GpuState& g = gpus_[i];
    g.worker = start + collective;
    AddSegment(g.out, Lane::kWorker, "world_reduce", began[i], g.worker);
    g.out.phases.world_reduce += g.worker - began[i];
  }
}

void WorldReduction::UpdateSizePass() {
  for (GpuState& g : gpus_) {
    const double began = g.worker;
    g.worker +=
        6 * kStagingBytes * g.owned_elements / in_.memory_bps * g.slowdown;
    AddSegment(g.out, Lane::kWorker, "world_reduce", began, g.worker);
    g.out.phases.world_reduce += g.worker - began;
  }
}

}  // namespace canzona::plan::sim::internal
