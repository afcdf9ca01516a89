// Internal to server/optim: the per-optimizer rule behind UpdateRule, with
// the named-state bookkeeping (save, validate, load) they all share.
//
// Thread-safety: as UpdateRule (not thread-safe; one device worker).
#ifndef CANZONA_SERVER_OPTIM_RULE_IMPL_H_
#define CANZONA_SERVER_OPTIM_RULE_IMPL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/shared_scratch.h"
#include "server/optim/update_rule.h"

namespace canzona::optim_internal {

class RuleImpl {
 public:
  RuleImpl(OptimizerKind kind, Backend* backend)
      : kind_(kind), backend_(backend) {}
  virtual ~RuleImpl() = default;

  // One step with the effective learning rate; `change` kQueue only where
  // queues_change() (UpdateRule::QueuesChange).
  virtual absl::Status Step(float* param, const float* grad, double lr,
                            SquaredChange change) = 0;
  virtual bool queues_change() const { return false; }
  // Steps from now on with `config`'s settings (the rule's kind; it
  // differs from the one created with at most in ScheduledSettingNames,
  // which each step reads afresh).
  virtual void Retune(const OptimizerConfig& config) = 0;

  absl::StatusOr<OptimizerState> SaveState() const;
  absl::Status LoadState(const OptimizerState& state);
  int64_t state_bytes() const;
  // Bytes of memory of its own besides state and scratch (Muon's batch
  // scratch).
  virtual int64_t own_bytes() const { return 0; }
  // Later AddScratch calls take from `scratch` (null: their own memory).
  void ShareScratch(SharedScratch* scratch) { shared_scratch_ = scratch; }

 protected:
  // Allocates a zero-filled state tensor, registered under `name` for
  // SaveState / LoadState. The returned pointer stays valid for the rule's
  // life.
  absl::StatusOr<float*> AddState(std::string name, std::vector<int64_t> shape);
  // A scratch array (not state): zero-filled memory of its own, or a
  // piece of the shared scratch (contents undefined).
  absl::StatusOr<float*> AddScratch(int64_t count);

  // Rule-specific integer counters (besides the step). LoadState requires
  // exactly these names; ValidateCounter checks one value before anything
  // changes, ApplyCounter sets it afterwards.
  virtual std::vector<std::pair<std::string, int64_t>> Counters() const {
    return {};
  }
  virtual absl::Status ValidateCounter(const std::string& /*name*/,
                                       int64_t /*value*/) const {
    return absl::OkStatus();
  }
  virtual void ApplyCounter(const std::string& /*name*/, int64_t /*value*/) {}

  const OptimizerKind kind_;
  Backend* const backend_;
  int64_t step_ = 0;
  SharedScratch* shared_scratch_ = nullptr;

 private:
  struct Slot {
    std::string name;
    std::vector<int64_t> shape;
    DeviceBuffer buffer;
  };
  std::vector<Slot> slots_;
  std::vector<DeviceBuffer> scratch_;
};

// Muon is exposed so StepMuonBatch can split a step around one batched
// Newton-Schulz.
class MuonRule : public RuleImpl {
 public:
  static absl::StatusOr<std::unique_ptr<MuonRule>> Create(
      const MuonOptions& options, int64_t rows, int64_t cols, Backend* backend,
      SharedScratch* scratch);

  absl::Status Step(float* param, const float* grad, double lr,
                    SquaredChange change) override;
  bool queues_change() const override { return true; }
  void Retune(const OptimizerConfig& config) override {
    options_ = config.muon;
  }

  // Momentum update; writes the Newton-Schulz input U to `out` (rows x cols).
  absl::Status UpdateMomentum(const float* grad, float* out);
  // p <- p (1 - lr wd) - lr s X for the orthogonalized X.
  absl::Status ApplyUpdate(float* param, const float* orthogonalized, double lr,
                           SquaredChange change);
  // A grow-only buffer of at least `count` floats for batched steps, kept
  // so steady-state batched steps allocate nothing.
  absl::StatusOr<float*> BatchScratch(int64_t count);

  const NewtonSchulzSpec& spec() const { return spec_; }
  int64_t own_bytes() const override {
    return batch_scratch_.size() * static_cast<int64_t>(sizeof(float));
  }

 private:
  MuonRule(const MuonOptions& options, int64_t rows, int64_t cols,
           NewtonSchulzSpec spec, Backend* backend);

  MuonOptions options_;
  int64_t rows_;
  int64_t cols_;
  NewtonSchulzSpec spec_;
  double scale_;
  float* momentum_ = nullptr;
  float* work_ = nullptr;
  DeviceBuffer batch_scratch_;
};

// AdamW is exposed so StepAdamWBatch can step many tensors in one backend
// call (Backend::AdamWStepMany).
class AdamWRule : public RuleImpl {
 public:
  AdamWRule(const AdamWOptions& options, std::vector<int64_t> shape,
            Backend* backend);
  absl::Status Init();

  absl::Status Step(float* param, const float* grad, double lr,
                    SquaredChange change) override;
  bool queues_change() const override { return true; }
  void Retune(const OptimizerConfig& config) override {
    options_ = config.adamw;
  }

  // The step this rule's next update is; BeginStep moves to it and returns
  // its tensors, which the caller must then update.
  int64_t next_step() const { return step_ + 1; }
  Backend::AdamWTensor BeginStep(float* param, const float* grad);
  const AdamWOptions& options() const { return options_; }

 private:
  AdamWOptions options_;
  std::vector<int64_t> shape_;
  int64_t numel_;
  float* exp_avg_ = nullptr;
  float* exp_avg_sq_ = nullptr;
};

absl::StatusOr<std::unique_ptr<RuleImpl>> CreateAdamWRule(
    const AdamWOptions& options, std::vector<int64_t> shape, Backend* backend);
absl::StatusOr<std::unique_ptr<RuleImpl>> CreateShampooRule(
    const ShampooOptions& options, int64_t rows, int64_t cols, Backend* backend,
    SharedScratch* scratch);
absl::StatusOr<std::unique_ptr<RuleImpl>> CreateSoapRule(
    const SoapOptions& options, int64_t rows, int64_t cols, Backend* backend,
    SharedScratch* scratch);

// Symmetric eigendecomposition in float32, retried in float64 when the
// float32 solver fails (Distributed Shampoo and SOAP both fall back so). `a`
// is restored from `source` (n x n) before each attempt because a failed
// solve may leave it overwritten; `add_identity` is added to the diagonal.
absl::Status EigenWithRetry(Backend* backend, int64_t n, const float* source,
                            float scale, float add_identity, float* a,
                            float* eigenvalues);

}  // namespace canzona::optim_internal

#endif  // CANZONA_SERVER_OPTIM_RULE_IMPL_H_
