#include "server/engine/rank_layout.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "server/optim/update_rule.h"

namespace canzona {
namespace {

// Buckets of my stage in plan order, their parameters' offsets, cuts and
// dtypes.
absl::Status LayoutBuckets(const JobPlan& jp, const JobSettings& settings,
                           int stage, RankLayout& out) {
  const plan::Plan& plan = jp.plan;
  const int S = out.shard_size, d = out.shard_pos;
  int64_t base = 0;
  for (int b = 0; b < static_cast<int>(plan.buckets.size()); ++b) {
    const plan::BucketPlan& bp = plan.buckets[b];
    if (bp.stage != stage) continue;
    BucketLayout bucket;
    bucket.index = b;
    bucket.base = base;
    std::vector<int64_t> param_start;
    for (int i : bp.params) {
      param_start.push_back(bucket.elements);
      out.offset[i] = base + bucket.elements;
      bucket.elements += jp.params[i].fragment_numel;
    }
    param_start.push_back(bucket.elements);
    bucket.dtype = jp.params[bp.params.front()].dtype;
    for (int i : bp.params) {
      if (jp.params[i].dtype != bucket.dtype) bucket.dtype = DType::kFloat32;
    }
    bucket.reduce_dtype =
        settings.grad_reduce_fp32 ? DType::kFloat32 : bucket.dtype;
    out.max_bucket = std::max(out.max_bucket, bucket.elements);
    if (out.sliced) {
      if (static_cast<int>(bp.cuts.size()) != S + 1) {
        return absl::InternalError(absl::StrCat("plan bucket ", b, " has ",
                                                bp.cuts.size(),
                                                " cuts, expected ", S + 1));
      }
      for (int r = 0; r < S; ++r) {
        bucket.counts.push_back(param_start[bp.cuts[r + 1]] -
                                param_start[bp.cuts[r]]);
      }
      bucket.my_start = param_start[bp.cuts[d]];
    }
    for (int r = 0; r < S; ++r) {
      bucket.even_counts.push_back(bucket.elements / S +
                                   (r < bucket.elements % S ? 1 : 0));
      if (r < d) bucket.even_start += bucket.even_counts.back();
    }
    base += bucket.elements;
    out.buckets.push_back(std::move(bucket));
  }
  out.stage_elements = base;
  for (int i : out.stage_params) {
    if (out.offset[i] < 0) {
      return absl::InternalError(absl::StrCat(
          "plan: parameter '", jp.params[i].name, "' is in no bucket"));
    }
  }
  for (int b = static_cast<int>(out.buckets.size()) - 1; b >= 0; --b) {
    out.gather_order.push_back(b);
  }
  return absl::OkStatus();
}

// My largest slice, the layerwise gather's slices, and the largest padded
// collective of the DP communicator (NCCL's scratch, sized at creation;
// none for a group of one, which runs no collective: the largest bucket's
// size in device memory otherwise, 1.6 GB at Qwen3-0.6B).
void SizeDpBuffers(const JobPlan& jp, RankLayout& out) {
  const int S = out.shard_size, d = out.shard_pos;
  for (const BucketLayout& b : out.buckets) {
    const std::vector<int64_t>& counts = out.sliced ? b.counts : b.even_counts;
    out.max_slice = std::max(out.max_slice, counts[d]);
    if (S == 1) continue;
    for (int64_t c : counts) out.dp_scratch = std::max(out.dp_scratch, S * c);
  }
  if (jp.plan.strategy == plan::Strategy::kLayerwise && S > 1) {
    out.layerwise_counts.assign(S, 0);
    for (int i : out.stage_params) {
      out.layerwise_counts[jp.plan.dp_owner[i]] += jp.params[i].fragment_numel;
      out.layerwise_total += jp.params[i].fragment_numel;
    }
    for (int64_t c : out.layerwise_counts) {
      out.dp_scratch = std::max(out.dp_scratch, S * c);
    }
  }
}

// Who updates what, and the state shape kept where it is owned.
void AssignUpdates(const JobPlan& jp, const JobSettings& settings,
                   RankLayout& out) {
  const plan::Plan& plan = jp.plan;
  const int TP = out.tp_size, t = out.tp_rank, d = out.shard_pos;
  for (int i : out.stage_params) {
    const ParamMeta& m = jp.params[i];
    const OptimizerConfig& config = settings.configs.at(m.group);
    const int owner = plan.dp_owner[i];
    const bool split = m.split >= 0 && TP > 1;
    if (split && IsMatrix(config.kind)) {
      out.mode[i] =
          plan.tp_owner[i] >= 0 ? UpdateMode::kTpOwned : UpdateMode::kRedundant;
    }
    out.dp_owned[i] = owner < 0 || owner == d;
    const bool first_owner =
        (owner < 0 ? d == 0 : owner == d) && out.shard_group == 0;
    out.counted[i] = first_owner && (split || t == 0);
    switch (out.mode[i]) {
      case UpdateMode::kDpOwned:
        out.update_counted[i] = out.counted[i];
        break;
      case UpdateMode::kTpOwned:
        out.update_counted[i] = first_owner && plan.tp_owner[i] == t;
        break;
      case UpdateMode::kRedundant:
        out.update_counted[i] = first_owner && t == 0;
        break;
    }
    if (!out.dp_owned[i]) continue;
    std::vector<int64_t>& shape = out.state_shape[i];
    switch (out.mode[i]) {
      case UpdateMode::kDpOwned:
        shape = m.local_shape;
        break;
      case UpdateMode::kTpOwned:
        if (plan.tp_owner[i] == t) shape = m.shape;
        break;
      case UpdateMode::kRedundant:
        shape = m.shape;
        out.redundant.push_back(i);
        out.max_redundant = std::max(out.max_redundant, m.fragment_numel);
        break;
    }
    if (!shape.empty()) {
      out.max_state = std::max(out.max_state, NumElements(shape));
      if (out.mode[i] != UpdateMode::kDpOwned) {
        out.max_whole = std::max(out.max_whole, NumElements(shape));
      }
    }
  }
}

// ZeRO-1: the owned buffers hold, bucket by bucket, the parameters this
// rank holds; under a sliced strategy exactly my slice of each bucket.
absl::Status LayoutOwned(const JobPlan& jp, RankLayout& out) {
  const int d = out.shard_pos;
  int64_t at = 0;
  for (BucketLayout& b : out.buckets) {
    b.owned_base = at;
    for (int i : jp.plan.buckets[b.index].params) {
      if (!out.dp_owned[i]) continue;
      if (out.sliced &&
          out.offset[i] - b.base - b.my_start != at - b.owned_base) {
        return absl::InternalError(absl::StrCat(
            "plan: parameter '", jp.params[i].name,
            "' is owned but outside my slice of bucket ", b.index));
      }
      out.owned_offset[i] = at;
      at += jp.params[i].fragment_numel;
    }
    if (out.sliced && at - b.owned_base != b.counts[d]) {
      return absl::InternalError(absl::StrCat(
          "plan: bucket ", b.index, " slice of ", b.counts[d],
          " elements holds ", at - b.owned_base, " owned elements"));
    }
  }
  out.owned_elements = at;
  return absl::OkStatus();
}

// My micro groups and what their all-to-alls move.
void LayoutGroups(const JobPlan& jp, int stage, RankLayout& out) {
  const plan::Plan& plan = jp.plan;
  const int TP = out.tp_size, t = out.tp_rank;
  for (const plan::MicroGroup& g : plan.micro_groups) {
    if (g.stage != stage || g.dp != out.shard_pos) continue;
    GroupLayout layout;
    layout.group = &g;
    layout.send_counts.assign(TP, 0);
    layout.back_recv.assign(TP, 0);
    int64_t whole_here = 0;
    for (int i : g.params) {
      const int h = plan.tp_owner[i];
      const int64_t n = jp.params[i].fragment_numel;
      layout.send_counts[h] += 2 * n;
      layout.back_recv[h] += n;
      layout.local += n;
      if (h == t) {
        layout.tp_owned_here += n;
        whole_here += NumElements(jp.params[i].shape);
      }
    }
    out.max_group_whole = std::max(out.max_group_whole, whole_here);
    layout.recv_counts.assign(TP, 2 * layout.tp_owned_here);
    layout.back_send.assign(TP, layout.tp_owned_here);
    out.groups.push_back(std::move(layout));
  }
}

}  // namespace

absl::StatusOr<RankLayout> LayoutRank(const JobPlan& jp,
                                      const JobSettings& settings,
                                      const v1::RankCoordinates& coords) {
  const plan::Plan& plan = jp.plan;
  const int stage = coords.pp_rank();
  RankLayout out;
  out.tp_size = settings.layout.tp();
  out.tp_rank = coords.tp_rank();
  // Hierarchical sharding: the plan is one shard group's (its DP indices
  // are positions in the group); the groups hold replicas of it.
  const int S = settings.shard_group_size;
  out.shard_size = S;
  out.shard_pos = coords.dp_rank() % S;
  out.shard_group = coords.dp_rank() / S;
  if (stage >= static_cast<int>(jp.stage_first.size())) {
    return absl::InternalError(absl::StrCat("plan has no stage ", stage));
  }
  out.first = jp.stage_first[stage];
  const int end = stage + 1 < static_cast<int>(jp.stage_first.size())
                      ? jp.stage_first[stage + 1]
                      : static_cast<int>(jp.params.size());
  for (int i = out.first; i < end; ++i) out.stage_params.push_back(i);
  const size_t n = jp.params.size();
  out.offset.assign(n, -1);
  out.mode.assign(n, UpdateMode::kDpOwned);
  out.dp_owned.assign(n, 0);
  out.counted.assign(n, 0);
  out.update_counted.assign(n, 0);
  out.owned_offset.assign(n, -1);
  out.state_shape.assign(n, {});
  out.sliced = plan.strategy != plan::Strategy::kSc &&
               plan.strategy != plan::Strategy::kLayerwise;
  CANZONA_RETURN_IF_ERROR(LayoutBuckets(jp, settings, stage, out));
  SizeDpBuffers(jp, out);
  AssignUpdates(jp, settings, out);
  CANZONA_RETURN_IF_ERROR(LayoutOwned(jp, out));
  LayoutGroups(jp, stage, out);
  return out;
}

}  // namespace canzona
