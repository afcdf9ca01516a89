// Whole-matrix optimizer update rules (muon, adamw, shampoo, soap) written
// over the numeric Backend, with float32 state in the backend's memory and a
// host-side serializable copy of that state.
//
// Example:
//   CANZONA_ASSIGN_OR_RETURN(OptimizerConfig config,
//                            MakeOptimizerConfig(OptimizerKind::kMuon, {}));
//   CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<UpdateRule> rule,
//                            UpdateRule::Create(config, {1024, 4096},
//                            backend));
//   CANZONA_RETURN_IF_ERROR(rule->Step(param, grad));   // backend pointers
//   CANZONA_ASSIGN_OR_RETURN(OptimizerState state, rule->SaveState());
//
// The exact formulas, step by step, are server/DESIGN.md section 3.
#ifndef CANZONA_SERVER_OPTIM_UPDATE_RULE_H_
#define CANZONA_SERVER_OPTIM_UPDATE_RULE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "server/optim/matrix_blocks.h"
#include "server/optim/optimizer_config.h"

namespace canzona {

// Per-step options.
struct StepOptions {
  // Overrides the config's learning rate for this step (schedulers).
  std::optional<float> lr;
  // kQueue: the step also queues the sum of squares of its change to the
  // parameter on the backend's queue (Backend::EnqueueSumSquares), in the
  // pass that applies it (the update RMS at no extra memory traffic); only
  // for rules whose QueuesChange() is true.
  SquaredChange change = SquaredChange::kIgnore;
  // This step's settings where the trainer scheduled some
  // (ScheduleSettings of the rule's config: StepRequest.settings); null:
  // the config the rule was created with. Like lr, for this step only.
  const OptimizerConfig* settings = nullptr;
};

// One named float32 state tensor, host copy, row-major.
struct StateTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;  // numel(shape) values
  bool operator==(const StateTensor&) const = default;
};

// Serializable state of one parameter's rule: the step count, rule-specific
// integer counters and named tensors. Tensor names per kind:
//   muon:    "momentum" [rows, cols]
//   adamw:   "exp_avg", "exp_avg_sq" [shape]
//   shampoo: per block "block.<i>.<j>.<what>" with what in L, R, L_inv,
//            R_inv (square), momentum (if beta1 != 0), graft (if grafting)
//   soap:    "exp_avg" (projected space), "exp_avg_sq", and per
//            preconditioned side "GL", "QL" [rows, rows] / "GR", "QR"
//            [cols, cols]; counter "initialized" (0/1: the first call only
//            initializes, the step stays 0).
//
// Thread-safety: a plain value.
struct OptimizerState {
  OptimizerKind kind = OptimizerKind::kAdamW;
  int64_t step = 0;
  std::vector<std::pair<std::string, int64_t>> counters;
  std::vector<StateTensor> tensors;
  bool operator==(const OptimizerState&) const = default;

  // nullptr when absent.
  const StateTensor* FindTensor(absl::string_view name) const;
};

// Number of elements of `shape` (1 for a scalar).
int64_t NumElements(absl::Span<const int64_t> shape);

// The Newton-Schulz iteration Muon runs for `options` on `backend_kind`
// (coefficient set, normalization, precision with "auto" resolved).
absl::StatusOr<NewtonSchulzSpec> NewtonSchulzSpecFor(const MuonOptions& options,
                                                     BackendKind backend_kind);

class SharedScratch;
// What a matrix rule (muon, shampoo, soap) steps for a parameter of
// `shape`, as Keller Jordan's Muon does: a 2-D shape itself; a 3-D one
// (stacked experts (E, rows, cols)) as E matrices (rows, cols), the blocks
// of the matrix (E * rows, cols); convolution filters (out, in, kh, kw) and
// (out, in, kd, kh, kw) as the matrix (out, in * kernel). Any other shape
// is INVALID_ARGUMENT (a message without the caller's prefix).
struct SteppedMatrix {
  std::vector<int64_t> shape;
  BlockSpec blocks;  // empty: one matrix
};
absl::StatusOr<SteppedMatrix> MatrixOfParameter(
    absl::Span<const int64_t> shape);

namespace optim_internal {
class MuonRule;
class RuleImpl;
}  // namespace optim_internal

// One whole parameter's update rule and its state in backend memory. State
// and scratch are allocated at Create; Step allocates nothing in steady
// state.
//
// Thread-safety: not thread-safe. A rule is owned by the device worker
// that owns its Backend, and used only from that thread.
class UpdateRule {
 public:
  // INVALID_ARGUMENT for a shape the optimizer cannot take (muon, shampoo,
  // soap need 2-D; every dimension must be >= 1) or an option the backend
  // cannot run (ns_precision=bf16 on cpu). `backend` must outlive the rule;
  // so must `scratch` (null: the rule's scratch is its own), shared by the
  // rules that never step at the same time.
  static absl::StatusOr<std::unique_ptr<UpdateRule>> Create(
      const OptimizerConfig& config, absl::Span<const int64_t> shape,
      Backend* backend, SharedScratch* scratch = nullptr);

  // One rule per block of a fused matrix (server/optim/matrix_blocks.h):
  // each block has its own state and its own update, scaled from its own
  // shape, as if it were a separate parameter; same-shape Muon blocks step
  // in one batched Newton-Schulz. Blocks whose rows are not contiguous in
  // the whole matrix are copied into `gather` while they step (null: the
  // rule's own memory), shared like `scratch` by rules that never step at
  // the same time. INVALID_ARGUMENT for adamw or a spec the shape cannot
  // take. An empty spec gives Create's rule.
  static absl::StatusOr<std::unique_ptr<UpdateRule>> CreateBlocked(
      const OptimizerConfig& config, absl::Span<const int64_t> shape,
      const BlockSpec& spec, absl::string_view parameter, Backend* backend,
      SharedScratch* scratch = nullptr, SharedScratch* gather = nullptr);

  ~UpdateRule();
  UpdateRule(const UpdateRule&) = delete;
  UpdateRule& operator=(const UpdateRule&) = delete;

  // One optimizer step. `param` and `grad` point into the backend's memory
  // (device pointers on cuda), numel(shape) floats each, not aliasing.
  absl::Status Step(float* param, const float* grad,
                    const StepOptions& options = {});

  // Whether Step takes StepOptions::change = kQueue: Muon and AdamW, not
  // blocked (their last pass writes each element of the parameter once).
  bool QueuesChange() const;

  // Copies the state to the host.
  absl::StatusOr<OptimizerState> SaveState() const;
  // Replaces the state. INVALID_ARGUMENT (and no change) when the kind,
  // tensor names, shapes, sizes or counters do not match this rule.
  absl::Status LoadState(const OptimizerState& state);

  // Bytes of persistent state in backend memory (scratch excluded).
  int64_t state_bytes() const;
  // Bytes of backend memory the rule keeps besides its state and the
  // shared scratch: a Muon batch leader's momentum outputs
  // (ReserveMuonBatch).
  int64_t own_bytes() const;

  // The blocks of a blocked rule (empty otherwise). Its state is every
  // block's, each tensor and counter named "block<k>/<name>"
  // (SplitBlockStates, JoinBlockStates).
  const std::vector<MatrixBlock>& blocks() const { return blocks_; }
  const OptimizerConfig& config() const { return config_; }
  absl::Span<const int64_t> shape() const { return shape_; }
  Backend* backend() const { return backend_; }

 private:
  friend absl::Status StepMuonBatch(absl::Span<UpdateRule* const> rules,
                                    absl::Span<float* const> params,
                                    absl::Span<const float* const> grads,
                                    const StepOptions& options);
  friend absl::StatusOr<optim_internal::RuleImpl*> CheckBatch(
      OptimizerKind kind, absl::Span<UpdateRule* const> rules);
  friend absl::Status StepAdamWBatch(absl::Span<UpdateRule* const> rules,
                                     absl::Span<float* const> params,
                                     absl::Span<const float* const> grads,
                                     const StepOptions& options);

  UpdateRule(const OptimizerConfig& config, std::vector<int64_t> shape,
             Backend* backend, std::unique_ptr<optim_internal::RuleImpl> impl);

  absl::Status StepBlocks(float* param, const float* grad,
                          const StepOptions& options);
  // Makes the rule step with options.settings (or its config): retunes it
  // where they differ from the last step's. INVALID_ARGUMENT when they
  // differ from its config in more than the scheduled settings.
  absl::Status Settle(const StepOptions& options);

  OptimizerConfig config_;
  // The settings the last step ran with (config_ unless one scheduled
  // others); blocked rules leave it to their blocks' rules.
  OptimizerConfig stepping_;
  std::vector<int64_t> shape_;
  Backend* backend_;
  std::unique_ptr<optim_internal::RuleImpl> impl_;  // null when blocked

  // Blocked rules only: the blocks, their rules, which blocks step
  // together (same shape, batched Newton-Schulz), where gathered blocks
  // live while they step, and per-step pointer arrays (reused: steady-
  // state steps allocate nothing).
  int block_dim_ = 0;
  std::vector<MatrixBlock> blocks_;
  std::vector<std::unique_ptr<UpdateRule>> block_rules_;
  std::vector<std::vector<int>> batches_;
  std::vector<int64_t> gather_offset_;  // -1: rows contiguous in place
  float* gather_ = nullptr;             // 2 x gathered floats (param, grad)
  int64_t gathered_ = 0;
  DeviceBuffer own_gather_;
  std::vector<float*> block_params_;
  std::vector<const float*> block_grads_;
  std::vector<UpdateRule*> batch_rules_;
  std::vector<float*> batch_params_;
  std::vector<const float*> batch_grads_;
};

// A blocked rule's state cut into one state per block (as a rule of the
// block's shape holds it; tensors and counters of no block are dropped),
// and such states put back together.
std::vector<OptimizerState> SplitBlockStates(const OptimizerState& state,
                                             size_t blocks);
OptimizerState JoinBlockStates(OptimizerKind kind,
                               std::vector<OptimizerState> states);

// Copies `block`'s rows or columns (along `dim`) between the whole matrix
// of `shape` and the contiguous block (to_block), or back, on `backend`.
absl::Status MoveBlock(Backend& backend, absl::Span<const int64_t> shape,
                       int dim, const MatrixBlock& block, float* whole,
                       float* contiguous, bool to_block);

// Muon on several same-shape matrices at once: one batched Newton-Schulz
// instead of one per matrix. Every rule must be a muon rule with the same
// config, shape and backend (INVALID_ARGUMENT otherwise); params[i] and
// grads[i] belong to rules[i]. Equivalent to rules[i]->Step(params[i],
// grads[i], options) for each i.
absl::Status StepMuonBatch(absl::Span<UpdateRule* const> rules,
                           absl::Span<float* const> params,
                           absl::Span<const float* const> grads,
                           const StepOptions& options = {});

// AdamW on several tensors of one optimizer group (any shapes) in one
// backend call (Backend::AdamWStepMany) instead of one per tensor. Every
// rule must be an unblocked adamw rule with the same config and backend
// (INVALID_ARGUMENT otherwise). Equivalent to rules[i]->Step(params[i],
// grads[i], options) for each i, bitwise; rules at different steps (a
// state loaded for some) step one by one.
absl::Status StepAdamWBatch(absl::Span<UpdateRule* const> rules,
                            absl::Span<float* const> params,
                            absl::Span<const float* const> grads,
                            const StepOptions& options = {});

// What StepMuonBatch needs for `rules` (checked as it checks them), made
// now rather than in the first step: the batch's Newton-Schulz workspace
// (each rule reserves one matrix's; Backend::workspace_bytes) and its
// scratch for the momentum outputs (the leader's own_bytes). Otherwise the
// first step allocates both, and on cuda the workspace's growth drops the
// captured graphs. Nothing for fewer than two rules.
absl::Status ReserveMuonBatch(absl::Span<UpdateRule* const> rules);

}  // namespace canzona

#endif  // CANZONA_SERVER_OPTIM_UPDATE_RULE_H_
