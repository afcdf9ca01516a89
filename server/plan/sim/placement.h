// Where ranks sit: which node holds each global rank, and which link tier
// a group of ranks spans. Ranks are numbered as the trainers number them
// (Megatron's order: TP fastest, then DP, then PP),
//
//   global rank = (stage * dp + dp_rank) * tp + tp_rank,
//
// and a node holds `ranks_per_node` consecutive global ranks (all of them
// when 0). A group whose ranks share one node talks over the intra-node
// tier, any other over the inter-node tier (a ring is as slow as its
// slowest hop).
//
// Thread-safety: immutable after construction.
#ifndef CANZONA_SERVER_PLAN_SIM_PLACEMENT_H_
#define CANZONA_SERVER_PLAN_SIM_PLACEMENT_H_

#include <vector>

#include "server/plan/parameter.h"
#include "server/plan/sim/hardware_profile.h"

namespace canzona::plan::sim {

class Placement {
 public:
  Placement(const ParallelLayout& layout, const HardwareProfile& profile);

  int world() const { return world_; }
  int nodes() const { return nodes_; }
  int GlobalRank(int stage, int dp_rank, int tp_rank) const;
  int Node(int global_rank) const;
  // Ranks on the node of `global_rank` (the last node may hold fewer).
  int RanksOnNode(int global_rank) const;
  // The tier of a group of global ranks.
  const LinkTier& Tier(const std::vector<int>& ranks) const;
  bool SameNode(const std::vector<int>& ranks) const;

 private:
  ParallelLayout layout_;
  const HardwareProfile* profile_;
  int world_ = 1;
  int per_node_ = 1;
  int nodes_ = 1;
};

}  // namespace canzona::plan::sim

#endif  // CANZONA_SERVER_PLAN_SIM_PLACEMENT_H_
