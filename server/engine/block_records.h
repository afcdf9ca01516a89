// Checkpoint records of a fused matrix with blocks (ParamMeta::blocks):
// one record per block, under the block's name, holding the block's state
// as a rule of the block's shape holds it and the block's rows (or
// columns) of the fp32 master weights. A Megatron run whose linear_qkv
// blocks are named like a Hugging Face run's q_proj, k_proj and v_proj
// therefore saves what that run loads, and loads what it saves.
//
//   for (auto& [name, state] : SplitRecord(m, std::move(whole), rt.host()))
//     writer->Add(name, config, state);
//
// Thread-safety: pure functions over the given host backend.
#ifndef CANZONA_SERVER_ENGINE_BLOCK_RECORDS_H_
#define CANZONA_SERVER_ENGINE_BLOCK_RECORDS_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/checkpoint/checkpoint.h"
#include "server/engine/job_plan.h"
#include "server/optim/update_rule.h"

namespace canzona {

// Mixed precision: records carry the fp32 master weights whole, as the
// tensor kMasterTensor with the trainer's dtype in the counter
// kMasterDType, so that they reshard like element-wise state.
inline constexpr char kMasterTensor[] = "master";
inline constexpr char kMasterDType[] = "master_dtype";

// The records parameter `m` is saved as: (m.name, state) without blocks;
// one per block with blocks. `state` is the whole parameter's (a blocked
// rule's state, plus the whole master weights if any).
absl::StatusOr<std::vector<std::pair<std::string, OptimizerState>>> SplitRecord(
    const ParamMeta& m, OptimizerState state, Backend& host);

// The names of the records parameter `m` is loaded from, in order.
absl::StatusOr<std::vector<std::string>> RecordNames(const ParamMeta& m);

// The whole parameter's record from its records (RecordNames order): the
// blocks' states joined, their master weights joined when every block has
// them. FAILED_PRECONDITION when the blocks hold different optimizers.
absl::StatusOr<CheckpointRecord> JoinRecords(
    const ParamMeta& m, std::vector<CheckpointRecord> records, Backend& host);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_BLOCK_RECORDS_H_
