#include "server/plan/sim/update_phases.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "server/plan/sim/link_model.h"

namespace canzona::plan::sim::internal {

void UpdatePhases::DpOwnedUpdates() {
  std::vector<int> ranks;
  std::vector<double> work;
  for (const GpuState& g : gpus_) {
    ranks.push_back(g.rank);
    work.push_back(g.dp_owned_s);
  }
  const std::vector<double> finish = gpus_.ShareNodes(ranks, work);
  for (size_t i = 0; i < gpus_.size(); ++i) {
    GpuState& g = gpus_[i];
    AddSegment(g.out, Lane::kWorker, "local_compute", g.worker,
               g.worker + finish[i]);
    g.worker += finish[i];
    g.out.phases.local_compute = finish[i];
  }
}

void UpdatePhases::TpPipelines() {
  const int T = in_.ctx.T;
  if (T <= 1) return;
  std::vector<TpGroup> tp_groups;
  for (int s = 0; s < in_.ctx.P; ++s) {
    for (int d = 0; d < in_.ctx.R; ++d) {
      std::vector<const MicroGroup*> mine;
      for (const MicroGroup& g : in_.plan.micro_groups) {
        if (g.stage == s && g.dp == d) mine.push_back(&g);
      }
      if (!mine.empty()) tp_groups.push_back(Exchanges(s, d, mine));
    }
  }
  ShareGroupCompute(tp_groups);
  for (const TpGroup& tp_group : tp_groups) Schedule(tp_group);
}

UpdatePhases::TpGroup UpdatePhases::Exchanges(
    int s, int d, const std::vector<const MicroGroup*>& mine) {
  const int T = in_.ctx.T;
  std::vector<int> ranks;
  for (int t = 0; t < T; ++t) ranks.push_back(gpus_.At(s, d, t).rank);
  const Link link = in_.LinkOf(ranks);
  const double slowdown = gpus_.At(s, d, 0).slowdown;
  TpGroup out{s, d, {}};
  for (const MicroGroup* mg : mine) {
    PipelineGroup pg;
    pg.compute_s.assign(T, 0.0);
    // The gather moves gradient + parameter fragments to each TP owner, the
    // scatter the updated parameter fragments back; each packs or
    // unpacks what it moves.
    Flows gather(T, std::vector<double>(T, 0.0));
    Flows scatter(T, std::vector<double>(T, 0.0));
    std::vector<double> moved(T, 0.0);
    for (int i : mg->params) {
      const int tp_owner = in_.plan.tp_owner[i];
      const double frag =
          static_cast<double>(in_.ctx.items[i].fragment_numel) * kStagingBytes;
      for (int t = 0; t < T; ++t) {
        if (t == tp_owner) continue;
        gather[t][tp_owner] += 2 * frag;
        scatter[tp_owner][t] += frag;
        moved[t] += frag;
        moved[tp_owner] += frag;
      }
      // Assemble gradient and parameter, update, cut the result back.
      pg.compute_s[tp_owner] +=
          in_.update_s[i] + 2 * 3 * frag * T / in_.memory_bps;
    }
    const double packing = *std::max_element(moved.begin(), moved.end());
    pg.gather_s =
        AllToAllV(link, gather) + 2 * 2 * packing / in_.memory_bps * slowdown;
    pg.scatter_s =
        AllToAllV(link, scatter) + 2 * packing / in_.memory_bps * slowdown;
    out.groups.push_back(std::move(pg));
  }
  return out;
}

void UpdatePhases::ShareGroupCompute(std::vector<TpGroup>& tp_groups) {
  size_t depth = 0;
  for (const TpGroup& tp : tp_groups) depth = std::max(depth, tp.groups.size());
  for (size_t i = 0; i < depth; ++i) {
    std::vector<double*> compute;  // group i's compute on each rank
    std::vector<int> ranks;
    std::vector<double> work;
    for (TpGroup& tp : tp_groups) {
      if (i >= tp.groups.size()) continue;
      for (int t = 0; t < in_.ctx.T; ++t) {
        compute.push_back(&tp.groups[i].compute_s[t]);
        ranks.push_back(gpus_.At(tp.stage, tp.dp, t).rank);
        work.push_back(tp.groups[i].compute_s[t]);
      }
    }
    const std::vector<double> finish = gpus_.ShareNodes(ranks, work);
    for (size_t k = 0; k < compute.size(); ++k) *compute[k] = finish[k];
  }
}

void UpdatePhases::Schedule(const TpGroup& tp_group) {
  const int T = in_.ctx.T;
  std::vector<double> ready;
  for (int t = 0; t < T; ++t)
    ready.push_back(gpus_.At(tp_group.stage, tp_group.dp, t).worker);
  const std::vector<PipelineGroup>& groups = tp_group.groups;
  const PipelineSchedule p = ScheduleTpPipeline(groups, ready);
  for (int t = 0; t < T; ++t) {
    GpuState& g = gpus_.At(tp_group.stage, tp_group.dp, t);
    for (size_t i = 0; i < groups.size(); ++i) {
      AddSegment(g.out, Lane::kTp, "tp_gather",
                 i == 0 ? ready[t] : p.gather[i].start, p.gather[i].end);
      AddSegment(g.out, Lane::kWorker, "tp_compute", p.compute[i][t].start,
                 p.compute[i][t].end);
      AddSegment(g.out, Lane::kTp, "tp_scatter", p.scatter[i].start,
                 p.scatter[i].end);
    }
    g.out.phases.tp_gather += p.gather_s[t];
    g.out.phases.tp_compute += p.compute_s[t];
    g.out.phases.tp_scatter += p.scatter_s[t];
    g.worker = p.end[t];
  }
}

void UpdatePhases::RedundantUpdates() {
  const int T = in_.ctx.T;
  if (T <= 1) return;
  for (int s = 0; s < in_.ctx.P; ++s) {
    for (int d = 0; d < in_.ctx.R; ++d) {
      std::vector<int> ranks;
      double now = 0;
      for (int t = 0; t < T; ++t) {
        ranks.push_back(gpus_.At(s, d, t).rank);
        now = std::max(now, gpus_.At(s, d, t).worker);
      }
      const Link link = in_.LinkOf(ranks);
      GpuState& first = gpus_.At(s, d, 0);
      double gather = 0, compute = 0;
      for (int i : in_.ctx.stage_params[s]) {
        if (!in_.Redundant(i) || !in_.Owns(i, d)) continue;
        const int64_t ln = in_.ctx.items[i].fragment_numel;
        const double frag = static_cast<double>(ln) * kStagingBytes;
        const std::vector<int64_t> counts(T, 2 * ln);
        const double exchange =
            in_.profile.comm == CommPlane::kNccl
                ? NcclAllGatherV(link, counts, kStagingBytes).seconds
                : GlooAllGatherV(link, counts, kStagingBytes);
        gather += exchange + gpus_.Copy(first, 2 * frag) +
                  gpus_.Copy(first, 2 * frag * T);
        compute += in_.update_s[i] * first.slowdown + gpus_.Copy(first, frag);
      }
      for (int t = 0; t < T; ++t) {
        GpuState& g = gpus_.At(s, d, t);
        AddSegment(g.out, Lane::kTp, "tp_gather", now, now + gather);
        AddSegment(g.out, Lane::kWorker, "tp_compute", now + gather,
                   now + gather + compute);
        g.out.phases.tp_gather += gather;
        g.out.phases.tp_compute += compute;
        g.worker = now + gather + compute;
      }
    }
  }
}
}  // namespace canzona::plan::sim::internal
