// SOAP (nikhilvyas/SOAP): Adam in the eigenbasis of Shampoo's factors GL,
// GR. The first call only initializes the bases; they are refreshed every
// precondition_frequency steps by one power iteration + QR after re-sorting
// by the estimated eigenvalues. exp_avg lives in the projected space and is
// carried across each refresh (back-projected with the old basis,
// re-projected with the new one); exp_avg_sq is only permuted.
#include <algorithm>
#include <cmath>

#include "kernels/base/status_macros.h"
#include "server/optim/rule_impl.h"

namespace canzona::optim_internal {
namespace {

class SoapRule : public RuleImpl {
 public:
  SoapRule(const SoapOptions& options, int64_t rows, int64_t cols,
           Backend* backend)
      : RuleImpl(OptimizerKind::kSoap, backend),
        options_(options),
        rows_(rows),
        cols_(cols),
        // A side larger than max_precond_dim keeps the identity basis.
        left_(rows <= options.max_precond_dim),
        right_(cols <= options.max_precond_dim) {}

  absl::Status Init() {
    const int64_t numel = rows_ * cols_;
    CANZONA_ASSIGN_OR_RETURN(exp_avg_, AddState("exp_avg", {rows_, cols_}));
    CANZONA_ASSIGN_OR_RETURN(exp_avg_sq_,
                             AddState("exp_avg_sq", {rows_, cols_}));
    int64_t max_dim = 0;
    if (left_) {
      CANZONA_ASSIGN_OR_RETURN(gl_, AddState("GL", {rows_, rows_}));
      CANZONA_ASSIGN_OR_RETURN(ql_, AddState("QL", {rows_, rows_}));
      max_dim = std::max(max_dim, rows_);
    }
    if (right_) {
      CANZONA_ASSIGN_OR_RETURN(gr_, AddState("GR", {cols_, cols_}));
      CANZONA_ASSIGN_OR_RETURN(qr_, AddState("QR", {cols_, cols_}));
      max_dim = std::max(max_dim, cols_);
    }
    CANZONA_ASSIGN_OR_RETURN(projected_, AddScratch(numel));
    CANZONA_ASSIGN_OR_RETURN(tmp_, AddScratch(numel));
    CANZONA_ASSIGN_OR_RETURN(out_, AddScratch(numel));
    if (max_dim > 0) {
      CANZONA_ASSIGN_OR_RETURN(square_a_, AddScratch(max_dim * max_dim));
      CANZONA_ASSIGN_OR_RETURN(square_b_, AddScratch(max_dim * max_dim));
      CANZONA_ASSIGN_OR_RETURN(diag_, AddScratch(max_dim));
    }
    return absl::OkStatus();
  }

  void Retune(const OptimizerConfig& config) override {
    options_ = config.soap;
  }

  absl::Status Step(float* param, const float* grad, double lr,
                    SquaredChange /*change*/) override {
    const int64_t n = rows_ * cols_;
    if (!initialized_) {
      // First call: factors and bases from this gradient, no update, so the
      // current gradient never meets a basis it built.
      CANZONA_RETURN_IF_ERROR(UpdateFactors(grad));
      if (left_) CANZONA_RETURN_IF_ERROR(EigenBasis(rows_, gl_, ql_));
      if (right_) CANZONA_RETURN_IF_ERROR(EigenBasis(cols_, gr_, qr_));
      initialized_ = true;
      return absl::OkStatus();
    }
    CANZONA_RETURN_IF_ERROR(Project(grad, projected_));
    ++step_;
    const int64_t t = step_;
    const double beta1 = options_.beta1;
    const double beta2 = options_.beta2;
    CANZONA_RETURN_IF_ERROR(
        backend_->Axpby(n, static_cast<float>(1 - beta1), projected_,
                        static_cast<float>(beta1), exp_avg_));
    CANZONA_RETURN_IF_ERROR(backend_->EmaSquare(n, static_cast<float>(beta2),
                                                static_cast<float>(1 - beta2),
                                                projected_, exp_avg_sq_));
    double alpha = lr;
    if (options_.correct_bias) {
      alpha =
          lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t));
    }
    // m / (sqrt(v) + eps), projected back (reuses `projected_`).
    CANZONA_RETURN_IF_ERROR(
        backend_->AdamDirection(n, exp_avg_, 1.0f, exp_avg_sq_, 1.0f,
                                static_cast<float>(options_.eps), projected_));
    CANZONA_RETURN_IF_ERROR(ProjectBack(projected_, out_));
    if (options_.normalize_grads) {
      // Unit RMS where out_ lives: a sum read on the host was a round trip
      // per matrix per step.
      CANZONA_RETURN_IF_ERROR(
          backend_->ScaleToNorm(n, nullptr, Backend::Norm::kRms, 1e-30, out_));
    }
    CANZONA_RETURN_IF_ERROR(
        backend_->Axpby(n, static_cast<float>(-alpha), out_, 1.0f, param));
    if (options_.weight_decay > 0) {
      CANZONA_RETURN_IF_ERROR(backend_->Scale(
          n, static_cast<float>(1.0 - lr * options_.weight_decay), param));
    }
    // The preconditioner update, after the step so the current gradient is
    // not in the basis it was projected with.
    CANZONA_RETURN_IF_ERROR(ProjectBack(exp_avg_, out_));
    CANZONA_RETURN_IF_ERROR(backend_->Copy(out_, n, exp_avg_));
    CANZONA_RETURN_IF_ERROR(UpdateFactors(grad));
    if (t % options_.precondition_frequency == 0) {
      if (left_) CANZONA_RETURN_IF_ERROR(RefreshBasis(/*left=*/true));
      if (right_) CANZONA_RETURN_IF_ERROR(RefreshBasis(/*left=*/false));
    }
    CANZONA_RETURN_IF_ERROR(Project(exp_avg_, out_));
    return backend_->Copy(out_, n, exp_avg_);
  }

 protected:
  std::vector<std::pair<std::string, int64_t>> Counters() const override {
    return {{"initialized", initialized_ ? 1 : 0}};
  }
  absl::Status ValidateCounter(const std::string& /*name*/,
                               int64_t value) const override {
    if (value != 0 && value != 1) {
      return absl::InvalidArgumentError(
          "LoadState (soap): counter initialized must be 0 or 1");
    }
    return absl::OkStatus();
  }
  void ApplyCounter(const std::string& name, int64_t value) override {
    if (name == "initialized") initialized_ = value != 0;
  }

 private:
  // GX <- lerp(GX, outer product, 1 - shampoo_beta) for each side.
  absl::Status UpdateFactors(const float* grad) {
    const double beta = options_.resolved_shampoo_beta();
    const float weight = static_cast<float>(1 - beta);
    const float decay = static_cast<float>(beta);
    if (left_) {
      CANZONA_RETURN_IF_ERROR(backend_->Syrk(Transpose::kNo, rows_, cols_,
                                             weight, grad, cols_, decay, gl_,
                                             rows_));
    }
    if (right_) {
      CANZONA_RETURN_IF_ERROR(backend_->Syrk(Transpose::kYes, cols_, rows_,
                                             weight, grad, cols_, decay, gr_,
                                             cols_));
    }
    return absl::OkStatus();
  }

  // q <- eigenvectors of eigh(factor + 1e-30 I), descending eigenvalues.
  absl::Status EigenBasis(int64_t k, const float* factor, float* q) {
    CANZONA_RETURN_IF_ERROR(
        EigenWithRetry(backend_, k, factor, 1.0f, 1e-30f, square_a_, diag_));
    return backend_->SortColumns(k, k, diag_, square_a_, q);
  }

  // One power iteration: sort the basis by diag(Q^T GX Q) descending
  // (permuting exp_avg_sq along that side alike), Q <- qr(GX Q).
  absl::Status RefreshBasis(bool left) {
    const int64_t k = left ? rows_ : cols_;
    const float* factor = left ? gl_ : gr_;
    float* q = left ? ql_ : qr_;
    CANZONA_RETURN_IF_ERROR(backend_->Gemm(Transpose::kNo, Transpose::kNo, k, k,
                                           k, 1.0f, factor, k, q, k, 0.0f,
                                           square_a_, k));
    CANZONA_RETURN_IF_ERROR(backend_->ColumnDots(k, k, q, square_a_, diag_));
    // Sorted where the keys live, no round trip to the host.
    // (GX Q)[:, order] == GX (Q[:, order]): one GEMM serves both.
    CANZONA_RETURN_IF_ERROR(
        backend_->SortColumns(k, k, diag_, square_a_, square_b_));
    CANZONA_RETURN_IF_ERROR(backend_->QrOrthonormalize(k, k, square_b_));
    CANZONA_RETURN_IF_ERROR(backend_->Copy(square_b_, k * k, q));
    if (left) {
      CANZONA_RETURN_IF_ERROR(
          backend_->SortRows(rows_, cols_, diag_, exp_avg_sq_, tmp_));
    } else {
      CANZONA_RETURN_IF_ERROR(
          backend_->SortColumns(rows_, cols_, diag_, exp_avg_sq_, tmp_));
    }
    return backend_->Copy(tmp_, rows_ * cols_, exp_avg_sq_);
  }

  // out = QL^T x QR (identity sides skipped); out must not alias x or tmp_.
  absl::Status Project(const float* x, float* out) {
    return Rotate(x, out, Transpose::kYes, Transpose::kNo);
  }
  // out = QL x QR^T.
  absl::Status ProjectBack(const float* x, float* out) {
    return Rotate(x, out, Transpose::kNo, Transpose::kYes);
  }
  absl::Status Rotate(const float* x, float* out, Transpose left_op,
                      Transpose right_op) {
    const float* source = x;
    if (left_) {
      float* target = right_ ? tmp_ : out;
      CANZONA_RETURN_IF_ERROR(
          backend_->Gemm(left_op, Transpose::kNo, rows_, cols_, rows_, 1.0f,
                         ql_, rows_, source, cols_, 0.0f, target, cols_));
      source = target;
    }
    if (right_) {
      CANZONA_RETURN_IF_ERROR(backend_->Gemm(Transpose::kNo, right_op, rows_,
                                             cols_, cols_, 1.0f, source, cols_,
                                             qr_, cols_, 0.0f, out, cols_));
      source = out;
    }
    if (source != out) {
      CANZONA_RETURN_IF_ERROR(backend_->Copy(source, rows_ * cols_, out));
    }
    return absl::OkStatus();
  }

  SoapOptions options_;
  int64_t rows_;
  int64_t cols_;
  bool left_;
  bool right_;
  bool initialized_ = false;
  float* exp_avg_ = nullptr;
  float* exp_avg_sq_ = nullptr;
  float* gl_ = nullptr;
  float* ql_ = nullptr;
  float* gr_ = nullptr;
  float* qr_ = nullptr;
  // Scratch.
  float* projected_ = nullptr;
  float* tmp_ = nullptr;
  float* out_ = nullptr;
  float* square_a_ = nullptr;
  float* square_b_ = nullptr;
  float* diag_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RuleImpl>> CreateSoapRule(
    const SoapOptions& options, int64_t rows, int64_t cols, Backend* backend,
    SharedScratch* scratch) {
  auto rule = std::make_unique<SoapRule>(options, rows, cols, backend);
  rule->ShareScratch(scratch);
  CANZONA_RETURN_IF_ERROR(rule->Init());
  return rule;
}

}  // namespace canzona::optim_internal
