#include "tests/unit/kernels/backend_reference.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace canzona::backend_reference {

std::string ShapeName(int64_t rows, int64_t cols) {
  return absl::StrCat(rows, "x", cols);
}

std::vector<float> RandomNormal(int64_t n, uint32_t seed, float mean,
                                float stddev) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    do {
      x = dist(gen);
    } while (x == 0.0f);
  }
  return v;
}

std::vector<float> RandomSymmetric(int64_t n, uint32_t seed) {
  const std::vector<float> b = RandomNormal(n * n, seed);
  std::vector<float> s(b.size());
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      s[i * n + j] = 0.5f * (b[i * n + j] + b[j * n + i]);
    }
  }
  return s;
}

std::vector<int64_t> RandomPermutation(int64_t n, uint32_t seed) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 gen(seed);
  std::shuffle(perm.begin(), perm.end(), gen);
  return perm;
}

Matrix ToDouble(const std::vector<float>& v) {
  return Matrix(v.begin(), v.end());
}

double FrobeniusNorm(const Matrix& a) {
  double s = 0.0;
  for (double x : a) s += x * x;
  return std::sqrt(s);
}

double RelativeError(const std::vector<float>& a, const Matrix& b) {
  double diff = 0.0, ref = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    ref += b[i] * b[i];
  }
  return std::sqrt(diff / ref);
}

Matrix MatMul(const Matrix& a, const Matrix& b, int64_t m, int64_t n,
              int64_t k) {
  Matrix c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t p = 0; p < k; ++p) {
      const double aip = a[i * k + p];
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += aip * b[p * n + j];
    }
  }
  return c;
}

Matrix TransposeOf(const Matrix& a, int64_t rows, int64_t cols) {
  Matrix t(a.size());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = a[i * cols + j];
  }
  return t;
}

Shape Stored(Transpose t, int64_t r, int64_t c) {
  return t == Transpose::kYes ? Shape{c, r} : Shape{r, c};
}

double OpAt(const std::vector<float>& x, int64_t ld, Transpose t, int64_t i,
            int64_t j) {
  return t == Transpose::kYes ? x[j * ld + i] : x[i * ld + j];
}

Matrix NewtonSchulzReference(const NewtonSchulzSpec& spec,
                             const std::vector<float>& input, int64_t rows,
                             int64_t cols) {
  const bool transposed = rows > cols;
  const int64_t m = transposed ? cols : rows, n = transposed ? rows : cols;
  Matrix x = ToDouble(input);
  if (transposed) x = TransposeOf(x, rows, cols);
  const double denom = spec.norm_scale * FrobeniusNorm(x) + spec.norm_eps;
  for (double& e : x) e /= denom;
  for (const auto& [a, b, c] : spec.coefficients) {
    const Matrix gram = MatMul(x, TransposeOf(x, m, n), m, m, n);
    const Matrix gram2 = MatMul(gram, gram, m, m, m);
    Matrix poly(gram.size());
    for (size_t i = 0; i < poly.size(); ++i) {
      poly[i] = b * gram[i] + c * gram2[i];
    }
    const Matrix bx = MatMul(poly, x, m, n, m);
    for (size_t i = 0; i < x.size(); ++i) x[i] = a * x[i] + bx[i];
  }
  return transposed ? TransposeOf(x, m, n) : x;
}

std::vector<double> SingularValues(const Matrix& x, int64_t rows,
                                   int64_t cols) {
  const bool wide = rows <= cols;
  const int64_t n = wide ? rows : cols;
  const Matrix xt = TransposeOf(x, rows, cols);
  Matrix g =
      wide ? MatMul(x, xt, rows, rows, cols) : MatMul(xt, x, cols, cols, rows);
  // Cyclic Jacobi rotations until the off-diagonal part is negligible.
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0.0, diag = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      diag += g[i * n + i] * g[i * n + i];
      for (int64_t j = 0; j < n; ++j) {
        if (i != j) off += g[i * n + j] * g[i * n + j];
      }
    }
    if (off <= 1e-30 * diag || off == 0.0) break;
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t q = p + 1; q < n; ++q) {
        const double apq = g[p * n + q];
        if (apq == 0.0) continue;
        const double theta = (g[q * n + q] - g[p * n + p]) / (2.0 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) /
                         (std::abs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c;
        for (int64_t k = 0; k < n; ++k) {  // columns p, q
          const double gkp = g[k * n + p], gkq = g[k * n + q];
          g[k * n + p] = c * gkp - s * gkq;
          g[k * n + q] = s * gkp + c * gkq;
        }
        for (int64_t k = 0; k < n; ++k) {  // rows p, q
          const double gpk = g[p * n + k], gqk = g[q * n + k];
          g[p * n + k] = c * gpk - s * gqk;
          g[q * n + k] = s * gpk + c * gqk;
        }
      }
    }
  }
  std::vector<double> sv(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    sv[i] = std::sqrt(std::max(0.0, g[i * n + i]));
  std::sort(sv.rbegin(), sv.rend());
  return sv;
}

NewtonSchulzSpec QuinticSpec(NsPrecision precision) {
  NewtonSchulzSpec spec;
  spec.coefficients.assign(5, {3.4445f, -4.7750f, 2.0315f});
  spec.precision = precision;
  return spec;
}

std::pair<double, double> EigenErrors(const std::vector<float>& a,
                                      const std::vector<float>& q,
                                      const std::vector<float>& lam,
                                      int64_t n) {
  const Matrix aq = MatMul(ToDouble(a), ToDouble(q), n, n, n);
  double residual = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double r = aq[i * n + j] - double{q[i * n + j]} * lam[j];
      residual += r * r;
    }
  }
  const Matrix qd = ToDouble(q);
  const Matrix qtq = MatMul(TransposeOf(qd, n, n), qd, n, n, n);
  double orth = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double r = qtq[i * n + j] - (i == j ? 1.0 : 0.0);
      orth += r * r;
    }
  }
  return {std::sqrt(residual) / FrobeniusNorm(ToDouble(a)), std::sqrt(orth)};
}

std::vector<double> HouseholderRDiagonal(const std::vector<float>& a_in,
                                         int64_t rows, int64_t cols) {
  Matrix a = ToDouble(a_in);
  std::vector<double> diag(static_cast<size_t>(cols));
  for (int64_t j = 0; j < cols; ++j) {
    const double alpha = a[j * cols + j];
    double xnorm2 = 0.0;
    for (int64_t i = j + 1; i < rows; ++i) {
      xnorm2 += a[i * cols + j] * a[i * cols + j];
    }
    if (xnorm2 == 0.0) {
      diag[j] = alpha;
      continue;
    }
    const double beta =
        -std::copysign(std::sqrt(alpha * alpha + xnorm2), alpha);
    const double tau = (beta - alpha) / beta;
    std::vector<double> v(static_cast<size_t>(rows), 0.0);
    v[j] = 1.0;
    for (int64_t i = j + 1; i < rows; ++i) {
      v[i] = a[i * cols + j] / (alpha - beta);
    }
    for (int64_t c = j; c < cols; ++c) {
      double dot = 0.0;
      for (int64_t i = j; i < rows; ++i) dot += v[i] * a[i * cols + c];
      for (int64_t i = j; i < rows; ++i) a[i * cols + c] -= tau * v[i] * dot;
    }
    diag[j] = beta;
  }
  return diag;
}

}  // namespace canzona::backend_reference
