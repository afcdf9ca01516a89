#include "server/plan/sim/simulated_gpus.h"

#include <algorithm>
#include <cmath>

#include "server/plan/sim/compute_sharing.h"

namespace canzona::plan::sim::internal {

using plan::internal::Item;

void AddSegment(GpuSimulation& g, Lane lane, const std::string& phase,
                double start, double end) {
  if (end <= start) return;
  // Merge with the lane's previous bar of the same phase when contiguous,
  // so that a thousand small exchanges draw as one bar.
  for (auto it = g.timeline.rbegin(); it != g.timeline.rend(); ++it) {
    if (it->lane != lane) continue;
    if (it->phase == phase && std::fabs(it->end - start) < 1e-12) {
      it->end = end;
      return;
    }
    break;
  }
  g.timeline.push_back({lane, phase, start, end});
}

SimulatedGpus::SimulatedGpus(const StepInputs& in) : in_(in) {
  const int P = in_.ctx.P, R = in_.ctx.R, T = in_.ctx.T;
  gpus_.resize(static_cast<size_t>(P) * R * T);
  for (int s = 0; s < P; ++s) {
    for (int d = 0; d < R; ++d) {
      for (int t = 0; t < T; ++t) {
        GpuState& g = At(s, d, t);
        g.rank = in_.place.GlobalRank(s, d, t);
        g.slowdown = SharingSlowdown(in_.place.RanksOnNode(g.rank),
                                     in_.profile.compute_units_per_node,
                                     in_.profile.background_threads);
        g.out.stage = s;
        g.out.dp = d;
        g.out.tp = t;
        g.out.node = in_.place.Node(g.rank);
      }
    }
  }
  for (size_t i = 0; i < in_.ctx.items.size(); ++i) {
    const Item& it = in_.ctx.items[i];
    for (int d = 0; d < R; ++d) {
      for (int t = 0; t < T; ++t) {
        GpuState& g = At(it.stage, d, t);
        g.stage_elements += it.fragment_numel;
        if (!in_.Owns(static_cast<int>(i), d)) continue;
        g.owned_elements += it.fragment_numel;
        if (it.elem_bytes < kStagingBytes) {
          g.master_elements += it.fragment_numel;
        }
        g.largest_owned = std::max(g.largest_owned, it.fragment_numel);
        const double whole = in_.update_s[i];
        if (!it.tp_owned) {
          g.dp_owned_s += it.split ? whole / T : whole;
          g.out.update_s += it.split ? whole / T : whole;
        } else if (in_.Redundant(static_cast<int>(i)) ||
                   in_.plan.tp_owner[i] == t) {
          g.out.update_s += whole;
        }
      }
    }
  }
  // ZeRO-1 (server/DESIGN.md section 5.1): fp32 gradients for what the
  // GPU owns, fp32 masters of its 16-bit parameters, and the largest
  // owned parameter's old values (the update's size).
  for (GpuState& g : gpus_) {
    g.out.memory_bytes = in_.plan.per_gpu[&g - gpus_.data()].state_bytes +
                         kStagingBytes * static_cast<double>(g.owned_elements +
                                                             g.master_elements +
                                                             g.largest_owned);
  }
}

int SimulatedGpus::Mirrors(int rank) const {
  int simulated = 0;
  for (const GpuState& g : gpus_) {
    simulated += in_.place.Node(g.rank) == in_.place.Node(rank);
  }
  return std::max(1, in_.place.RanksOnNode(rank) / std::max(simulated, 1));
}

std::vector<double> SimulatedGpus::ShareNodes(
    const std::vector<int>& ranks, const std::vector<double>& work) const {
  std::vector<double> finish(work.size(), 0.0);
  std::vector<std::vector<size_t>> by_node(in_.place.nodes());
  for (size_t k = 0; k < ranks.size(); ++k) {
    by_node[in_.place.Node(ranks[k])].push_back(k);
  }
  for (const std::vector<size_t>& members : by_node) {
    if (members.empty()) continue;
    const int mirrors = Mirrors(ranks[members.front()]);
    std::vector<double> shared;
    for (int m = 0; m < mirrors; ++m) {
      for (size_t k : members) shared.push_back(work[k]);
    }
    const std::vector<double> done =
        SharedFinishTimes(shared, in_.profile.compute_units_per_node,
                          in_.profile.background_threads);
    for (size_t j = 0; j < members.size(); ++j) finish[members[j]] = done[j];
  }
  return finish;
}

}  // namespace canzona::plan::sim::internal
