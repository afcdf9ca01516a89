// Float64 references and random test data for the Backend tests: naive
// loops written here, independent of any backend, that the conformance
// suite (backend_conformance.h) and the backend-specific tests compare
// against.
//
// Thread-safety: stateless functions.
#ifndef CANZONA_TESTS_UNIT_KERNELS_BACKEND_REFERENCE_H_
#define CANZONA_TESTS_UNIT_KERNELS_BACKEND_REFERENCE_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace canzona::backend_reference {

using Matrix = std::vector<double>;  // row-major, dense

struct Shape {
  int64_t rows;
  int64_t cols;
};
std::string ShapeName(int64_t rows, int64_t cols);  // "13x5"

// Normal values, resampled away from exact zero so that no test passes by
// multiplying zeros.
std::vector<float> RandomNormal(int64_t n, uint32_t seed, float mean = 0.0f,
                                float stddev = 1.0f);
// Random symmetric n x n matrix (B + B^T) / 2.
std::vector<float> RandomSymmetric(int64_t n, uint32_t seed);
std::vector<int64_t> RandomPermutation(int64_t n, uint32_t seed);

Matrix ToDouble(const std::vector<float>& v);
double FrobeniusNorm(const Matrix& a);
// ||a - b||_F / ||b||_F.
double RelativeError(const std::vector<float>& a, const Matrix& b);
// c[m x n] = a[m x k] * b[k x n], dense.
Matrix MatMul(const Matrix& a, const Matrix& b, int64_t m, int64_t n,
              int64_t k);
Matrix TransposeOf(const Matrix& a, int64_t rows, int64_t cols);

// The stored (rows, cols) of an operand whose op() is r x c.
Shape Stored(Transpose t, int64_t r, int64_t c);
// Element (i, j) of op(x) for x stored with leading dim ld.
double OpAt(const std::vector<float>& x, int64_t ld, Transpose t, int64_t i,
            int64_t j);

// The Newton-Schulz iteration of `spec` (precision ignored) on one matrix.
Matrix NewtonSchulzReference(const NewtonSchulzSpec& spec,
                             const std::vector<float>& input, int64_t rows,
                             int64_t cols);
// The classic quintic coefficients (3.4445, -4.7750, 2.0315), 5 steps.
NewtonSchulzSpec QuinticSpec(NsPrecision precision = NsPrecision::kFloat32);

// Singular values of the rows x cols matrix x, descending (min(rows, cols)
// of them): square roots of the eigenvalues of its smaller Gram matrix, by
// cyclic Jacobi in double.
std::vector<double> SingularValues(const Matrix& x, int64_t rows, int64_t cols);

// Residual ||A Q - Q diag(lam)||_F / ||A||_F and ||Q^T Q - I||_F of an
// eigendecomposition with eigenvectors as the columns of q.
std::pair<double, double> EigenErrors(const std::vector<float>& a,
                                      const std::vector<float>& q,
                                      const std::vector<float>& lam, int64_t n);

// Householder QR in double with LAPACK dlarfg's convention: for column j,
// beta = -sign(alpha) * ||(alpha, x)||, and H = I when x == 0 (beta = alpha).
// Returns R's diagonal (the betas).
std::vector<double> HouseholderRDiagonal(const std::vector<float>& a,
                                         int64_t rows, int64_t cols);

}  // namespace canzona::backend_reference

#endif  // CANZONA_TESTS_UNIT_KERNELS_BACKEND_REFERENCE_H_
