#include "server/plan/sim/link_model.h"

#include <algorithm>
#include <cmath>

#include "absl/types/span.h"

namespace canzona::plan::sim {
namespace {

struct CountStats {
  int nonzero = 0;
  double max = 0;
  double total = 0;
};

CountStats Stats(const std::vector<int64_t>& counts) {
  CountStats s;
  for (int64_t c : counts) {
    if (c > 0) ++s.nonzero;
    s.max = std::max(s.max, static_cast<double>(c));
    s.total += static_cast<double>(c);
  }
  return s;
}

// One ring collective's fixed cost over n ranks: the call and its n-1 hops.
double RingLatency(const Link& link, int n) {
  return link.launch_s + (n - 1) * link.hop_s;
}

// Per-root vs padded, both timed; the NCCL cost model's pick (what the
// engine's first step runs) fed the same link: each collective costs its
// call and hops, bytes move at the link's rate (ChooseUneven counts float32
// elements, so the rate is rescaled to this dtype).
UnevenTime Uneven(const Link& link, const std::vector<int64_t>& counts,
                  int elem_bytes) {
  UnevenTime t;
  const int n = static_cast<int>(counts.size());
  const CountStats s = Stats(counts);
  if (n <= 1 || s.total == 0) return t;
  const double per_call = RingLatency(link, n);
  t.per_root_s =
      s.nonzero * per_call + s.total * elem_bytes / link.rank_bytes_per_s;
  t.padded_s = per_call + (n - 1) * s.max * elem_bytes / link.rank_bytes_per_s;
  NcclCostModel cost;
  cost.launch_us = per_call * 1e6;
  cost.bytes_per_us = link.rank_bytes_per_s / 1e6 * 4.0 / elem_bytes;
  t.cost_model_choice = ChooseUneven(absl::MakeConstSpan(counts), cost);
  t.measured_choice =
      t.padded_s < t.per_root_s ? NcclUneven::kPadded : NcclUneven::kPerRoot;
  t.seconds = std::min(t.per_root_s, t.padded_s);
  return t;
}

}  // namespace

Link MakeLink(const HardwareProfile& profile, const LinkTier& tier,
              int group_ranks, int node_ranks) {
  double slower = 1;
  if (tier.cpu_bound && profile.background_threads > 0) {
    const double units = std::max(profile.compute_units_per_node, 1);
    slower = std::max(units, node_ranks + profile.background_threads) /
             std::max(units, static_cast<double>(node_ranks));
  }
  Link link;
  link.launch_s = profile.collective_launch_us * 1e-6 * slower;
  link.hop_s = tier.latency_us * 1e-6 * slower;
  link.bytes_per_s = tier.bandwidth_gbps * 1e9 / slower;
  link.rank_bytes_per_s = link.bytes_per_s;
  link.pair_bytes_per_s = tier.pair_gbps * 1e9 / slower;
  if (tier.aggregate_gbps > 0) {
    const double share = static_cast<double>(std::max(group_ranks, 1)) /
                         std::max(node_ranks, std::max(group_ranks, 1));
    link.node_bytes_per_s = tier.aggregate_gbps * 1e9 * share / slower;
    link.rank_bytes_per_s =
        std::min(link.rank_bytes_per_s,
                 link.node_bytes_per_s / std::max(group_ranks, 1));
  }
  return link;
}

double FlowRound(const Link& link, const Flows& flows) {
  const size_t n = flows.size();
  double longest = 0, total = 0;
  std::vector<double> recv(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    double sent = 0;
    for (size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      sent += flows[i][j];
      recv[j] += flows[i][j];
      if (link.pair_bytes_per_s > 0 && j > i) {
        longest = std::max(longest,
                           (flows[i][j] + flows[j][i]) / link.pair_bytes_per_s);
      }
    }
    total += sent;
    longest = std::max(longest, sent / link.bytes_per_s);
  }
  for (double r : recv) longest = std::max(longest, r / link.bytes_per_s);
  if (link.node_bytes_per_s > 0) {
    longest = std::max(longest, total / link.node_bytes_per_s);
  }
  return link.hop_s + longest;
}

double NcclRingReduceScatter(const Link& link, int n, double chunk_bytes) {
  if (n <= 1) return 0;
  return RingLatency(link, n) + (n - 1) * chunk_bytes / link.rank_bytes_per_s;
}

double NcclRingAllGather(const Link& link, int n, double chunk_bytes) {
  return NcclRingReduceScatter(link, n, chunk_bytes);
}

double NcclRingAllReduce(const Link& link, int n, double bytes) {
  if (n <= 1) return 0;
  return link.launch_s + 2.0 * (n - 1) * link.hop_s +
         2.0 * (n - 1) / n * bytes / link.rank_bytes_per_s;
}

double NcclTreeAllReduce(const Link& link, int n, double bytes) {
  if (n <= 1) return 0;
  const double depth = std::ceil(std::log2(static_cast<double>(n)));
  return link.launch_s + 2.0 * depth * link.hop_s +
         2.0 * bytes / link.rank_bytes_per_s;
}

double NcclAllReduce(const Link& link, int n, double bytes) {
  return std::min(NcclRingAllReduce(link, n, bytes),
                  NcclTreeAllReduce(link, n, bytes));
}

UnevenTime NcclReduceScatterV(const Link& link,
                              const std::vector<int64_t>& counts,
                              int elem_bytes) {
  return Uneven(link, counts, elem_bytes);
}

UnevenTime NcclAllGatherV(const Link& link, const std::vector<int64_t>& counts,
                          int elem_bytes) {
  // ncclBroadcast per root mirrors ncclReduce per root; padded all-gather
  // mirrors the padded reduce-scatter: the same two costs.
  return Uneven(link, counts, elem_bytes);
}

double GlooReduceScatterV(const Link& link, const std::vector<int64_t>& counts,
                          int elem_bytes, double memory_bps) {
  const int n = static_cast<int>(counts.size());
  const CountStats s = Stats(counts);
  if (n <= 1 || s.total == 0) return 0;
  // Rank i sends slice j to rank j.
  Flows flows(n, std::vector<double>(n, 0.0));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i != j) flows[i][j] = static_cast<double>(counts[j]) * elem_bytes;
    }
  }
  // Summing n copies of the largest slice into one: read n, write one.
  const double sum_bytes = (n + 1) * s.max * elem_bytes;
  return AllToAllV(link, flows) + sum_bytes / memory_bps;
}

double GlooAllGatherV(const Link& link, const std::vector<int64_t>& counts,
                      int elem_bytes) {
  const int n = static_cast<int>(counts.size());
  const CountStats s = Stats(counts);
  if (n <= 1 || s.total == 0) return 0;
  double t = link.launch_s;
  for (int k = 0; k < n - 1; ++k) {
    Flows flows(n, std::vector<double>(n, 0.0));
    for (int i = 0; i < n; ++i) {
      flows[i][(i + 1) % n] =
          static_cast<double>(counts[((i - k) % n + n) % n]) * elem_bytes;
    }
    t += FlowRound(link, flows);
  }
  return t;
}

double GlooAllReduce(const Link& link, int n, double bytes) {
  if (n <= 1) return 0;
  Flows flows(n, std::vector<double>(n, 0.0));
  for (int i = 0; i < n; ++i) flows[i][(i + 1) % n] = bytes / n;
  return link.launch_s + 2.0 * (n - 1) * FlowRound(link, flows);
}

double AllToAllV(const Link& link, const Flows& flows) {
  if (flows.size() <= 1) return 0;
  return link.launch_s + FlowRound(link, flows);
}

double AllReduce(CommPlane plane, const Link& link, int n, double bytes) {
  return plane == CommPlane::kNccl ? NcclAllReduce(link, n, bytes)
                                   : GlooAllReduce(link, n, bytes);
}

}  // namespace canzona::plan::sim
