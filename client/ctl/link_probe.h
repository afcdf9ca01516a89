// LinkProbe: times the data plane's own collectives (Gloo over TCP, the
// daemon's default) between ranks that are threads of this process, to
// calibrate the step simulator's loopback link (hardware_profile.h) the way
// the engine will use it: per-call cost, per-hop latency, per-rank and
// node-wide bandwidth.
//
//   CANZONA_ASSIGN_OR_RETURN(LoopbackLink link, MeasureLoopback(options));
//
// Thread-safety: MeasureLoopback is self-contained (it starts and joins its
// own rank threads).
#ifndef CANZONA_CLIENT_CTL_LINK_PROBE_H_
#define CANZONA_CLIENT_CTL_LINK_PROBE_H_

#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace canzona::ctl {

struct LoopbackOptions {
  std::string host = "127.0.0.1";  // the address Gloo binds (--comm-host)
  int ranks = 4;                   // >= 3: the latency fit needs 2 and n
  double min_time = 0.5;           // seconds per measurement
  int64_t large_bytes = 32 << 20;  // a rank's bytes in the bandwidth runs
};

struct LoopbackLink {
  double launch_us = 0;       // per collective call
  double hop_us = 0;          // per ring step
  double bandwidth_gbps = 0;  // one rank sending to one other
  double pair_gbps = 0;       // one pair, both ways at once (0: no cap)
  double aggregate_gbps = 0;  // every rank sending at once (0: no cap)
  nlohmann::json raw;         // the times behind the fit
};

// Every figure is the fastest of its repeated runs: the machine without
// interference. Fit (link_model.h): a 1-float all-gather-v over 2 and n ranks
// costs launch + hop and launch + (n-1) hop; B bytes from one rank to another
// cost launch + hop + B / bandwidth; both ways at once, 2 B over the pair's
// cap when that is slower; n ranks each sending B to the n-1 others, n B
// over the node's cap when that is slower still.
absl::StatusOr<LoopbackLink> MeasureLoopback(const LoopbackOptions& options);

// Bytes read + written per second by one thread's memcpy of large buffers
// (the fastest of its runs).
double MeasureMemoryBandwidth(double min_time);

}  // namespace canzona::ctl

#endif  // CANZONA_CLIENT_CTL_LINK_PROBE_H_
