// A hardware profile: what the step simulator (step_simulator.h) needs to
// know about a machine to turn a plan into seconds: how ranks sit on nodes,
// how fast their links are (an alpha-beta model per link tier), how fast
// they copy memory, and the kernel rates of the planner's cost model.
//
// Profiles are JSON files (server/plan/sim/profiles/*.json, installed to
// <prefix>/share/canzona/profiles; `canzonactl calibrate` writes one for
// the machine it runs on):
//
//   {
//     "name": "h100-node",
//     "comm": "nccl",                 // collective algorithms: nccl | gloo
//     "ranks_per_node": 8,            // consecutive global ranks per node;
//                                     // 0: every rank on one node
//     "compute_units_per_node": 8,    // ranks that compute at full rate at
//                                     // once (GPUs; CPU cores / BLAS threads)
//     "background_threads": 0,        // optional: other busy threads on a
//                                     // shared machine's units (>= 0)
//     "collective_launch_us": 10,     // fixed cost of every collective call
//     "memory_gbps": 2680,            // bytes read + written per second by
//                                     // staging copies and element-wise passes
//     "intra_node": {"latency_us": 1.5, "bandwidth_gbps": 360,
//                    "pair_gbps": ..., "aggregate_gbps": ...},  // optional
//     "inter_node": {"latency_us": 6, "bandwidth_gbps": 40},
//     "rates": {"gemm_gflops": ..., "ns_gflops": ..., "eigh_gflops": ...,
//               "adamw_gbps": ...},  // the planner's rates (cost_model.h)
//     "description": "...", "sources": [...], "assumptions": [...]
//   }
//
// Bandwidths are GB/s per rank in one direction. Optional caps (absent:
// none): `pair_gbps`, the bytes one pair of ranks moves both ways together
// (a TCP connection), and `aggregate_gbps`, the bytes all ranks of a node
// move at once on that tier (a loopback link is the CPU's, shared by every
// rank); `"cpu_bound": true` says the tier's transfers run on the compute
// units, so `background_threads` (other work on a shared machine) slow them
// as they slow compute. `inter_node` is required unless ranks_per_node is
// 0. Free-text keys (description,
// sources, assumptions) are carried to reports, never interpreted. Every
// number must be positive; a missing or bad field is an INVALID_ARGUMENT
// naming it (e.g. "intra_node.bandwidth_gbps must be positive").
//
// Thread-safety: plain value types and pure functions.
#ifndef CANZONA_SERVER_PLAN_SIM_HARDWARE_PROFILE_H_
#define CANZONA_SERVER_PLAN_SIM_HARDWARE_PROFILE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "server/plan/cost_model.h"

namespace canzona::plan::sim {

// Which library's collective algorithms the data plane runs.
enum class CommPlane { kNccl, kGloo };

const char* CommPlaneName(CommPlane plane);

// One link tier of the alpha-beta model.
struct LinkTier {
  double latency_us = 0;      // one hop (a ring step, one message)
  double bandwidth_gbps = 0;  // per rank, one direction
  double pair_gbps = 0;       // per pair, both directions; 0: no cap
  double aggregate_gbps = 0;  // node-wide cap on this tier; 0: none
  bool cpu_bound = false;     // transfers run on the compute units
};

struct HardwareProfile {
  std::string name;
  std::string description;
  CommPlane comm = CommPlane::kNccl;
  int ranks_per_node = 0;  // 0: one node holds every rank
  int compute_units_per_node = 1;
  double background_threads = 0;  // other work sharing the units
  double collective_launch_us = 0;
  double memory_gbps = 0;
  LinkTier intra_node;
  LinkTier inter_node;  // unused when ranks_per_node == 0
  Rates rates;
  // description, sources, assumptions and any other free-text keys.
  nlohmann::json notes = nlohmann::json::object();
};

// Parses a profile document; `where` prefixes nothing (the caller names
// the file). Errors name the field.
absl::StatusOr<HardwareProfile> ParseHardwareProfile(
    const nlohmann::json& json);

// `name_or_path` is a path when it ends in ".json" or contains '/',
// otherwise `<profiles_dir>/<name>.json`. Errors start with
// "profile '<name_or_path>': ".
absl::StatusOr<HardwareProfile> LoadHardwareProfile(
    const std::string& profiles_dir, const std::string& name_or_path);

nlohmann::json HardwareProfileToJson(const HardwareProfile& profile);

}  // namespace canzona::plan::sim

#endif  // CANZONA_SERVER_PLAN_SIM_HARDWARE_PROFILE_H_
