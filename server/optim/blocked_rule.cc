// UpdateRule over the blocks of a fused matrix (update_rule.h,
// matrix_blocks.h): one rule per block, gathered where its rows are not
// contiguous, same-shape Muon blocks batched.
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "server/optim/rule_impl.h"
#include "server/optim/shared_scratch.h"
#include "server/optim/update_rule.h"

namespace canzona {
namespace {

std::string BlockPrefix(size_t k) { return absl::StrCat("block", k, "/"); }

}  // namespace

absl::StatusOr<std::unique_ptr<UpdateRule>> UpdateRule::CreateBlocked(
    const OptimizerConfig& config, absl::Span<const int64_t> shape,
    const BlockSpec& spec, absl::string_view parameter, Backend* backend,
    SharedScratch* scratch, SharedScratch* gather) {
  if (spec.empty()) return Create(config, shape, backend, scratch);
  if (config.kind == OptimizerKind::kAdamW) {
    return absl::InvalidArgumentError(
        "blocks: adamw updates element-wise; blocks need a matrix optimizer "
        "(muon, shampoo, soap)");
  }
  if (backend == nullptr) {
    return absl::InvalidArgumentError("blocks: null backend");
  }
  CANZONA_ASSIGN_OR_RETURN(std::vector<MatrixBlock> blocks,
                           LayOutBlocks(spec, shape, parameter));
  std::unique_ptr<UpdateRule> rule(
      new UpdateRule(config, std::vector<int64_t>(shape.begin(), shape.end()),
                     backend, nullptr));
  rule->block_dim_ = spec.dim;
  std::map<std::vector<int64_t>, int> batch_of_shape;
  for (size_t k = 0; k < blocks.size(); ++k) {
    const MatrixBlock& block = blocks[k];
    CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<UpdateRule> part,
                             Create(config, block.shape, backend, scratch));
    rule->block_rules_.push_back(std::move(part));
    const bool in_place = spec.dim == 0 && block.segments.size() == 1;
    rule->gather_offset_.push_back(in_place ? -1 : rule->gathered_);
    if (!in_place) rule->gathered_ += NumElements(block.shape);
    // Muon blocks of one shape share a batched Newton-Schulz.
    auto [it, fresh] = batch_of_shape.emplace(
        block.shape, static_cast<int>(rule->batches_.size()));
    if (fresh || config.kind != OptimizerKind::kMuon) {
      if (!fresh) it->second = static_cast<int>(rule->batches_.size());
      rule->batches_.push_back({});
    }
    rule->batches_[it->second].push_back(static_cast<int>(k));
  }
  if (rule->gathered_ > 0) {
    if (gather != nullptr) {
      gather->StartRule();
      CANZONA_ASSIGN_OR_RETURN(rule->gather_,
                               gather->Take(2 * rule->gathered_));
    } else {
      CANZONA_ASSIGN_OR_RETURN(rule->own_gather_,
                               backend->Allocate(2 * rule->gathered_));
      rule->gather_ = rule->own_gather_.data();
    }
  }
  // Each batch's Newton-Schulz workspace and scratch now, not in a step.
  for (const std::vector<int>& batch : rule->batches_) {
    std::vector<UpdateRule*> members;
    for (int k : batch) members.push_back(rule->block_rules_[k].get());
    CANZONA_RETURN_IF_ERROR(ReserveMuonBatch(members));
  }
  rule->blocks_ = std::move(blocks);
  rule->block_params_.resize(rule->blocks_.size());
  rule->block_grads_.resize(rule->blocks_.size());
  return rule;
}

absl::Status MoveBlock(Backend& backend, absl::Span<const int64_t> shape,
                       int dim, const MatrixBlock& block, float* whole,
                       float* contiguous, bool to_block) {
  const int64_t rows = shape[0], cols = shape[1];
  int64_t at = 0;  // along `dim`, in the block
  for (const Segment& s : block.segments) {
    if (dim == 0) {
      float* w = whole + s.start * cols;
      float* c = contiguous + at * cols;
      CANZONA_RETURN_IF_ERROR(to_block ? backend.Copy(w, s.length * cols, c)
                                       : backend.Copy(c, s.length * cols, w));
    } else {
      const int64_t block_cols = block.shape[1];
      float* w = whole + s.start;
      float* c = contiguous + at;
      CANZONA_RETURN_IF_ERROR(
          to_block ? backend.Copy2D(rows, s.length, w, cols, c, block_cols)
                   : backend.Copy2D(rows, s.length, c, block_cols, w, cols));
    }
    at += s.length;
  }
  return absl::OkStatus();
}

absl::Status UpdateRule::StepBlocks(float* param, const float* grad,
                                    const StepOptions& options) {
  const int64_t cols = shape_[1];
  float* gathered_grads = gather_ + gathered_;
  for (size_t k = 0; k < blocks_.size(); ++k) {
    const int64_t at = gather_offset_[k];
    if (at < 0) {
      const int64_t start = blocks_[k].segments[0].start * cols;
      block_params_[k] = param + start;
      block_grads_[k] = grad + start;
      continue;
    }
    block_params_[k] = gather_ + at;
    block_grads_[k] = gathered_grads + at;
    CANZONA_RETURN_IF_ERROR(MoveBlock(*backend_, shape_, block_dim_, blocks_[k],
                                      param, block_params_[k],
                                      /*to_block=*/true));
    // MoveBlock only reads `whole` when gathering.
    CANZONA_RETURN_IF_ERROR(MoveBlock(*backend_, shape_, block_dim_, blocks_[k],
                                      const_cast<float*>(grad),
                                      gathered_grads + at, /*to_block=*/true));
  }
  for (const std::vector<int>& batch : batches_) {
    if (batch.size() == 1) {
      const int k = batch[0];
      CANZONA_RETURN_IF_ERROR(
          block_rules_[k]->Step(block_params_[k], block_grads_[k], options));
      continue;
    }
    batch_rules_.clear();
    batch_params_.clear();
    batch_grads_.clear();
    for (int k : batch) {
      batch_rules_.push_back(block_rules_[k].get());
      batch_params_.push_back(block_params_[k]);
      batch_grads_.push_back(block_grads_[k]);
    }
    CANZONA_RETURN_IF_ERROR(
        StepMuonBatch(batch_rules_, batch_params_, batch_grads_, options));
  }
  for (size_t k = 0; k < blocks_.size(); ++k) {
    if (gather_offset_[k] < 0) continue;
    CANZONA_RETURN_IF_ERROR(MoveBlock(*backend_, shape_, block_dim_, blocks_[k],
                                      param, block_params_[k],
                                      /*to_block=*/false));
  }
  return absl::OkStatus();
}

std::vector<OptimizerState> SplitBlockStates(const OptimizerState& state,
                                             size_t blocks) {
  std::vector<OptimizerState> out(blocks);
  for (size_t k = 0; k < blocks; ++k) {
    out[k].kind = state.kind;
    out[k].step = state.step;
  }
  const auto owner = [&](const std::string& name) -> std::pair<int, size_t> {
    for (size_t k = 0; k < blocks; ++k) {
      const std::string prefix = BlockPrefix(k);
      if (absl::StartsWith(name, prefix))
        return {static_cast<int>(k), prefix.size()};
    }
    return {-1, 0};
  };
  for (const auto& [name, value] : state.counters) {
    auto [k, skip] = owner(name);
    if (k >= 0) out[k].counters.emplace_back(name.substr(skip), value);
  }
  for (const StateTensor& tensor : state.tensors) {
    auto [k, skip] = owner(tensor.name);
    if (k < 0) continue;
    StateTensor t = tensor;
    t.name = tensor.name.substr(skip);
    out[k].tensors.push_back(std::move(t));
  }
  return out;
}

OptimizerState JoinBlockStates(OptimizerKind kind,
                               std::vector<OptimizerState> states) {
  OptimizerState out;
  out.kind = kind;
  if (!states.empty()) out.step = states[0].step;
  for (size_t k = 0; k < states.size(); ++k) {
    const std::string prefix = BlockPrefix(k);
    for (auto& [name, value] : states[k].counters) {
      out.counters.emplace_back(prefix + name, value);
    }
    for (StateTensor& tensor : states[k].tensors) {
      tensor.name = prefix + tensor.name;
      out.tensors.push_back(std::move(tensor));
    }
  }
  return out;
}

}  // namespace canzona
