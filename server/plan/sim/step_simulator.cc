#include "server/plan/sim/step_simulator.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "kernels/base/status_macros.h"
#include "server/plan/planning_context.h"
#include "server/plan/sim/compute_sharing.h"
#include "server/plan/sim/placement.h"
#include "server/plan/sim/tp_pipeline.h"
#include "server/plan/sim/trainer_iteration.h"

namespace canzona::plan::sim {
namespace {

using internal::Context;
using internal::Item;

// The daemon stages and exchanges fp32 inside itself (TP fragments,
// copies); only the DP collectives travel in the parameters' dtype.
constexpr double kStagingBytes = 4;

// One GPU's clocks and counters while the step is simulated.
struct GpuState {
  int rank = 0;         // global rank
  double worker = 0;    // the worker thread's clock
  double lane = 0;      // the DP lane's clock
  double slowdown = 1;  // sharing of the node's units by all its ranks
  int64_t stage_elements = 0;
  int64_t owned_elements = 0;    // owned parameters' local elements
  int64_t master_elements = 0;   // of those, 16-bit ones (fp32 masters)
  int64_t largest_owned = 0;     // the largest owned parameter's elements
  double local_s = 0;            // local updates at full rate
  std::vector<double> reduce_b;  // per bucket of its stage, lane seconds
  std::vector<double> gather_b;  // in gather order
  double reduced_at = 0;         // DP lane done with the reductions
  double gathers_from = 0;       // the gathers were queued
  GpuSimulation out;
};

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

class Run {
 public:
  Run(const Context& ctx, const HardwareProfile& profile,
      const std::vector<double>& update_s, const Plan& plan,
      const SimOptions& options)
      : ctx_(ctx),
        profile_(profile),
        update_s_(update_s),
        plan_(plan),
        options_(options),
        place_(plan.layout, profile),
        memory_bps_(profile.memory_gbps * 1e9),
        sliced_(!plan.buckets.empty() && !plan.buckets[0].cuts.empty()) {}

  StepSimulation Simulate() {
    Setup();
    ReduceBuckets();
    WorldReduction();
    LocalUpdates();
    TpPipelines();
    RedundantUpdates();
    UpdateSizePass();
    GatherBuckets();
    return Finish();
  }

 private:
  int Index(int s, int d, int t) const { return (s * ctx_.R + d) * ctx_.T + t; }
  GpuState& At(int s, int d, int t) { return gpus_[Index(s, d, t)]; }
  int ElemBytes(int i) const { return ctx_.items[i].elem_bytes; }
  // Bytes read + written by copying `bytes`, as seconds on this GPU.
  double Copy(const GpuState& g, double bytes) const {
    return 2 * bytes / memory_bps_ * g.slowdown;
  }
  // The link of a group whose every node's ranks all communicate at once.
  Link LinkOf(const std::vector<int>& ranks) const {
    int here = 0;
    for (int r : ranks) here += place_.Node(r) == place_.Node(ranks.front());
    return MakeLink(profile_, place_.Tier(ranks), here,
                    place_.RanksOnNode(ranks.front()));
  }
  // How many ranks of a node mirror each simulated GPU on it (the other
  // shard groups run the same work at the same time).
  int Mirrors(int rank) const {
    int simulated = 0;
    for (const GpuState& g : gpus_) {
      simulated += place_.Node(g.rank) == place_.Node(rank);
    }
    return std::max(1, place_.RanksOnNode(rank) / std::max(simulated, 1));
  }
  // Owner of item i is (s, d): dp_owner -1 means every DP position.
  bool Owns(int i, int d) const {
    return plan_.dp_owner[i] < 0 || plan_.dp_owner[i] == d;
  }
  bool Redundant(int i) const {
    return ctx_.items[i].hosted && plan_.tp_host[i] < 0;
  }

  void Setup() {
    const int P = ctx_.P, R = ctx_.R, T = ctx_.T;
    gpus_.resize(static_cast<size_t>(P) * R * T);
    for (int s = 0; s < P; ++s) {
      for (int d = 0; d < R; ++d) {
        for (int t = 0; t < T; ++t) {
          GpuState& g = At(s, d, t);
          g.rank = place_.GlobalRank(s, d, t);
          g.slowdown = SharingSlowdown(place_.RanksOnNode(g.rank),
                                       profile_.compute_units_per_node,
                                       profile_.background_threads);
          g.out.stage = s;
          g.out.dp = d;
          g.out.tp = t;
          g.out.node = place_.Node(g.rank);
        }
      }
    }
    for (size_t i = 0; i < ctx_.items.size(); ++i) {
      const Item& it = ctx_.items[i];
      for (int d = 0; d < R; ++d) {
        for (int t = 0; t < T; ++t) {
          GpuState& g = At(it.stage, d, t);
          g.stage_elements += it.local_numel;
          if (!Owns(static_cast<int>(i), d)) continue;
          g.owned_elements += it.local_numel;
          if (it.elem_bytes < kStagingBytes) {
            g.master_elements += it.local_numel;
          }
          g.largest_owned = std::max(g.largest_owned, it.local_numel);
          const double whole = update_s_[i];
          if (!it.hosted) {
            g.local_s += it.split ? whole / T : whole;
            g.out.update_s += it.split ? whole / T : whole;
          } else if (Redundant(static_cast<int>(i)) || plan_.tp_host[i] == t) {
            g.out.update_s += whole;
          }
        }
      }
    }
    // ZeRO-1 (server/DESIGN.md section 5.1): fp32 gradients for what the
    // GPU owns, fp32 masters of its 16-bit parameters, and the largest
    // owned parameter's old values (the update's size).
    for (GpuState& g : gpus_) {
      g.out.memory_bytes =
          plan_.per_gpu[&g - gpus_.data()].state_bytes +
          kStagingBytes *
              static_cast<double>(g.owned_elements + g.master_elements +
                                  g.largest_owned);
    }
  }

  // Slice sizes (local elements) of bucket b over the shard group.
  std::vector<int64_t> Counts(int b) const {
    const BucketPlan& bucket = plan_.buckets[b];
    const std::vector<int64_t>& off = ctx_.offsets[b];
    std::vector<int64_t> counts(ctx_.R);
    for (int d = 0; d < ctx_.R; ++d) {
      counts[d] = sliced_ ? off[bucket.cuts[d + 1]] - off[bucket.cuts[d]]
                          : bucket.elements / ctx_.R +
                                (d < bucket.elements % ctx_.R ? 1 : 0);
    }
    return counts;
  }

  // 1. Every bucket's reduction, in bucket order, per DP group (s, t).
  void ReduceBuckets() {
    const int R = ctx_.R, T = ctx_.T, G = ctx_.D / ctx_.R;
    buckets_.resize(plan_.buckets.size());
    for (size_t b = 0; b < plan_.buckets.size(); ++b) {
      const BucketPlan& bucket = plan_.buckets[b];
      const int s = bucket.stage;
      const std::vector<int64_t> counts = Counts(static_cast<int>(b));
      const int eb = ElemBytes(bucket.params.front());
      BucketSimulation& out = buckets_[b];
      out.stage = s;
      out.elements = bucket.elements;
      out.slice_imbalance = b < plan_.bucket_slice_imbalance.size()
                                ? plan_.bucket_slice_imbalance[b]
                                : 1.0;
      for (int t = 0; t < T; ++t) {
        std::vector<int> group;
        for (int d = 0; d < R; ++d) group.push_back(At(s, d, t).rank);
        const Link link = LinkOf(group);
        double collective = 0;
        if (R > 1) {
          const double memory = memory_bps_ / At(s, 0, t).slowdown;
          if (profile_.comm == CommPlane::kNccl) {
            const UnevenTime rs = NcclReduceScatterV(link, counts, eb);
            collective = rs.seconds;
            if (!sliced_) {
              collective += NcclAllGatherV(link, counts, eb).seconds;
            }
            if (t == 0) {
              out.reduce = rs;
              out.algorithm = sliced_ ? NcclUnevenName(rs.measured_choice)
                                      : "reduce_scatter+all_gather";
            }
          } else {
            collective = GlooReduceScatterV(link, counts, eb, memory);
            if (!sliced_) collective += GlooAllGatherV(link, counts, eb);
            if (t == 0) {
              out.algorithm = sliced_ ? "alltoallv" : "alltoallv+allgatherv";
            }
          }
        }
        // The trainer's gradients (and fp32 parameters) into staging.
        const double arrays = eb == 4 ? 2 : 1;
        double start = 0;
        std::vector<double> before(R);
        for (int d = 0; d < R; ++d) {
          GpuState& g = At(s, d, t);
          before[d] = g.lane;
          const double copy =
              Copy(g, arrays * bucket.elements * (eb + kStagingBytes) / 2);
          AddSegment(g.out, Lane::kDp, "reduce_scatter", g.lane, g.lane + copy);
          g.lane += copy;
          start = std::max(start, g.lane);
        }
        const double end = start + collective;
        double cross_max = 0;
        for (int d = 0; d < R; ++d) {
          GpuState& g = At(s, d, t);
          const double mine = sliced_ ? Copy(g, counts[d] * kStagingBytes) : 0;
          double cross = 0;
          if (G > 1 && counts[d] > 0) {
            std::vector<int> across;
            for (int k = 0; k < G; ++k) {
              across.push_back(place_.GlobalRank(s, d + k * R, t));
            }
            cross = AllReduce(profile_.comm, LinkOf(across), G,
                              static_cast<double>(counts[d]) * eb);
          }
          cross_max = std::max(cross_max, cross);
          AddSegment(g.out, Lane::kDp, "reduce_scatter", g.lane, end + mine);
          AddSegment(g.out, Lane::kDp, "cross_all_reduce", end + mine,
                     end + mine + cross);
          g.lane = end + mine + cross;
          g.reduce_b.push_back(g.lane - before[d]);
        }
        if (t == 0) {
          out.reduce_s = collective;
          out.cross_s = cross_max;
        }
      }
    }
    // The worker waits for its lane, then averages what it owns.
    for (size_t i = 0; i < gpus_.size(); ++i) {
      GpuState& g = gpus_[i];
      g.reduced_at = g.lane;
      const int64_t scaled =
          sliced_ ? OwnedSlices(g) : static_cast<int64_t>(g.stage_elements);
      const double scale = Copy(g, scaled * kStagingBytes);
      AddSegment(g.out, Lane::kWorker, "reduce_scatter", 0, g.lane + scale);
      g.worker = g.lane + scale;
      g.out.phases.reduce_scatter = g.worker;
    }
  }

  int64_t OwnedSlices(const GpuState& g) const {
    int64_t owned = 0;
    for (size_t b = 0; b < plan_.buckets.size(); ++b) {
      if (plan_.buckets[b].stage != g.out.stage) continue;
      owned += Counts(static_cast<int>(b))[g.out.dp];
    }
    return owned;
  }

  // 2. Finiteness and sum-of-squares passes over the owned gradients (8 B
  // read per element), then the step's one world all-reduce of five floats
  // (non-finite flag, squared norm, the previous update's squared size,
  // the clip norm and how many ranks clip).
  void WorldReduction() {
    std::vector<int> world;
    for (int r = 0; r < place_.world(); ++r) world.push_back(r);
    const Link link = LinkOf(world);
    const double collective =
        AllReduce(profile_.comm, link, place_.world(), 5 * 4.0);
    double start = 0;
    std::vector<double> began(gpus_.size());
    for (size_t i = 0; i < gpus_.size(); ++i) {
      GpuState& g = gpus_[i];
      began[i] = g.worker;
      g.worker +=
          2 * kStagingBytes * g.owned_elements / memory_bps_ * g.slowdown;
      start = std::max(start, g.worker);
    }
    for (size_t i = 0; i < gpus_.size(); ++i) {
      GpuState& g = gpus_[i];
      g.worker = start + collective;
      AddSegment(g.out, Lane::kWorker, "world_reduce", began[i], g.worker);
      g.out.phases.world_reduce += g.worker - began[i];
    }
  }

  // The update's size for the next step's reduction: each counted
  // parameter's old values copied aside (8 B per element), the difference
  // (12 B) and its sum of squares (4 B): 24 B per owned element, no
  // collective (it rides on the next step's world all-reduce).
  void UpdateSizePass() {
    for (GpuState& g : gpus_) {
      const double began = g.worker;
      g.worker +=
          6 * kStagingBytes * g.owned_elements / memory_bps_ * g.slowdown;
      AddSegment(g.out, Lane::kWorker, "world_reduce", began, g.worker);
      g.out.phases.world_reduce += g.worker - began;
    }
  }

  // Finish times of `work[k]`, run by global rank `ranks[k]`, when the
  // ranks of each node (and their mirrors in the other shard groups) all
  // start it at once and share the node's compute units.
  std::vector<double> ShareNodes(const std::vector<int>& ranks,
                                 const std::vector<double>& work) const {
    std::vector<double> finish(work.size(), 0.0);
    std::vector<std::vector<size_t>> by_node(place_.nodes());
    for (size_t k = 0; k < ranks.size(); ++k) {
      by_node[place_.Node(ranks[k])].push_back(k);
    }
    for (const std::vector<size_t>& members : by_node) {
      if (members.empty()) continue;
      const int mirrors = Mirrors(ranks[members.front()]);
      std::vector<double> shared;
      for (int m = 0; m < mirrors; ++m) {
        for (size_t k : members) shared.push_back(work[k]);
      }
      const std::vector<double> done = SharedFinishTimes(
          shared, profile_.compute_units_per_node, profile_.background_threads);
      for (size_t j = 0; j < members.size(); ++j) finish[members[j]] = done[j];
    }
    return finish;
  }

  // 3. Local updates; the ranks of a node share its compute units.
  void LocalUpdates() {
    std::vector<int> ranks;
    std::vector<double> work;
    for (const GpuState& g : gpus_) {
      ranks.push_back(g.rank);
      work.push_back(g.local_s);
    }
    const std::vector<double> finish = ShareNodes(ranks, work);
    for (size_t i = 0; i < gpus_.size(); ++i) {
      GpuState& g = gpus_[i];
      AddSegment(g.out, Lane::kWorker, "local_compute", g.worker,
                 g.worker + finish[i]);
      g.worker += finish[i];
      g.out.phases.local_compute = finish[i];
    }
  }

  // 4a. Each TP group's micro-group pipeline.
  void TpPipelines() {
    const int T = ctx_.T;
    if (T <= 1) return;
    std::vector<TpGroup> lanes;
    for (int s = 0; s < ctx_.P; ++s) {
      for (int d = 0; d < ctx_.R; ++d) {
        std::vector<const MicroGroup*> mine;
        for (const MicroGroup& g : plan_.micro_groups) {
          if (g.stage == s && g.dp == d) mine.push_back(&g);
        }
        if (!mine.empty()) lanes.push_back(Exchanges(s, d, mine));
      }
    }
    ShareGroupCompute(lanes);
    for (const TpGroup& lane : lanes) Schedule(lane);
  }

  // One TP group's micro-groups: exchanges timed, compute at full rate.
  struct TpGroup {
    int stage = 0, dp = 0;
    std::vector<PipelineGroup> groups;
  };

  TpGroup Exchanges(int s, int d, const std::vector<const MicroGroup*>& mine) {
    const int T = ctx_.T;
    std::vector<int> ranks;
    for (int t = 0; t < T; ++t) ranks.push_back(At(s, d, t).rank);
    const Link link = LinkOf(ranks);
    const double slowdown = At(s, d, 0).slowdown;
    TpGroup out{s, d, {}};
    for (const MicroGroup* mg : mine) {
      PipelineGroup pg;
      pg.compute_s.assign(T, 0.0);
      // The gather moves gradient + parameter fragments to each host, the
      // scatter the updated parameter fragments back; each packs or
      // unpacks what it moves.
      Flows gather(T, std::vector<double>(T, 0.0));
      Flows scatter(T, std::vector<double>(T, 0.0));
      std::vector<double> moved(T, 0.0);
      for (int i : mg->params) {
        const int host = plan_.tp_host[i];
        const double frag =
            static_cast<double>(ctx_.items[i].local_numel) * kStagingBytes;
        for (int t = 0; t < T; ++t) {
          if (t == host) continue;
          gather[t][host] += 2 * frag;
          scatter[host][t] += frag;
          moved[t] += frag;
          moved[host] += frag;
        }
        // Assemble gradient and parameter, update, cut the result back.
        pg.compute_s[host] += update_s_[i] + 2 * 3 * frag * T / memory_bps_;
      }
      const double packing = *std::max_element(moved.begin(), moved.end());
      pg.gather_s =
          AllToAllV(link, gather) + 2 * 2 * packing / memory_bps_ * slowdown;
      pg.scatter_s =
          AllToAllV(link, scatter) + 2 * packing / memory_bps_ * slowdown;
      out.groups.push_back(std::move(pg));
    }
    return out;
  }

  // The ranks of a node compute the same micro-group at about the same
  // time (the exchanges keep the TP groups in step): they share the node's
  // units for it, and a rank with less to do frees its share early.
  void ShareGroupCompute(std::vector<TpGroup>& lanes) {
    size_t depth = 0;
    for (const TpGroup& l : lanes) depth = std::max(depth, l.groups.size());
    for (size_t i = 0; i < depth; ++i) {
      std::vector<double*> compute;  // group i's compute on each rank
      std::vector<int> ranks;
      std::vector<double> work;
      for (TpGroup& l : lanes) {
        if (i >= l.groups.size()) continue;
        for (int t = 0; t < ctx_.T; ++t) {
          compute.push_back(&l.groups[i].compute_s[t]);
          ranks.push_back(At(l.stage, l.dp, t).rank);
          work.push_back(l.groups[i].compute_s[t]);
        }
      }
      const std::vector<double> finish = ShareNodes(ranks, work);
      for (size_t k = 0; k < compute.size(); ++k) *compute[k] = finish[k];
    }
  }

  void Schedule(const TpGroup& lane) {
    const int T = ctx_.T;
    std::vector<double> ready;
    for (int t = 0; t < T; ++t)
      ready.push_back(At(lane.stage, lane.dp, t).worker);
    const std::vector<PipelineGroup>& groups = lane.groups;
    const PipelineSchedule p = ScheduleTpPipeline(groups, ready);
    for (int t = 0; t < T; ++t) {
      GpuState& g = At(lane.stage, lane.dp, t);
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

  // 4b. sc / layerwise: every TP rank gathers each TP-split matrix it owns
  // and updates it whole, one matrix after the other.
  void RedundantUpdates() {
    const int T = ctx_.T;
    if (T <= 1) return;
    for (int s = 0; s < ctx_.P; ++s) {
      for (int d = 0; d < ctx_.R; ++d) {
        std::vector<int> ranks;
        double now = 0;
        for (int t = 0; t < T; ++t) {
          ranks.push_back(At(s, d, t).rank);
          now = std::max(now, At(s, d, t).worker);
        }
        const Link link = LinkOf(ranks);
        GpuState& first = At(s, d, 0);
        double gather = 0, compute = 0;
        for (int i : ctx_.stage_params[s]) {
          if (!Redundant(i) || !Owns(i, d)) continue;
          const int64_t ln = ctx_.items[i].local_numel;
          const double frag = static_cast<double>(ln) * kStagingBytes;
          const std::vector<int64_t> counts(T, 2 * ln);
          const double exchange =
              profile_.comm == CommPlane::kNccl
                  ? NcclAllGatherV(link, counts, kStagingBytes).seconds
                  : GlooAllGatherV(link, counts, kStagingBytes);
          gather +=
              exchange + Copy(first, 2 * frag) + Copy(first, 2 * frag * T);
          compute += update_s_[i] * first.slowdown + Copy(first, frag);
        }
        for (int t = 0; t < T; ++t) {
          GpuState& g = At(s, d, t);
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

  // 5. Gathers, last bucket first, per DP group; the copy back.
  void GatherBuckets() {
    const int R = ctx_.R, T = ctx_.T;
    for (GpuState& g : gpus_) {
      g.lane = std::max(g.lane, g.worker);
      g.gathers_from = g.lane;
    }
    for (int s = 0; s < ctx_.P; ++s) {
      const std::vector<int>& order = ctx_.stage_buckets[s];
      bool first = true;
      for (auto it = order.rbegin(); it != order.rend(); ++it, first = false) {
        const int b = *it;
        const BucketPlan& bucket = plan_.buckets[b];
        const std::vector<int64_t> counts = Counts(b);
        const int eb = ElemBytes(bucket.params.front());
        for (int t = 0; t < T; ++t) {
          std::vector<int> group;
          double start = 0;
          for (int d = 0; d < R; ++d) {
            group.push_back(At(s, d, t).rank);
            start = std::max(start, At(s, d, t).lane);
          }
          const Link link = LinkOf(group);
          double collective = 0;
          if (R > 1 && sliced_) {
            if (profile_.comm == CommPlane::kNccl) {
              const UnevenTime ag = NcclAllGatherV(link, counts, eb);
              collective = ag.seconds;
              if (t == 0) buckets_[b].gather = ag;
            } else {
              collective = GlooAllGatherV(link, counts, eb);
            }
          } else if (R > 1 && first && plan_.strategy == Strategy::kLayerwise) {
            collective = LayerwiseGather(s, t, link);
          }
          if (t == 0) buckets_[b].gather_s = collective;
          for (int d = 0; d < R; ++d) {
            GpuState& g = At(s, d, t);
            const double copy =
                Copy(g, bucket.elements * (eb + kStagingBytes) / 2);
            const double end = start + collective + copy;
            AddSegment(g.out, Lane::kDp, "all_gather", g.lane, end);
            g.gather_b.push_back(end - g.lane);
            g.lane = end;
          }
        }
      }
    }
    for (GpuState& g : gpus_) {
      AddSegment(g.out, Lane::kWorker, "all_gather", g.worker, g.lane);
      g.out.phases.all_gather = g.lane - g.worker;
      g.out.phases.total = g.lane;
    }
  }

  // Layerwise: one all-gather-v of every rank's owned parameters, packed.
  double LayerwiseGather(int s, int t, const Link& link) {
    std::vector<int64_t> counts(ctx_.R, 0);
    int64_t total = 0;
    for (int i : ctx_.stage_params[s]) {
      counts[plan_.dp_owner[i]] += ctx_.items[i].local_numel;
      total += ctx_.items[i].local_numel;
    }
    const int eb = ElemBytes(ctx_.stage_params[s].front());
    const GpuState& g = At(s, 0, t);
    const double exchange = profile_.comm == CommPlane::kNccl
                                ? NcclAllGatherV(link, counts, eb).seconds
                                : GlooAllGatherV(link, counts, eb);
    return exchange + Copy(g, total * kStagingBytes) +
           Copy(g, *std::max_element(counts.begin(), counts.end()) *
                       kStagingBytes);
  }

  StepSimulation Finish() {
    StepSimulation sim;
    sim.strategy = plan_.strategy;
    sim.profile = profile_.name;
    sim.nodes = place_.nodes();
    size_t slowest = 0;
    for (size_t i = 0; i < gpus_.size(); ++i) {
      const PhaseSeconds& p = gpus_[i].out.phases;
      for (const PhaseField& f : PhaseFields()) {
        sim.slowest_per_phase.*f.member =
            std::max(sim.slowest_per_phase.*f.member, p.*f.member);
      }
      if (p.total > gpus_[slowest].out.phases.total) slowest = i;
    }
    sim.slowest = static_cast<int>(slowest);
    sim.step_s = gpus_[slowest].out.phases.total;
    const GpuState& g = gpus_[slowest];
    sim.overlap =
        SimulateIteration({g.reduce_b, g.gather_b,
                           g.gathers_from - g.reduced_at, g.out.phases.total},
                          options_);
    sim.buckets = std::move(buckets_);
    for (GpuState& g : gpus_) sim.per_gpu.push_back(std::move(g.out));
    return sim;
  }

  const Context& ctx_;
  const HardwareProfile& profile_;
  const std::vector<double>& update_s_;
  const Plan& plan_;
  const SimOptions& options_;
  const Placement place_;
  const double memory_bps_;
  const bool sliced_;
  std::vector<GpuState> gpus_;
  std::vector<BucketSimulation> buckets_;
};

}  // namespace

const std::vector<PhaseField>& PhaseFields() {
  static const std::vector<PhaseField> fields = {
      {"reduce_scatter", &PhaseSeconds::reduce_scatter},
      {"world_reduce", &PhaseSeconds::world_reduce},
      {"local_compute", &PhaseSeconds::local_compute},
      {"tp_gather", &PhaseSeconds::tp_gather},
      {"tp_compute", &PhaseSeconds::tp_compute},
      {"tp_scatter", &PhaseSeconds::tp_scatter},
      {"all_gather", &PhaseSeconds::all_gather},
      {"total", &PhaseSeconds::total}};
  return fields;
}

const char* LaneName(Lane lane) {
  switch (lane) {
    case Lane::kWorker:
      return "worker";
    case Lane::kDp:
      return "dp";
    case Lane::kTp:
      return "tp";
  }
  return "worker";
}

StepSimulator::~StepSimulator() = default;
StepSimulator::StepSimulator(StepSimulator&&) noexcept = default;
StepSimulator& StepSimulator::operator=(StepSimulator&&) noexcept = default;

absl::StatusOr<StepSimulator> StepSimulator::Create(
    const PlanRequest& request, const HardwareProfile& profile) {
  CANZONA_RETURN_IF_ERROR(internal::Validate(request));
  StepSimulator sim;
  sim.request_ = std::make_unique<PlanRequest>(request);
  sim.context_ =
      std::make_unique<internal::Context>(internal::MakeContext(*sim.request_));
  sim.profile_ = profile;
  // The planner's cost model, timed at the profile's rates.
  const CostModel timed(request.cost_model.options(), profile.rates);
  for (const ParamSpec& p : request.parameters) {
    sim.update_s_.push_back(WorkOf(timed, p).seconds);
  }
  return sim;
}

absl::StatusOr<StepSimulation> StepSimulator::Simulate(
    const Plan& plan, const SimOptions& options) const {
  const Context& ctx = *context_;
  if (plan.param_names.size() != ctx.items.size() || plan.layout.pp != ctx.P ||
      plan.layout.dp != ctx.D || plan.layout.tp != ctx.T ||
      plan.shard_group_size != ctx.R ||
      plan.buckets.size() != ctx.buckets.size() ||
      plan.per_gpu.size() != static_cast<size_t>(ctx.P) * ctx.R * ctx.T) {
    return absl::InvalidArgumentError(
        "plan: not a plan of the simulator's request (parameters, layout or "
        "shard groups differ)");
  }
  if (!(options.forward_s >= 0) || !(options.backward_s >= 0)) {
    return absl::InvalidArgumentError(
        "forward and backward times must be >= 0");
  }
  return Run(ctx, profile_, update_s_, plan, options).Simulate();
}

}  // namespace canzona::plan::sim
