#include "server/plan/sim/placement.h"

#include <algorithm>

namespace canzona::plan::sim {

Placement::Placement(const ParallelLayout& layout,
                     const HardwareProfile& profile)
    : layout_(layout), profile_(&profile) {
  world_ = layout.pp * layout.dp * layout.tp;
  per_node_ = profile.ranks_per_node > 0
                  ? std::min(profile.ranks_per_node, world_)
                  : world_;
  nodes_ = (world_ + per_node_ - 1) / per_node_;
}

int Placement::GlobalRank(int stage, int dp_rank, int tp_rank) const {
  return (stage * layout_.dp + dp_rank) * layout_.tp + tp_rank;
}

int Placement::Node(int global_rank) const { return global_rank / per_node_; }

int Placement::RanksOnNode(int global_rank) const {
  const int node = Node(global_rank);
  return std::min(per_node_, world_ - node * per_node_);
}

bool Placement::SameNode(const std::vector<int>& ranks) const {
  for (int r : ranks) {
    if (Node(r) != Node(ranks.front())) return false;
  }
  return true;
}

const LinkTier& Placement::Tier(const std::vector<int>& ranks) const {
  return ranks.empty() || SameNode(ranks) ? profile_->intra_node
                                          : profile_->inter_node;
}

}  // namespace canzona::plan::sim
