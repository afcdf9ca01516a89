// Shampoo (Distributed Shampoo's default root-inverse path) with blocking,
// grafting, first moment and decoupled weight decay. Each block of at most
// max_preconditioner_dim x max_preconditioner_dim is an independent Shampoo
// problem with its own factors, grafting state and graft norm.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "server/optim/rule_impl.h"

namespace canzona::optim_internal {
namespace {

// torch.split semantics: full blocks of `block`, then the remainder.
std::vector<std::pair<int64_t, int64_t>> Split(int64_t size, int64_t block) {
  std::vector<std::pair<int64_t, int64_t>> parts;  // (offset, length)
  for (int64_t offset = 0; offset < size; offset += block) {
    parts.emplace_back(offset, std::min(block, size - offset));
  }
  return parts;
}

class ShampooRule : public RuleImpl {
 public:
  ShampooRule(const ShampooOptions& options, int64_t rows, int64_t cols,
              Backend* backend)
      : RuleImpl(OptimizerKind::kShampoo, backend),
        options_(options),
        rows_(rows),
        cols_(cols) {}

  absl::Status Init() {
    const auto row_parts = Split(rows_, options_.max_preconditioner_dim);
    const auto col_parts = Split(cols_, options_.max_preconditioner_dim);
    int64_t max_dim = 0;
    int64_t max_block = 0;
    for (size_t i = 0; i < row_parts.size(); ++i) {
      for (size_t j = 0; j < col_parts.size(); ++j) {
        Block b;
        b.row0 = row_parts[i].first;
        b.rows = row_parts[i].second;
        b.col0 = col_parts[j].first;
        b.cols = col_parts[j].second;
        const std::string prefix = absl::StrCat("block.", i, ".", j, ".");
        CANZONA_ASSIGN_OR_RETURN(b.l, AddState(prefix + "L", {b.rows, b.rows}));
        CANZONA_ASSIGN_OR_RETURN(b.r, AddState(prefix + "R", {b.cols, b.cols}));
        CANZONA_ASSIGN_OR_RETURN(b.l_inv,
                                 AddState(prefix + "L_inv", {b.rows, b.rows}));
        CANZONA_ASSIGN_OR_RETURN(b.r_inv,
                                 AddState(prefix + "R_inv", {b.cols, b.cols}));
        // Before the first root inverse the preconditioners are identities.
        CANZONA_RETURN_IF_ERROR(backend_->AddIdentity(b.rows, 1.0f, b.l_inv));
        CANZONA_RETURN_IF_ERROR(backend_->AddIdentity(b.cols, 1.0f, b.r_inv));
        if (options_.beta1 != 0) {
          CANZONA_ASSIGN_OR_RETURN(
              b.momentum, AddState(prefix + "momentum", {b.rows, b.cols}));
        }
        if (options_.grafting != Grafting::kNone) {
          CANZONA_ASSIGN_OR_RETURN(
              b.graft, AddState(prefix + "graft", {b.rows, b.cols}));
        }
        max_dim = std::max({max_dim, b.rows, b.cols});
        max_block = std::max(max_block, b.rows * b.cols);
        blocks_.push_back(b);
      }
    }
    const bool column_split = col_parts.size() > 1;
    if (column_split) {
      CANZONA_ASSIGN_OR_RETURN(grad_block_, AddScratch(max_block));
      CANZONA_ASSIGN_OR_RETURN(dir_block_, AddScratch(max_block));
    }
    CANZONA_ASSIGN_OR_RETURN(direction_, AddScratch(rows_ * cols_));
    CANZONA_ASSIGN_OR_RETURN(graft_dir_, AddScratch(max_block));
    CANZONA_ASSIGN_OR_RETURN(product_, AddScratch(max_block));
    CANZONA_ASSIGN_OR_RETURN(eigvecs_, AddScratch(max_dim * max_dim));
    CANZONA_ASSIGN_OR_RETURN(scaled_, AddScratch(max_dim * max_dim));
    CANZONA_ASSIGN_OR_RETURN(eigvals_, AddScratch(max_dim));
    CANZONA_ASSIGN_OR_RETURN(roots_, AddScratch(max_dim));
    return absl::OkStatus();
  }

  void Retune(const OptimizerConfig& config) override {
    options_ = config.shampoo;
  }

  absl::Status Step(float* param, const float* grad, double lr,
                    SquaredChange /*change*/) override {
    ++step_;
    const int64_t t = step_;
    const double beta2 = options_.beta2;
    const float factor_weight =
        beta2 == 1.0 ? 1.0f : static_cast<float>(1 - beta2);
    const float factor_decay = beta2 == 1.0 ? 1.0f : static_cast<float>(beta2);
    const double bc2 = beta2 < 1.0 ? 1.0 - std::pow(beta2, t) : 1.0;
    const int64_t start = options_.start_step();
    const int64_t freq = options_.precondition_frequency;
    const bool precondition = (t % freq == 0 && t > start) || t == start;
    const double bc1 =
        options_.beta1 != 0 ? 1.0 - std::pow(options_.beta1, t) : 1.0;
    const double gb2 = options_.grafting_beta2;
    const double bcg =
        options_.grafting == Grafting::kAdam ? 1.0 - std::pow(gb2, t) : 1.0;

    for (const Block& b : blocks_) {
      const int64_t n = b.rows * b.cols;
      // A block spanning all columns is contiguous in the full matrix.
      const bool contiguous = b.cols == cols_;
      const float* g = grad + b.row0 * cols_ + b.col0;
      if (!contiguous) {
        CANZONA_RETURN_IF_ERROR(
            backend_->Copy2D(b.rows, b.cols, g, cols_, grad_block_, b.cols));
        g = grad_block_;
      }
      CANZONA_RETURN_IF_ERROR(backend_->Syrk(Transpose::kNo, b.rows, b.cols,
                                             factor_weight, g, b.cols,
                                             factor_decay, b.l, b.rows));
      CANZONA_RETURN_IF_ERROR(backend_->Syrk(Transpose::kYes, b.cols, b.rows,
                                             factor_weight, g, b.cols,
                                             factor_decay, b.r, b.cols));
      if (options_.grafting == Grafting::kAdam) {
        CANZONA_RETURN_IF_ERROR(backend_->EmaSquare(n, static_cast<float>(gb2),
                                                    static_cast<float>(1 - gb2),
                                                    g, b.graft));
      } else if (options_.grafting == Grafting::kAdagrad) {
        CANZONA_RETURN_IF_ERROR(backend_->EmaSquare(n, 1.0f, 1.0f, g, b.graft));
      }
      if (precondition) {
        CANZONA_RETURN_IF_ERROR(RootInverse(b.rows, b.l, bc2, b.l_inv));
        CANZONA_RETURN_IF_ERROR(RootInverse(b.cols, b.r, bc2, b.r_inv));
      }
      // Gh = gh_scale * gh (the bias correction is folded into later
      // kernels instead of materialized).
      const float* gh = g;
      float gh_scale = 1.0f;
      if (b.momentum != nullptr) {
        CANZONA_RETURN_IF_ERROR(
            backend_->Lerp(n, b.momentum, g,
                           static_cast<float>(1 - options_.beta1), b.momentum));
        gh = b.momentum;
        gh_scale = static_cast<float>(1.0 / bc1);
      }
      float* out = contiguous ? direction_ + b.row0 * cols_ : dir_block_;
      const bool grafting = options_.grafting != Grafting::kNone;
      // Graft direction Dg = Gh / (sqrt(V / bcg) + grafting_epsilon).
      float* graft_out = t < start ? out : graft_dir_;
      if (grafting) {
        CANZONA_RETURN_IF_ERROR(backend_->AdamDirection(
            n, gh, gh_scale, b.graft, static_cast<float>(1.0 / bcg),
            static_cast<float>(options_.grafting_epsilon), graft_out));
      }
      if (t < start) {
        if (!grafting) {
          CANZONA_RETURN_IF_ERROR(backend_->Copy(gh, n, out));
          CANZONA_RETURN_IF_ERROR(backend_->Scale(n, gh_scale, out));
        }
      } else {
        CANZONA_RETURN_IF_ERROR(backend_->Gemm(
            Transpose::kNo, Transpose::kNo, b.rows, b.cols, b.rows, gh_scale,
            b.l_inv, b.rows, gh, b.cols, 0.0f, product_, b.cols));
        CANZONA_RETURN_IF_ERROR(backend_->Gemm(
            Transpose::kNo, Transpose::kNo, b.rows, b.cols, b.cols, 1.0f,
            product_, b.cols, b.r_inv, b.cols, 0.0f, out, b.cols));
        if (grafting) {
          // The graft's norm, taken where out lives: two sums read on the
          // host were two round trips per block per step.
          CANZONA_RETURN_IF_ERROR(backend_->ScaleToNorm(
              n, graft_dir_, Backend::Norm::kL2, 1e-16, out));
        }
      }
      if (!contiguous) {
        CANZONA_RETURN_IF_ERROR(
            backend_->Copy2D(b.rows, b.cols, out, b.cols,
                             direction_ + b.row0 * cols_ + b.col0, cols_));
      }
    }
    // D <- D + wd p; p <- p - lr D, as one kernel.
    return backend_->Axpby(rows_ * cols_, static_cast<float>(-lr), direction_,
                           static_cast<float>(1.0 - lr * options_.weight_decay),
                           param);
  }

 private:
  struct Block {
    int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
    float* l = nullptr;
    float* r = nullptr;
    float* l_inv = nullptr;
    float* r_inv = nullptr;
    float* momentum = nullptr;  // beta1 != 0
    float* graft = nullptr;     // grafting != none
  };

  // inverse = Q diag(lam^(-1/4)) Q^T for (lam, Q) = eigh(factor / bc2 +
  // epsilon I), eigenvalues floored so the smallest is epsilon.
  absl::Status RootInverse(int64_t n, const float* factor, double bc2,
                           float* inverse) {
    const double epsilon = options_.epsilon;
    CANZONA_RETURN_IF_ERROR(
        EigenWithRetry(backend_, n, factor, static_cast<float>(1.0 / bc2),
                       static_cast<float>(epsilon), eigvecs_, eigvals_));
    // Lifted and rooted where they live: no round trip to the host after
    // the solver's (SymmetricEigen fails on a non-finite eigenvalue).
    CANZONA_RETURN_IF_ERROR(
        backend_->LiftedPower(n, eigvals_, epsilon, -0.25, roots_));
    CANZONA_RETURN_IF_ERROR(backend_->Copy(eigvecs_, n * n, scaled_));
    CANZONA_RETURN_IF_ERROR(backend_->ScaleColumns(n, n, roots_, scaled_));
    return backend_->Gemm(Transpose::kNo, Transpose::kYes, n, n, n, 1.0f,
                          scaled_, n, eigvecs_, n, 0.0f, inverse, n);
  }

  ShampooOptions options_;
  int64_t rows_;
  int64_t cols_;
  std::vector<Block> blocks_;
  // Scratch.
  float* grad_block_ = nullptr;  // column-split blocks only
  float* dir_block_ = nullptr;   // column-split blocks only
  float* direction_ = nullptr;   // full rows x cols
  float* graft_dir_ = nullptr;
  float* product_ = nullptr;
  float* eigvecs_ = nullptr;
  float* scaled_ = nullptr;
  float* eigvals_ = nullptr;
  float* roots_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RuleImpl>> CreateShampooRule(
    const ShampooOptions& options, int64_t rows, int64_t cols, Backend* backend,
    SharedScratch* scratch) {
  auto rule = std::make_unique<ShampooRule>(options, rows, cols, backend);
  rule->ShareScratch(scratch);
  CANZONA_RETURN_IF_ERROR(rule->Init());
  return rule;
}

}  // namespace canzona::optim_internal
