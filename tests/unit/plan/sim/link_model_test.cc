#include "server/plan/sim/link_model.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace canzona::plan::sim {
namespace {

// launch 10 us, hop 2 us, 1 GB/s per rank: easy numbers.
Link Simple() {
  Link link;
  link.launch_s = 10e-6;
  link.hop_s = 2e-6;
  link.bytes_per_s = link.rank_bytes_per_s = 1e9;
  return link;
}

TEST(LinkModelTest, RingReduceScatterIsAlphaBeta) {
  // n - 1 hops and (n - 1) chunks per rank over the link.
  EXPECT_DOUBLE_EQ(NcclRingReduceScatter(Simple(), 4, 1e6),
                   10e-6 + 3 * 2e-6 + 3 * 1e6 / 1e9);
  EXPECT_DOUBLE_EQ(NcclRingAllGather(Simple(), 4, 1e6),
                   NcclRingReduceScatter(Simple(), 4, 1e6));
  EXPECT_EQ(NcclRingReduceScatter(Simple(), 1, 1e6), 0);
}

TEST(LinkModelTest, AllReducePicksRingOrTree) {
  const Link link = Simple();
  // Ring: 2(n-1) hops, 2 (n-1)/n of the buffer; tree: 2 log2 n hops, twice
  // the buffer.
  EXPECT_DOUBLE_EQ(NcclRingAllReduce(link, 8, 8e6),
                   10e-6 + 14 * 2e-6 + 2.0 * 7 / 8 * 8e6 / 1e9);
  EXPECT_DOUBLE_EQ(NcclTreeAllReduce(link, 8, 8e6),
                   10e-6 + 6 * 2e-6 + 2 * 8e6 / 1e9);
  // Large buffer: the ring moves less; tiny buffer on many ranks: the tree
  // has fewer hops.
  EXPECT_DOUBLE_EQ(NcclAllReduce(link, 8, 8e6),
                   NcclRingAllReduce(link, 8, 8e6));
  EXPECT_DOUBLE_EQ(NcclAllReduce(link, 256, 8),
                   NcclTreeAllReduce(link, 256, 8));
  EXPECT_LT(NcclTreeAllReduce(link, 256, 8), NcclRingAllReduce(link, 256, 8));
}

TEST(LinkModelTest, PerRootWinsForOneNonzeroSlice) {
  // One owner: per-root is one reduce of the whole bucket; padding would
  // move three empty slices' worth.
  const UnevenTime t = NcclReduceScatterV(Simple(), {1000000, 0, 0, 0}, 4);
  const double call = 10e-6 + 3 * 2e-6;
  EXPECT_DOUBLE_EQ(t.per_root_s, call + 4e6 / 1e9);
  EXPECT_DOUBLE_EQ(t.padded_s, call + 3 * 4e6 / 1e9);
  EXPECT_EQ(t.cost_model_choice, NcclUneven::kPerRoot);
  EXPECT_EQ(t.measured_choice, NcclUneven::kPerRoot);
  EXPECT_DOUBLE_EQ(t.seconds, t.per_root_s);
}

TEST(LinkModelTest, PaddedWinsForEvenSlices) {
  const UnevenTime t =
      NcclReduceScatterV(Simple(), {1000, 1000, 1000, 1000}, 4);
  EXPECT_LT(t.padded_s, t.per_root_s);
  EXPECT_EQ(t.cost_model_choice, NcclUneven::kPadded);
  EXPECT_EQ(t.measured_choice, NcclUneven::kPadded);
  EXPECT_DOUBLE_EQ(t.seconds, t.padded_s);
}

TEST(LinkModelTest, FirstStepCostModelCanDifferFromTheMeasuredChoice) {
  // ChooseUneven prices padding as N * max slices, the ring moves (N-1) *
  // max: with one slice short by delta, 3 calls of 16 us saved cost
  // delta * 4 B of padding. delta = 20000 elements: 80 us of padding > 48
  // us saved, so step 1 runs per-root; but the ring's padded
  // reduce-scatter moves less than per-root's full bucket, so the
  // measured steps keep padded.
  const UnevenTime t =
      NcclReduceScatterV(Simple(), {100000, 100000, 100000, 80000}, 4);
  EXPECT_EQ(t.cost_model_choice, NcclUneven::kPerRoot);
  EXPECT_EQ(t.measured_choice, NcclUneven::kPadded);
  EXPECT_LT(t.padded_s, t.per_root_s);
}

TEST(LinkModelTest, ElementBytesScaleTheTraffic) {
  const UnevenTime fp32 = NcclAllGatherV(Simple(), {1000000, 0}, 4);
  const UnevenTime bf16 = NcclAllGatherV(Simple(), {1000000, 0}, 2);
  const double call = 10e-6 + 2e-6;
  EXPECT_DOUBLE_EQ(fp32.per_root_s - call, 2 * (bf16.per_root_s - call));
}

TEST(LinkModelTest, FlowRoundTakesTheTightestCap) {
  Link link = Simple();
  // Both ways, 1 MB each: per rank 1 ms.
  const Flows both = {{0, 1e6}, {1e6, 0}};
  EXPECT_DOUBLE_EQ(FlowRound(link, both), 2e-6 + 1e-3);
  // A pair that carries 1.5 GB/s both ways together: 2 MB / 1.5 GB/s.
  link.pair_bytes_per_s = 1.5e9;
  EXPECT_DOUBLE_EQ(FlowRound(link, both), 2e-6 + 2e6 / 1.5e9);
  // One way only: the rank's own rate binds again.
  const Flows one = {{0, 1e6}, {0, 0}};
  EXPECT_DOUBLE_EQ(FlowRound(link, one), 2e-6 + 1e-3);
  // A node cap of 1 GB/s for all flows.
  link.node_bytes_per_s = 1e9;
  EXPECT_DOUBLE_EQ(FlowRound(link, both), 2e-6 + 2e6 / 1e9);
}

TEST(LinkModelTest, MakeLinkSharesTheNodeCap) {
  HardwareProfile profile;
  profile.collective_launch_us = 10;
  LinkTier tier;
  tier.latency_us = 2;
  tier.bandwidth_gbps = 4;
  tier.aggregate_gbps = 4;
  // A group of 2 of the node's 4 busy ranks gets half the node's cap; a
  // rank's fair share of it is 1 GB/s.
  const Link link = MakeLink(profile, tier, 2, 4);
  EXPECT_DOUBLE_EQ(link.node_bytes_per_s, 2e9);
  EXPECT_DOUBLE_EQ(link.rank_bytes_per_s, 1e9);
  EXPECT_DOUBLE_EQ(link.bytes_per_s, 4e9);
  EXPECT_DOUBLE_EQ(link.launch_s, 10e-6);
  EXPECT_DOUBLE_EQ(link.hop_s, 2e-6);
  tier.aggregate_gbps = 0;
  EXPECT_DOUBLE_EQ(MakeLink(profile, tier, 2, 4).rank_bytes_per_s, 4e9);
}

TEST(LinkModelTest, BackgroundThreadsSlowACpuBoundTier) {
  HardwareProfile profile;
  profile.collective_launch_us = 10;
  profile.compute_units_per_node = 2;
  profile.background_threads = 2;
  LinkTier tier;
  tier.latency_us = 2;
  tier.bandwidth_gbps = 4;
  // 4 ranks + 2 other threads on 2 units, against the 4 ranks calibrated:
  // 6 / 4 slower.
  tier.cpu_bound = true;
  const Link loopback = MakeLink(profile, tier, 4, 4);
  EXPECT_DOUBLE_EQ(loopback.bytes_per_s, 4e9 / 1.5);
  EXPECT_DOUBLE_EQ(loopback.hop_s, 2e-6 * 1.5);
  // A NIC or NVLink does not care.
  tier.cpu_bound = false;
  EXPECT_DOUBLE_EQ(MakeLink(profile, tier, 4, 4).bytes_per_s, 4e9);
}

TEST(LinkModelTest, GlooAllGatherIsARing) {
  Link link = Simple();
  // Two ranks, only rank 0 holds data: one round moving its slice.
  EXPECT_DOUBLE_EQ(GlooAllGatherV(link, {1000, 0}, 4), 10e-6 + 2e-6 + 4e-6);
  // Four ranks, one slice of 1000: it travels three rounds, each bound by
  // that slice.
  EXPECT_DOUBLE_EQ(GlooAllGatherV(link, {1000, 0, 0, 0}, 4),
                   10e-6 + 3 * (2e-6 + 4e-6));
}

TEST(LinkModelTest, GlooReduceScatterIsAnAllToAllAndASum) {
  Link link = Simple();
  // Rank 1 receives 3 copies of its 1000-element slice (12 kB) and sums 4
  // copies into one (5 x 4 kB at 1 GB/s).
  const double t = GlooReduceScatterV(link, {0, 1000, 0, 0}, 4, 1e9);
  EXPECT_DOUBLE_EQ(t, 10e-6 + 2e-6 + 12e3 / 1e9 + 5 * 4e3 / 1e9);
}

}  // namespace
}  // namespace canzona::plan::sim
