#include "server/plan/sim/dp_collectives.h"

#include <algorithm>
#include <vector>

namespace canzona::plan::sim::internal {

std::vector<int64_t> DpCollectives::Counts(int b) const {
  const BucketPlan& bucket = in_.plan.buckets[b];
  const std::vector<int64_t>& off = in_.ctx.offsets[b];
  std::vector<int64_t> counts(in_.ctx.R);
  for (int d = 0; d < in_.ctx.R; ++d) {
    counts[d] = in_.sliced ? off[bucket.cuts[d + 1]] - off[bucket.cuts[d]]
                           : bucket.elements / in_.ctx.R +
                                 (d < bucket.elements % in_.ctx.R ? 1 : 0);
  }
  return counts;
}

void DpCollectives::ReduceBuckets() {
  const int R = in_.ctx.R, T = in_.ctx.T, G = in_.ctx.D / in_.ctx.R;
  buckets_.resize(in_.plan.buckets.size());
  for (size_t b = 0; b < in_.plan.buckets.size(); ++b) {
    const BucketPlan& bucket = in_.plan.buckets[b];
    const int s = bucket.stage;
    const std::vector<int64_t> counts = Counts(static_cast<int>(b));
    const int eb = ElemBytes(bucket.params.front());
    BucketSimulation& out = buckets_[b];
    out.stage = s;
    out.elements = bucket.elements;
    out.slice_imbalance = b < in_.plan.bucket_slice_imbalance.size()
                              ? in_.plan.bucket_slice_imbalance[b]
                              : 1.0;
    for (int t = 0; t < T; ++t) {
      std::vector<int> group;
      for (int d = 0; d < R; ++d) group.push_back(gpus_.At(s, d, t).rank);
      const Link link = in_.LinkOf(group);
      double collective = 0;
      if (R > 1) {
        const double memory = in_.memory_bps / gpus_.At(s, 0, t).slowdown;
        if (in_.profile.comm == CommPlane::kNccl) {
          const UnevenTime rs = NcclReduceScatterV(link, counts, eb);
          collective = rs.seconds;
          if (!in_.sliced) {
            collective += NcclAllGatherV(link, counts, eb).seconds;
          }
          if (t == 0) {
            out.reduce = rs;
            out.algorithm = in_.sliced ? NcclUnevenName(rs.measured_choice)
                                       : "reduce_scatter+all_gather";
          }
        } else {
          collective = GlooReduceScatterV(link, counts, eb, memory);
          if (!in_.sliced) collective += GlooAllGatherV(link, counts, eb);
          if (t == 0) {
            out.algorithm = in_.sliced ? "alltoallv" : "alltoallv+allgatherv";
          }
        }
      }
      // The trainer's gradients (and fp32 parameters) into staging.
      const double arrays = eb == 4 ? 2 : 1;
      double start = 0;
      std::vector<double> before(R);
      for (int d = 0; d < R; ++d) {
        GpuState& g = gpus_.At(s, d, t);
        before[d] = g.dp_lane;
        const double copy =
            gpus_.Copy(g, arrays * bucket.elements * (eb + kStagingBytes) / 2);
        AddSegment(g.out, Lane::kDp, "reduce_scatter", g.dp_lane,
                   g.dp_lane + copy);
        g.dp_lane += copy;
        start = std::max(start, g.dp_lane);
      }
      const double end = start + collective;
      double cross_max = 0;
      for (int d = 0; d < R; ++d) {
        GpuState& g = gpus_.At(s, d, t);
        const double mine =
            in_.sliced ? gpus_.Copy(g, counts[d] * kStagingBytes) : 0;
        double cross = 0;
        if (G > 1 && counts[d] > 0) {
          std::vector<int> across;
          for (int k = 0; k < G; ++k) {
            across.push_back(in_.place.GlobalRank(s, d + k * R, t));
          }
          cross = AllReduce(in_.profile.comm, in_.LinkOf(across), G,
                            static_cast<double>(counts[d]) * eb);
        }
        cross_max = std::max(cross_max, cross);
        AddSegment(g.out, Lane::kDp, "reduce_scatter", g.dp_lane, end + mine);
        AddSegment(g.out, Lane::kDp, "cross_all_reduce", end + mine,
                   end + mine + cross);
        g.dp_lane = end + mine + cross;
        g.reduce_b.push_back(g.dp_lane - before[d]);
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
    g.reduced_at = g.dp_lane;
    const int64_t scaled =
        in_.sliced ? OwnedSlices(g) : static_cast<int64_t>(g.stage_elements);
    const double scale = gpus_.Copy(g, scaled * kStagingBytes);
    AddSegment(g.out, Lane::kWorker, "reduce_scatter", 0, g.dp_lane + scale);
    g.worker = g.dp_lane + scale;
    g.out.phases.reduce_scatter = g.worker;
  }
}

int64_t DpCollectives::OwnedSlices(const GpuState& g) const {
  int64_t owned = 0;
  for (size_t b = 0; b < in_.plan.buckets.size(); ++b) {
    if (in_.plan.buckets[b].stage != g.out.stage) continue;
    owned += Counts(static_cast<int>(b))[g.out.dp];
  }
  return owned;
}

void DpCollectives::GatherBuckets() {
  const int R = in_.ctx.R, T = in_.ctx.T;
  for (GpuState& g : gpus_) {
    g.dp_lane = std::max(g.dp_lane, g.worker);
    g.gathers_from = g.dp_lane;
  }
  for (int s = 0; s < in_.ctx.P; ++s) {
    const std::vector<int>& order = in_.ctx.stage_buckets[s];
    bool first = true;
    for (auto it = order.rbegin(); it != order.rend(); ++it, first = false) {
      const int b = *it;
      const BucketPlan& bucket = in_.plan.buckets[b];
      const std::vector<int64_t> counts = Counts(b);
      const int eb = ElemBytes(bucket.params.front());
      for (int t = 0; t < T; ++t) {
        std::vector<int> group;
        double start = 0;
        for (int d = 0; d < R; ++d) {
          group.push_back(gpus_.At(s, d, t).rank);
          start = std::max(start, gpus_.At(s, d, t).dp_lane);
        }
        const Link link = in_.LinkOf(group);
        double collective = 0;
        if (R > 1 && in_.sliced) {
          if (in_.profile.comm == CommPlane::kNccl) {
            const UnevenTime ag = NcclAllGatherV(link, counts, eb);
            collective = ag.seconds;
            if (t == 0) buckets_[b].gather = ag;
          } else {
            collective = GlooAllGatherV(link, counts, eb);
          }
        } else if (R > 1 && first &&
                   in_.plan.strategy == Strategy::kLayerwise) {
          collective = LayerwiseGather(s, t, link);
        }
        if (t == 0) buckets_[b].gather_s = collective;
        for (int d = 0; d < R; ++d) {
          GpuState& g = gpus_.At(s, d, t);
          const double copy =
              gpus_.Copy(g, bucket.elements * (eb + kStagingBytes) / 2);
          const double end = start + collective + copy;
          AddSegment(g.out, Lane::kDp, "all_gather", g.dp_lane, end);
          g.gather_b.push_back(end - g.dp_lane);
          g.dp_lane = end;
        }
      }
    }
  }
  for (GpuState& g : gpus_) {
    AddSegment(g.out, Lane::kWorker, "all_gather", g.worker, g.dp_lane);
    g.out.phases.all_gather = g.dp_lane - g.worker;
    g.out.phases.total = g.dp_lane;
  }
}

double DpCollectives::LayerwiseGather(int s, int t, const Link& link) {
  std::vector<int64_t> counts(in_.ctx.R, 0);
  int64_t total = 0;
  for (int i : in_.ctx.stage_params[s]) {
    counts[in_.plan.dp_owner[i]] += in_.ctx.items[i].fragment_numel;
    total += in_.ctx.items[i].fragment_numel;
  }
  const int eb = ElemBytes(in_.ctx.stage_params[s].front());
  const GpuState& g = gpus_.At(s, 0, t);
  const double exchange = in_.profile.comm == CommPlane::kNccl
                              ? NcclAllGatherV(link, counts, eb).seconds
                              : GlooAllGatherV(link, counts, eb);
  return exchange + gpus_.Copy(g, total * kStagingBytes) +
         gpus_.Copy(g, *std::max_element(counts.begin(), counts.end()) *
                           kStagingBytes);
}
}  // namespace canzona::plan::sim::internal
