// How the NCCL communicator runs a collective with uneven slices (grouped
// per-root calls, or one padded call), and the link cost model it chooses
// by: pure functions of the counts, in a library of their own so that the
// step simulator (server/plan/sim) predicts the same choice without
// linking a communicator.
//
//   NcclUneven how = ChooseUneven(counts, NcclCostModel{});
//
// Thread-safety: pure functions and plain values.
#ifndef CANZONA_SERVER_COMM_NCCL_UNEVEN_H_
#define CANZONA_SERVER_COMM_NCCL_UNEVEN_H_

#include <cstdint>
#include <functional>

#include "absl/types/span.h"

namespace canzona {

// The link as the uneven-count chooser sees it: each collective NCCL runs
// costs `launch_us` of latency (launch + protocol steps; several collectives
// in one group still pay it each) and moves bytes at `bytes_per_us`. Set
// from measurements (e.g. nccl-tests' small- and large-message times) or
// configuration; the defaults are a conservative inter-node link.
struct NcclCostModel {
  double launch_us = 15.0;
  double bytes_per_us = 25000.0;  // 25 GB/s
};

enum class NcclUneven {
  kPerRoot,  // grouped ncclReduce / ncclBroadcast, one per nonzero slice
  kPadded,   // one ncclReduceScatter / ncclAllGather of max(counts) each
};

const char* NcclUnevenName(NcclUneven strategy);

// Chooses how to run a ReduceScatterV / AllGatherV with uneven `counts`
// (float32 elements). With P = number of nonzero counts, M = max(counts),
// N = counts.size() and pad_bytes = 4 * (N * M - sum(counts)):
//
//   kPadded  iff  P >= 2 and pad_bytes / bytes_per_us < (P - 1) * launch_us
//
// i.e. the time the padding moves over the link is less than the latency
// of the P - 1 collectives it saves (per-root costs P * launch + sum * 4 /
// bw, padded costs launch + N * M * 4 / bw). The device-local staging
// copies of the padded plan run at memory bandwidth and are not counted.
// Ties and a non-positive bytes_per_us pick kPerRoot. Pure.
NcclUneven ChooseUneven(absl::Span<const int64_t> counts,
                        const NcclCostModel& cost);

// Per-call strategy for uneven counts (the engine may decide per bucket,
// e.g. from measured times); must return the same on every rank for the
// same counts.
using NcclUnevenChooser =
    std::function<NcclUneven(absl::Span<const int64_t> counts)>;

}  // namespace canzona

#endif  // CANZONA_SERVER_COMM_NCCL_UNEVEN_H_
