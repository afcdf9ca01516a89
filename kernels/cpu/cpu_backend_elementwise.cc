// The cpu backend's elementwise loops and sums.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend_impl.h"

namespace canzona {
namespace cpu_internal {

absl::Status CpuBackend::DoLerp(int64_t n, const float* a, const float* b,
                                float weight, float* out) {
  // torch picks the formula that is exact at its nearer endpoint
  // (weight 0 -> a, weight 1 -> b).
  if (std::abs(weight) < 0.5f) {
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + weight * (b[i] - a[i]);
  } else {
    const float one_minus = 1.0f - weight;
    for (int64_t i = 0; i < n; ++i) {
      out[i] = b[i] - (b[i] - a[i]) * one_minus;
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoNesterovMomentum(int64_t n, float beta,
                                            const float* grad, float* momentum,
                                            float* out) {
  // The two Lerps themselves (on the host the saved passes matter little;
  // the bits are theirs by construction). Elementwise, so `out` may alias
  // either input.
  CANZONA_RETURN_IF_ERROR(DoLerp(n, momentum, grad, 1.0f - beta, momentum));
  return DoLerp(n, grad, momentum, beta, out);
}

absl::Status CpuBackend::DoAxpby(int64_t n, float alpha, const float* x,
                                 float beta, float* y, SquaredChange change) {
  ApplyEach(n, y, change,
            [=](int64_t i) { y[i] = alpha * x[i] + beta * y[i]; });
  return absl::OkStatus();
}

absl::Status CpuBackend::DoScale(int64_t n, float alpha, float* x) {
  for (int64_t i = 0; i < n; ++i) x[i] = alpha * x[i];
  return absl::OkStatus();
}

absl::Status CpuBackend::DoEmaSquare(int64_t n, float decay, float weight,
                                     const float* g, float* v) {
  // v.mul_(decay).addcmul_(g, g, value=weight): (weight * g) * g.
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] * decay + weight * g[i] * g[i];
  return absl::OkStatus();
}

absl::Status CpuBackend::DoAdamDirection(int64_t n, const float* m,
                                         float m_scale, const float* v,
                                         float v_scale, float eps, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = (m[i] * m_scale) / (std::sqrt(v[i] * v_scale) + eps);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoAdamWStep(int64_t n, float lr, float beta1,
                                     float beta2, float eps, float weight_decay,
                                     int64_t step, const float* g, float* p,
                                     float* m, float* v, SquaredChange change) {
  // torch computes the scalars as Python floats (double) and rounds each to
  // float when it meets a float32 tensor; mirror that exactly.
  const double lr_d = lr;
  const double steps = static_cast<double>(step);
  const float decay = static_cast<float>(1.0 - lr_d * weight_decay);
  const float m_weight = static_cast<float>(1.0 - static_cast<double>(beta1));
  const float v_weight = static_cast<float>(1.0 - static_cast<double>(beta2));
  const double bias_correction1 = 1.0 - std::pow(double{beta1}, steps);
  const double bias_correction2 = 1.0 - std::pow(double{beta2}, steps);
  const float neg_step_size = static_cast<float>(-(lr_d / bias_correction1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  // exp_avg.lerp_(grad, 1 - beta1) takes the small-weight branch unless
  // beta1 <= 0.5.
  const bool small_weight = std::abs(m_weight) < 0.5f;
  const float m_one_minus = 1.0f - m_weight;
  ApplyEach(n, p, change, [=](int64_t i) {
    const float gi = g[i];
    const float pi = p[i] * decay;
    const float mi = small_weight ? m[i] + m_weight * (gi - m[i])
                                  : gi - (gi - m[i]) * m_one_minus;
    const float vi = v[i] * beta2 + v_weight * gi * gi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    p[i] = pi + neg_step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
  });
  return absl::OkStatus();
}

absl::StatusOr<double> CpuBackend::DoSumSquares(int64_t n, const float* x) {
  return SumSquaresOf(n, [x](int64_t i) { return x[i]; });
}

absl::Status CpuBackend::DoEnqueueSquaredDistance(int64_t n, const float* a,
                                                  const float* b) {
  // a - b rounded once: Axpby's 1 * a + -1 * b, bit for bit.
  QueueHostSum(SumSquaresOf(n, [a, b](int64_t i) { return a[i] - b[i]; }));
  return absl::OkStatus();
}

absl::StatusOr<bool> CpuBackend::DoAllFinite(int64_t n, const float* x) {
  // No early exit: a branch-free AND over the array lets the loop
  // vectorize, and non-finite values are the rare case.
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(x[i]);
  return finite;
}

absl::Status CpuBackend::DoScaleToNorm(int64_t n, const float* reference,
                                       Norm norm, double eps, float* x) {
  const double divisor = norm == Norm::kRms ? static_cast<double>(n) : 1.0;
  double numerator = 1.0;
  if (reference != nullptr) {
    CANZONA_ASSIGN_OR_RETURN(const double sum, DoSumSquares(n, reference));
    numerator = std::sqrt(sum / divisor);
  }
  CANZONA_ASSIGN_OR_RETURN(const double sum, DoSumSquares(n, x));
  return DoScale(
      n, static_cast<float>(numerator / (std::sqrt(sum / divisor) + eps)), x);
}

absl::Status CpuBackend::DoLiftedPower(int64_t n, const float* x, double floor,
                                       double exponent, float* out) {
  double lowest = std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    lowest = std::fmin(lowest, static_cast<double>(x[i]));
  }
  const bool lift = lowest < floor;
  for (int64_t i = 0; i < n; ++i) {
    double v = x[i];
    if (lift) v = v - lowest + floor;
    out[i] = static_cast<float>(std::pow(v, exponent));
  }
  return absl::OkStatus();
}

}  // namespace cpu_internal
}  // namespace canzona
