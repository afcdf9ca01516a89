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
#include "server/optim/optimizer_config.h"

namespace canzona {

// Per-step options.
struct StepOptions {
  // Overrides the config's learning rate for this step (schedulers).
  std::optional<float> lr;
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
namespace optim_internal {
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

  ~UpdateRule();
  UpdateRule(const UpdateRule&) = delete;
  UpdateRule& operator=(const UpdateRule&) = delete;

  // One optimizer step. `param` and `grad` point into the backend's memory
  // (device pointers on cuda), numel(shape) floats each, not aliasing.
  absl::Status Step(float* param, const float* grad,
                    const StepOptions& options = {});

  // Copies the state to the host.
  absl::StatusOr<OptimizerState> SaveState() const;
  // Replaces the state. INVALID_ARGUMENT (and no change) when the kind,
  // tensor names, shapes, sizes or counters do not match this rule.
  absl::Status LoadState(const OptimizerState& state);

  // Bytes of persistent state in backend memory (scratch excluded).
  int64_t state_bytes() const;
  const OptimizerConfig& config() const { return config_; }
  absl::Span<const int64_t> shape() const { return shape_; }
  Backend* backend() const { return backend_; }

 private:
  friend absl::Status StepMuonBatch(absl::Span<UpdateRule* const> rules,
                                    absl::Span<float* const> params,
                                    absl::Span<const float* const> grads,
                                    const StepOptions& options);

  UpdateRule(const OptimizerConfig& config, std::vector<int64_t> shape,
             Backend* backend, std::unique_ptr<optim_internal::RuleImpl> impl);

  OptimizerConfig config_;
  std::vector<int64_t> shape_;
  Backend* backend_;
  std::unique_ptr<optim_internal::RuleImpl> impl_;
};

// Muon on several same-shape matrices at once: one batched Newton-Schulz
// instead of one per matrix. Every rule must be a muon rule with the same
// config, shape and backend (INVALID_ARGUMENT otherwise); params[i] and
// grads[i] belong to rules[i]. Equivalent to rules[i]->Step(params[i],
// grads[i], options) for each i.
absl::Status StepMuonBatch(absl::Span<UpdateRule* const> rules,
                           absl::Span<float* const> params,
                           absl::Span<const float* const> grads,
                           const StepOptions& options = {});

}  // namespace canzona

#endif  // CANZONA_SERVER_OPTIM_UPDATE_RULE_H_
