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
//   Gloo (gloo_communicator.cc, Gloo's algorithms):
//     reduce-scatter-v: an all-to-all-v (rank r receives n-1 copies of its
//                       slice) plus the summation, at memory bandwidth;
//     all-gather-v:     Gloo's ring, n-1 steps each moving the largest
//                       slice: launch + (n-1) (hop + max(counts) / bw);
//     all-reduce:       Gloo's ring, 2(n-1) steps of s/n:
//                       launch + 2(n-1) (hop + s / (n bw));
//     all-to-all-v:     as NCCL's.
//
// `Link` is one tier of a HardwareProfile seen by one collective: the
// slowest tier its group spans, with the bandwidth shared fairly among the
// ranks of a node that move bytes at once when the tier has a node-wide
// cap (a loopback "link" is the CPU of the machine).
//
// Thread-safety: pure functions.
#ifndef CANZONA_SERVER_PLAN_SIM_LINK_MODEL_H_
#define CANZONA_SERVER_PLAN_SIM_LINK_MODEL_H_

#include <cstdint>
#include <vector>

#include "server/comm/nccl_communicator.h"
#include "server/plan/sim/hardware_profile.h"

namespace canzona::plan::sim {

struct Link {
  double launch_s = 0;
  double hop_s = 0;
  double bytes_per_s = 1;
};

// The link a collective sees on `tier` when `node_streams` ranks of its
// busiest node move bytes on that tier at once.
Link MakeLink(const HardwareProfile& profile, const LinkTier& tier,
              int node_streams);

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

// Either plane: an all-to-all-v whose busiest rank sends or receives
// `max_bytes` (0 bytes: the call still synchronizes).
double AllToAllV(const Link& link, int n, double max_bytes);

// The plane's even all-reduce (NcclAllReduce or GlooAllReduce).
double AllReduce(CommPlane plane, const Link& link, int n, double bytes);

}  // namespace canzona::plan::sim

#endif  // CANZONA_SERVER_PLAN_SIM_LINK_MODEL_H_
