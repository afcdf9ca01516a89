#include "server/engine/block_records.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"

namespace canzona {
namespace {

// Takes the master tensor and its dtype counter out of `state`.
std::optional<std::pair<StateTensor, int64_t>> TakeMasterTensor(
    OptimizerState& state) {
  std::optional<std::pair<StateTensor, int64_t>> out;
  for (auto it = state.tensors.begin(); it != state.tensors.end(); ++it) {
    if (it->name != kMasterTensor) continue;
    out.emplace(std::move(*it), -1);
    state.tensors.erase(it);
    break;
  }
  for (auto it = state.counters.begin(); it != state.counters.end(); ++it) {
    if (it->first != kMasterDType) continue;
    if (out.has_value()) out->second = it->second;
    state.counters.erase(it);
    break;
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> RecordNames(const ParamMeta& m) {
  if (m.blocks.empty()) return std::vector<std::string>{m.name};
  CANZONA_ASSIGN_OR_RETURN(std::vector<MatrixBlock> blocks,
                           LayOutBlocks(m.blocks, m.shape, m.name));
  std::vector<std::string> names;
  for (const MatrixBlock& block : blocks) names.push_back(block.name);
  return names;
}

absl::StatusOr<std::vector<std::pair<std::string, OptimizerState>>> SplitRecord(
    const ParamMeta& m, OptimizerState state, Backend& host) {
  std::vector<std::pair<std::string, OptimizerState>> out;
  if (m.blocks.empty()) {
    out.emplace_back(m.name, std::move(state));
    return out;
  }
  CANZONA_ASSIGN_OR_RETURN(std::vector<MatrixBlock> blocks,
                           LayOutBlocks(m.blocks, m.shape, m.name));
  std::optional<std::pair<StateTensor, int64_t>> master =
      TakeMasterTensor(state);
  std::vector<OptimizerState> parts = SplitBlockStates(state, blocks.size());
  for (size_t k = 0; k < blocks.size(); ++k) {
    if (master.has_value()) {
      std::vector<float> values(NumElements(blocks[k].shape));
      CANZONA_RETURN_IF_ERROR(MoveBlock(host, m.shape, m.blocks.dim, blocks[k],
                                        master->first.data.data(),
                                        values.data(), /*to_block=*/true));
      parts[k].tensors.push_back(
          {kMasterTensor, blocks[k].shape, std::move(values)});
      parts[k].counters.emplace_back(kMasterDType, master->second);
    }
    out.emplace_back(blocks[k].name, std::move(parts[k]));
  }
  return out;
}

absl::StatusOr<CheckpointRecord> JoinRecords(
    const ParamMeta& m, std::vector<CheckpointRecord> records, Backend& host) {
  if (m.blocks.empty()) return std::move(records.at(0));
  CANZONA_ASSIGN_OR_RETURN(std::vector<MatrixBlock> blocks,
                           LayOutBlocks(m.blocks, m.shape, m.name));
  CheckpointRecord whole{m.name, records.at(0).config, {}};
  std::vector<float> master(m.numel);
  bool every_master = true;
  int64_t dtype = -1;
  std::vector<OptimizerState> parts;
  for (size_t k = 0; k < blocks.size(); ++k) {
    CheckpointRecord& r = records.at(k);
    if (r.config.kind != whole.config.kind) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parameter '", m.name, "': its blocks '", blocks[0].name, "' and '",
          blocks[k].name, "' hold state of different optimizers"));
    }
    std::optional<std::pair<StateTensor, int64_t>> part =
        TakeMasterTensor(r.state);
    if (!part.has_value()) {
      every_master = false;
    } else if (part->first.shape != blocks[k].shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", m.name, "': block '", blocks[k].name,
                       "' has master weights of another shape"));
    } else {
      dtype = part->second;
      CANZONA_RETURN_IF_ERROR(MoveBlock(host, m.shape, m.blocks.dim, blocks[k],
                                        master.data(), part->first.data.data(),
                                        /*to_block=*/false));
    }
    parts.push_back(std::move(r.state));
  }
  whole.state = JoinBlockStates(whole.config.kind, std::move(parts));
  if (every_master) {
    whole.state.tensors.push_back({kMasterTensor, m.shape, std::move(master)});
    whole.state.counters.emplace_back(kMasterDType, dtype);
  }
  return whole;
}

}  // namespace canzona
