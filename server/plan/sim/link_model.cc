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
  t.per_root_s = s.nonzero * per_call + s.total * elem_bytes / link.bytes_per_s;
  t.padded_s = per_call + (n - 1) * s.max * elem_bytes / link.bytes_per_s;
  NcclCostModel cost;
  cost.launch_us = per_call * 1e6;
  cost.bytes_per_us = link.bytes_per_s / 1e6 * 4.0 / elem_bytes;
  t.cost_model_choice = ChooseUneven(absl::MakeConstSpan(counts), cost);
  t.measured_choice =
      t.padded_s < t.per_root_s ? NcclUneven::kPadded : NcclUneven::kPerRoot;
  t.seconds = std::min(t.per_root_s, t.padded_s);
  return t;
}

}  // namespace

Link MakeLink(const HardwareProfile& profile, const LinkTier& tier,
              int node_streams) {
  Link link;
  link.launch_s = profile.collective_launch_us * 1e-6;
  link.hop_s = tier.latency_us * 1e-6;
  double gbps = tier.bandwidth_gbps;
  if (tier.aggregate_gbps > 0 && node_streams > 0) {
    gbps = std::min(gbps, tier.aggregate_gbps / node_streams);
  }
  link.bytes_per_s = gbps * 1e9;
  return link;
}

double NcclRingReduceScatter(const Link& link, int n, double chunk_bytes) {
  if (n <= 1) return 0;
  return RingLatency(link, n) + (n - 1) * chunk_bytes / link.bytes_per_s;
}

double NcclRingAllGather(const Link& link, int n, double chunk_bytes) {
  return NcclRingReduceScatter(link, n, chunk_bytes);
}

double NcclRingAllReduce(const Link& link, int n, double bytes) {
  if (n <= 1) return 0;
  return link.launch_s + 2.0 * (n - 1) * link.hop_s +
         2.0 * (n - 1) / n * bytes / link.bytes_per_s;
}

double NcclTreeAllReduce(const Link& link, int n, double bytes) {
  if (n <= 1) return 0;
  const double depth = std::ceil(std::log2(static_cast<double>(n)));
  return link.launch_s + 2.0 * depth * link.hop_s +
         2.0 * bytes / link.bytes_per_s;
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
  // Rank r sends everything but its slice and receives n-1 copies of it.
  double busiest = 0;
  for (int64_t c : counts) {
    const double mine = static_cast<double>(c);
    busiest = std::max(busiest, std::max(s.total - mine, (n - 1) * mine));
  }
  // Summing n copies of the largest slice into one: read n, write one.
  const double sum_bytes = (n + 1) * s.max * elem_bytes;
  return AllToAllV(link, n, busiest * elem_bytes) + sum_bytes / memory_bps;
}

double GlooAllGatherV(const Link& link, const std::vector<int64_t>& counts,
                      int elem_bytes) {
  const int n = static_cast<int>(counts.size());
  const CountStats s = Stats(counts);
  if (n <= 1 || s.total == 0) return 0;
  return link.launch_s +
         (n - 1) * (link.hop_s + s.max * elem_bytes / link.bytes_per_s);
}

double GlooAllReduce(const Link& link, int n, double bytes) {
  if (n <= 1) return 0;
  return link.launch_s +
         2.0 * (n - 1) * (link.hop_s + bytes / n / link.bytes_per_s);
}

double AllToAllV(const Link& link, int n, double max_bytes) {
  if (n <= 1) return 0;
  return link.launch_s + link.hop_s + max_bytes / link.bytes_per_s;
}

double AllReduce(CommPlane plane, const Link& link, int n, double bytes) {
  return plane == CommPlane::kNccl ? NcclAllReduce(link, n, bytes)
                                   : GlooAllReduce(link, n, bytes);
}

}  // namespace canzona::plan::sim
