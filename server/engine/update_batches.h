// Batched DP-owned updates: the same-shape Muon matrices a rank updates
// itself (DP-owned, not TP-owned) step together in one batched
// Newton-Schulz (StepMuonBatch: one strided-batched call per iteration on
// cuda, where 128 experts x 48 layers of one shape are otherwise
// launch-bound; the same per-matrix arithmetic on cpu, so results are
// bitwise those of one call per matrix), and one optimizer group's AdamW
// tensors, whatever their shapes, in one AdamWStepMany (StepAdamWBatch: a
// few launches for Qwen3-0.6B's 115 norms and embeddings instead of two
// each; bitwise the per-tensor steps).
//
//   std::vector<UpdateBatch> batches =
//       BatchDpOwnedUpdates(jp, layout, rules, owned, {.enabled = true, ...});
//
// Thread-safety: built at setup, then read by the rank's worker only.
#ifndef CANZONA_SERVER_ENGINE_UPDATE_BATCHES_H_
#define CANZONA_SERVER_ENGINE_UPDATE_BATCHES_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "server/engine/job_plan.h"
#include "server/engine/owned_buffers.h"
#include "server/engine/rank_layout.h"
#include "server/optim/update_rule.h"

namespace canzona {

// Parameters updated together; one member: a plain update. The pointer
// arrays are filled once (owned buffers never move), so a step allocates
// nothing.
struct UpdateBatch {
  std::vector<int> params;  // plan indices, stage_params order
  std::vector<UpdateRule*> rules;
  std::vector<float*> param_ptrs;
  std::vector<const float*> grad_ptrs;
  int64_t elements = 0;  // of every member together
  // The members' update sizes (the update RMS; RankLayout::update_counted)
  // as the step counts them: none counted; each queued by its rule in the
  // pass that applies it (Muon, AdamW: UpdateRule::QueuesChange, every
  // member counted); or from a copy of the old values
  // (RankRuntime::update_before, sized for these batches only).
  enum class Counting { kNone, kInPass, kFromCopy };
  Counting counting = Counting::kNone;
};

struct BatchOptions {
  // False: every update alone (the per-matrix baseline of the benchmark).
  bool enabled = true;
  // Floats one batch may span: its members' old values are kept aside for
  // the update RMS, and batched Newton-Schulz works on all at once.
  int64_t max_elements = int64_t{1} << 24;
};

// Every DP-owned update of the rank (layout.mode kDpOwned), in
// stage_params order of each batch's first member, on the buffers of
// `owned` (where the updates run in place: staging, or OwnedDeviceCopy's
// view). Members share the optimizer group and are unblocked Muon rules of
// one shape, or AdamW rules alike in RankLayout::update_counted.
std::vector<UpdateBatch> BatchDpOwnedUpdates(
    const JobPlan& jp, const RankLayout& layout,
    const std::map<int, std::unique_ptr<UpdateRule>>& rules,
    const OwnedBuffers& owned, const BatchOptions& options);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_UPDATE_BATCHES_H_
