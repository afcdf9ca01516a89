#include "server/engine/update_batches.h"

#include <string>
#include <tuple>
#include <utility>

namespace canzona {

std::vector<UpdateBatch> BatchDpOwnedUpdates(
    const JobPlan& jp, const RankLayout& layout,
    const std::map<int, std::unique_ptr<UpdateRule>>& rules,
    const OwnedBuffers& owned, const BatchOptions& options) {
  std::vector<UpdateBatch> batches;
  // The open batch of each (group, kind, shape, counted): Muon matrices of
  // one shape (one batched Newton-Schulz); AdamW tensors of any shape (one
  // AdamWStepMany), alike in whether their change is counted, so that a
  // batch counts in its pass and keeps no copy of old values.
  std::map<std::tuple<std::string, OptimizerKind, std::vector<int64_t>, bool>,
           size_t>
      open;
  for (int i : layout.stage_params) {
    if (!layout.dp_owned[i] || layout.mode[i] != UpdateMode::kDpOwned) continue;
    auto rule = rules.find(i);
    if (rule == rules.end()) continue;
    UpdateRule* r = rule->second.get();
    const ParamMeta& m = jp.params[i];
    const int64_t n = m.fragment_numel;
    const OptimizerKind kind = r->config().kind;
    const bool adamw = kind == OptimizerKind::kAdamW;
    const bool batchable = options.enabled &&
                           (kind == OptimizerKind::kMuon || adamw) &&
                           r->blocks().empty() && n <= options.max_elements;
    size_t at = batches.size();
    if (batchable) {
      auto key = std::make_tuple(m.group, kind,
                                 adamw ? std::vector<int64_t>{} : m.shape,
                                 adamw && layout.update_counted[i]);
      auto it = open.find(key);
      if (it != open.end() &&
          batches[it->second].elements + n <= options.max_elements) {
        at = it->second;
      } else {
        open[key] = batches.size();
      }
    }
    if (at == batches.size()) batches.emplace_back();
    UpdateBatch& b = batches[at];
    b.params.push_back(i);
    b.rules.push_back(r);
    b.param_ptrs.push_back(owned.param_at[i]);
    b.grad_ptrs.push_back(owned.grad_at[i]);
    b.elements += n;
  }
  for (UpdateBatch& b : batches) {
    int counted = 0;
    for (int i : b.params) counted += layout.update_counted[i] ? 1 : 0;
    if (counted == 0) continue;
    b.counting = counted == static_cast<int>(b.params.size()) &&
                         b.rules[0]->QueuesChange()
                     ? UpdateBatch::Counting::kInPass
                     : UpdateBatch::Counting::kFromCopy;
  }
  return batches;
}

}  // namespace canzona
