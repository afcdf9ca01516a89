// Float64 references of the four update rules, written from the formulas of
// server/DESIGN.md section 3 with naive loops and our own linear algebra
// (Jacobi eigensolver, Householder QR with LAPACK's sign convention,
// Newton-Schulz), independent of the code under test and of the backends.
//
// Thread-safety: plain values; not thread-safe.
#ifndef CANZONA_TESTS_UNIT_OPTIM_REFERENCE_H_
#define CANZONA_TESTS_UNIT_OPTIM_REFERENCE_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "server/optim/optimizer_config.h"

namespace canzona::optim_test {

// Dense row-major float64 matrix.
struct Mat {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<double> a;

  Mat() = default;
  Mat(int64_t r, int64_t c) : rows(r), cols(c), a(r * c, 0.0) {}
  double& operator()(int64_t i, int64_t j) { return a[i * cols + j]; }
  double operator()(int64_t i, int64_t j) const { return a[i * cols + j]; }
};

Mat Identity(int64_t n);
Mat Transposed(const Mat& x);
Mat MatMul(const Mat& x, const Mat& y);
Mat FromFloats(int64_t rows, int64_t cols, const std::vector<float>& data);
double FrobeniusNorm(const Mat& x);

// Symmetric eigendecomposition by cyclic Jacobi: eigenvalues ascending,
// vectors as columns.
void JacobiEigen(const Mat& s, std::vector<double>* eigenvalues, Mat* vectors);

// Thin Q of the Householder QR of x (rows >= cols) with LAPACK's convention
// (dlarfg: beta = -sign(alpha) * ||(alpha, x)||, tau = 0 when x is zero).
Mat HouseholderQ(const Mat& x);

// Newton-Schulz as in NewtonSchulzSpec, in float64.
Mat NewtonSchulz(const Mat& u, const std::vector<std::array<double, 3>>& coeffs,
                 double norm_scale, double norm_eps);

// The coefficient triples of a set for `steps` steps, as published with
// each set (server/DESIGN.md section 3.1).
std::vector<std::array<double, 3>> Coefficients(NsCoefficients set,
                                                int64_t steps);

// Singular values of x (descending), via the eigenvalues of the smaller Gram.
std::vector<double> SingularValues(const Mat& x);

// One reference rule: steps `p` with gradient `g` (same shape as p).
class RefRule {
 public:
  virtual ~RefRule() = default;
  virtual void Step(Mat& p, const Mat& g, double lr) = 0;
};

class MuonRef : public RefRule {
 public:
  MuonRef(const MuonOptions& o, int64_t rows, int64_t cols);
  void Step(Mat& p, const Mat& g, double lr) override;

 private:
  MuonOptions o_;
  Mat m_;
};

class AdamWRef : public RefRule {
 public:
  AdamWRef(const AdamWOptions& o, int64_t numel);
  void Step(Mat& p, const Mat& g, double lr) override;

 private:
  AdamWOptions o_;
  Mat m_, v_;
  int64_t t_ = 0;
};

class ShampooRef : public RefRule {
 public:
  ShampooRef(const ShampooOptions& o, int64_t rows, int64_t cols);
  void Step(Mat& p, const Mat& g, double lr) override;

 private:
  struct Block {
    int64_t r0, rows, c0, cols;
    Mat l, r, l_inv, r_inv, m, v;
  };
  Mat RootInverse(const Mat& f, double bc2) const;
  ShampooOptions o_;
  std::vector<Block> blocks_;
  int64_t t_ = 0;
};

class SoapRef : public RefRule {
 public:
  SoapRef(const SoapOptions& o, int64_t rows, int64_t cols);
  void Step(Mat& p, const Mat& g, double lr) override;

  bool left() const { return left_; }
  bool right() const { return right_; }
  const Mat& gl() const { return gl_; }
  const Mat& gr() const { return gr_; }
  const Mat& ql() const { return ql_; }
  const Mat& qr() const { return qr_; }
  // Replaces the bases chosen at the first call (where a factor is singular
  // its null-space basis is arbitrary; tests seed the implementation's).
  void SetBases(const Mat& ql, const Mat& qr) {
    ql_ = ql;
    qr_ = qr;
  }

 private:
  Mat Proj(const Mat& x) const;
  Mat Back(const Mat& x) const;
  void UpdateFactors(const Mat& g);
  void Refresh(bool left);
  SoapOptions o_;
  int64_t rows_, cols_;
  bool left_, right_;
  bool initialized_ = false;
  int64_t t_ = 0;
  Mat m_, v_, gl_, gr_, ql_, qr_;
};

// Descending-eigenvalue eigenbasis of s (columns), as SOAP's first call.
Mat DescendingEigenbasis(const Mat& s, std::vector<double>* eigenvalues);

}  // namespace canzona::optim_test

#endif  // CANZONA_TESTS_UNIT_OPTIM_REFERENCE_H_
