// Alpha-beta times of the collectives the step runs, per data plane.
//
// A collective over n ranks on a link with per-call cost `launch`, per-hop
// latency `hop` and per-rank bandwidth `bw` (bytes/s, one direction):
//
//   NCCL (what NCCL's ring and tree algorithms move per rank):
//     ring reduce-scatter / all-gather of c bytes per rank:
//                       launch + (n-1) hop + (n-1) c / bw
//     ring all-reduce of s bytes:  launch + 2(n-1) hop + 2 (n-1)/n s / bw
//     tree all-reduce (double binary tree, reduce up + broadcast down):
//                       launch + 2 ceil(log2 n) hop + 2 s / bw
//     all-reduce:       the faster of ring and tree (NCCL's tuner picks by
//                       size the same way);
//     uneven reduce-scatter-v / all-gather-v (nccl_communicator.h):
//       per-root: P grouped ncclReduce / ncclBroadcast (P nonzero slices),
//                 each paying launch + (n-1) hop, moving sum(counts) / bw;
//       padded:   one ring collective of max(counts) per rank.
//     The engine's first step picks with ChooseUneven (the NCCL cost model,
//     fed this link); from its third step it keeps the way it measured
//     faster, which here is the faster modelled time.
//     all-to-all-v:     launch + hop + max(bytes sent, received) / bw.
//   Gloo (gloo_communicator.cc, Gloo's algorithms), as rounds of flows
//   (bytes from rank i to rank j, all of a round's flows at once):
//     reduce-scatter-v: one all-to-all-v round (rank r receives the n-1
//                       copies of its slice), then the summation at memory
//                       bandwidth;
//     all-gather-v:     Gloo's ring: n-1 rounds, in round k rank i sends
//                       slice (i - k) mod n to rank i + 1;
//     all-reduce:       Gloo's ring: 2(n-1) rounds of s/n to the right.
//   all-to-all-v (either plane): one round of the caller's flows.
//   A round costs hop + the longest of: a rank's bytes sent or received
//   over the per-rank bandwidth; a pair's bytes (both directions) over the
//   pair bandwidth; all bytes over the group's share of the node-wide cap
//   (the caps a loopback link has: one TCP connection per pair, and the
//   CPU of the machine); a collective adds its launch.
//
// `Link` is one tier of a HardwareProfile seen by one collective: the
// slowest tier its group spans, with the node-wide cap shared among the
// ranks of the node that move bytes at once.
//
// Thread-safety: pure functions.
#ifndef CANZONA_SERVER_PLAN_SIM_LINK_MODEL_H_
#define CANZONA_SERVER_PLAN_SIM_LINK_MODEL_H_

#include <cstdint>
#include <vector>

#include "server/comm/nccl_uneven.h"
#include "server/plan/sim/hardware_profile.h"

namespace canzona::plan::sim {

struct Link {
  double launch_s = 0;
  double hop_s = 0;
  double bytes_per_s = 1;       // per rank, one direction
  double pair_bytes_per_s = 0;  // one pair, both directions; 0: no cap
  double node_bytes_per_s = 0;  // all of the group's flows; 0: no cap
  // What the closed-form (NCCL) times use: the per-rank rate capped by the
  // rank's fair share of the node-wide cap.
  double rank_bytes_per_s = 1;
};

// The link a collective of `group_ranks` ranks sees on `tier` when
// `node_ranks` ranks of its busiest node move bytes on that tier at once
// (it gets group_ranks / node_ranks of the node-wide cap). A cpu_bound
// tier with background threads runs slower by the share of the units they
// take beyond what the node's own ranks (as calibrated) leave:
// max(units, node_ranks + background) / max(units, node_ranks).
Link MakeLink(const HardwareProfile& profile, const LinkTier& tier,
              int group_ranks, int node_ranks);

// Bytes from rank i to rank j of a group in one round: flows[i][j].
using Flows = std::vector<std::vector<double>>;

// hop + the longest of the round's per-rank, per-pair and node-wide times.
double FlowRound(const Link& link, const Flows& flows);

// How an uneven collective was (or would be) run, with both ways' times.
struct UnevenTime {
  double per_root_s = 0;
  double padded_s = 0;
  NcclUneven cost_model_choice = NcclUneven::kPerRoot;  // ChooseUneven
  NcclUneven measured_choice = NcclUneven::kPerRoot;    // the faster
  double seconds = 0;  // the measured choice's time (steady state)
};

// NCCL algorithms. Sizes in bytes; `counts` in elements of `elem_bytes`.
double NcclRingReduceScatter(const Link& link, int n, double chunk_bytes);
double NcclRingAllGather(const Link& link, int n, double chunk_bytes);
double NcclRingAllReduce(const Link& link, int n, double bytes);
double NcclTreeAllReduce(const Link& link, int n, double bytes);
double NcclAllReduce(const Link& link, int n, double bytes);
UnevenTime NcclReduceScatterV(const Link& link,
                              const std::vector<int64_t>& counts,
                              int elem_bytes);
UnevenTime NcclAllGatherV(const Link& link, const std::vector<int64_t>& counts,
                          int elem_bytes);

// Gloo algorithms. The reduce-scatter's summation runs at `memory_bps`
// (bytes read + written per second).
double GlooReduceScatterV(const Link& link, const std::vector<int64_t>& counts,
                          int elem_bytes, double memory_bps);
double GlooAllGatherV(const Link& link, const std::vector<int64_t>& counts,
                      int elem_bytes);
double GlooAllReduce(const Link& link, int n, double bytes);

// Either plane: one all-to-all-v of `flows` (no bytes: the call still
// synchronizes).
double AllToAllV(const Link& link, const Flows& flows);

// The plane's even all-reduce (NcclAllReduce or GlooAllReduce).
double AllReduce(CommPlane plane, const Link& link, int n, double bytes);

}  // namespace canzona::plan::sim

#endif  // CANZONA_SERVER_PLAN_SIM_LINK_MODEL_H_
