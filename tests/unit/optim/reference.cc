#include "tests/unit/optim/reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace canzona::optim_test {

Mat Identity(int64_t n) {
  Mat x(n, n);
  for (int64_t i = 0; i < n; ++i) x(i, i) = 1.0;
  return x;
}

Mat Transposed(const Mat& x) {
  Mat y(x.cols, x.rows);
  for (int64_t i = 0; i < x.rows; ++i) {
    for (int64_t j = 0; j < x.cols; ++j) y(j, i) = x(i, j);
  }
  return y;
}

Mat MatMul(const Mat& x, const Mat& y) {
  Mat z(x.rows, y.cols);
  for (int64_t i = 0; i < x.rows; ++i) {
    for (int64_t k = 0; k < x.cols; ++k) {
      const double xik = x(i, k);
      for (int64_t j = 0; j < y.cols; ++j) z(i, j) += xik * y(k, j);
    }
  }
  return z;
}

Mat FromFloats(int64_t rows, int64_t cols, const std::vector<float>& data) {
  Mat x(rows, cols);
  for (size_t i = 0; i < x.a.size(); ++i) x.a[i] = data[i];
  return x;
}

double FrobeniusNorm(const Mat& x) {
  double s = 0;
  for (double v : x.a) s += v * v;
  return std::sqrt(s);
}

namespace {

Mat Lerp(const Mat& a, const Mat& b, double w) {
  Mat out = a;
  for (size_t i = 0; i < out.a.size(); ++i)
    out.a[i] = a.a[i] + w * (b.a[i] - a.a[i]);
  return out;
}

Mat Scaled(const Mat& x, double s) {
  Mat y = x;
  for (double& v : y.a) v *= s;
  return y;
}

// torch.split: full blocks, then the remainder.
std::vector<std::pair<int64_t, int64_t>> Split(int64_t size, int64_t block) {
  std::vector<std::pair<int64_t, int64_t>> parts;
  for (int64_t o = 0; o < size; o += block) {
    parts.emplace_back(o, std::min(block, size - o));
  }
  return parts;
}

}  // namespace

void JacobiEigen(const Mat& s, std::vector<double>* eigenvalues, Mat* vectors) {
  const int64_t n = s.rows;
  Mat a = s;
  Mat v = Identity(n);
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, total = 0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        total += a(i, j) * a(i, j);
        if (i != j) off += a(i, j) * a(i, j);
      }
    }
    if (off <= 1e-30 * total || off == 0) break;
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t q = p + 1; q < n; ++q) {
        const double apq = a(p, q);
        if (apq == 0) continue;
        const double theta = (a(q, q) - a(p, p)) / (2 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) /
                         (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1);
        const double sn = t * c;
        // a <- J^T a J with J the rotation in the (p, q) plane.
        for (int64_t k = 0; k < n; ++k) {
          const double akp = a(k, p), akq = a(k, q);
          a(k, p) = c * akp - sn * akq;
          a(k, q) = sn * akp + c * akq;
        }
        for (int64_t k = 0; k < n; ++k) {
          const double apk = a(p, k), aqk = a(q, k);
          a(p, k) = c * apk - sn * aqk;
          a(q, k) = sn * apk + c * aqk;
        }
        for (int64_t k = 0; k < n; ++k) {
          const double vkp = v(k, p), vkq = v(k, q);
          v(k, p) = c * vkp - sn * vkq;
          v(k, q) = sn * vkp + c * vkq;
        }
      }
    }
  }
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t x, int64_t y) { return a(x, x) < a(y, y); });
  eigenvalues->resize(n);
  *vectors = Mat(n, n);
  for (int64_t j = 0; j < n; ++j) {
    (*eigenvalues)[j] = a(order[j], order[j]);
    for (int64_t i = 0; i < n; ++i) (*vectors)(i, j) = v(i, order[j]);
  }
}

Mat DescendingEigenbasis(const Mat& s, std::vector<double>* eigenvalues) {
  std::vector<double> lam;
  Mat q;
  JacobiEigen(s, &lam, &q);
  const int64_t n = s.rows;
  Mat out(n, n);
  eigenvalues->assign(lam.rbegin(), lam.rend());
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < n; ++i) out(i, j) = q(i, n - 1 - j);
  }
  return out;
}

Mat HouseholderQ(const Mat& x) {
  const int64_t m = x.rows, n = x.cols;
  Mat r = x;
  std::vector<std::vector<double>> vs(n, std::vector<double>(m, 0.0));
  std::vector<double> taus(n, 0.0);
  for (int64_t j = 0; j < n; ++j) {
    const double alpha = r(j, j);
    double xnorm = 0;
    for (int64_t i = j + 1; i < m; ++i) xnorm += r(i, j) * r(i, j);
    xnorm = std::sqrt(xnorm);
    std::vector<double>& v = vs[j];
    v[j] = 1.0;
    if (xnorm == 0) {
      taus[j] = 0;  // H = I, as dlarfg
      continue;
    }
    const double beta = -std::copysign(std::hypot(alpha, xnorm), alpha);
    taus[j] = (beta - alpha) / beta;
    for (int64_t i = j + 1; i < m; ++i) v[i] = r(i, j) / (alpha - beta);
    // r <- (I - tau v v^T) r on columns j..n-1.
    for (int64_t c = j; c < n; ++c) {
      double dot = 0;
      for (int64_t i = j; i < m; ++i) dot += v[i] * r(i, c);
      for (int64_t i = j; i < m; ++i) r(i, c) -= taus[j] * v[i] * dot;
    }
  }
  // Q = H_0 H_1 ... H_{n-1} applied to the first n columns of I.
  Mat q(m, n);
  for (int64_t i = 0; i < n; ++i) q(i, i) = 1.0;
  for (int64_t j = n - 1; j >= 0; --j) {
    const std::vector<double>& v = vs[j];
    for (int64_t c = 0; c < n; ++c) {
      double dot = 0;
      for (int64_t i = j; i < m; ++i) dot += v[i] * q(i, c);
      for (int64_t i = j; i < m; ++i) q(i, c) -= taus[j] * v[i] * dot;
    }
  }
  return q;
}

Mat NewtonSchulz(const Mat& u, const std::vector<std::array<double, 3>>& coeffs,
                 double norm_scale, double norm_eps) {
  const bool transpose = u.rows > u.cols;
  Mat x = transpose ? Transposed(u) : u;
  x = Scaled(x, 1.0 / (norm_scale * FrobeniusNorm(x) + norm_eps));
  for (const auto& [a, b, c] : coeffs) {
    const Mat g = MatMul(x, Transposed(x));
    const Mat gg = MatMul(g, g);
    Mat bm(g.rows, g.cols);
    for (size_t i = 0; i < bm.a.size(); ++i) bm.a[i] = b * g.a[i] + c * gg.a[i];
    const Mat bx = MatMul(bm, x);
    for (size_t i = 0; i < x.a.size(); ++i) x.a[i] = a * x.a[i] + bx.a[i];
  }
  return transpose ? Transposed(x) : x;
}

std::vector<std::array<double, 3>> Coefficients(NsCoefficients set,
                                                int64_t steps) {
  static const std::vector<std::array<double, 3>> kQuintic = {
      {4.0848, -6.8946, 2.9270},
      {3.9505, -6.3029, 2.6377},
      {3.7418, -5.5913, 2.3037},
      {2.8769, -3.1427, 1.2046},
      {2.8366, -3.0525, 1.2012}};
  static const std::vector<std::array<double, 3>> kPolar = {
      {8.156554524902461, -22.48329292557795, 15.878769915207462},
      {4.042929935166739, -2.808917465908714, 0.5000178451051316},
      {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
      {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
      {2.3465413258596377, -1.7097828382687081, 0.42323551169305323}};
  std::vector<std::array<double, 3>> out;
  for (int64_t i = 0; i < steps; ++i) {
    switch (set) {
      case NsCoefficients::kSimple:
        out.push_back({3.4445, -4.7750, 2.0315});
        break;
      case NsCoefficients::kQuintic:
        out.push_back(kQuintic[i % 5]);
        break;
      case NsCoefficients::kPolarExpress:
        out.push_back(kPolar[std::min<int64_t>(i, 4)]);
        break;
    }
  }
  return out;
}

std::vector<double> SingularValues(const Mat& x) {
  const Mat gram =
      x.rows <= x.cols ? MatMul(x, Transposed(x)) : MatMul(Transposed(x), x);
  std::vector<double> lam;
  Mat unused;
  JacobiEigen(gram, &lam, &unused);
  std::vector<double> s;
  for (auto it = lam.rbegin(); it != lam.rend(); ++it) {
    s.push_back(std::sqrt(std::max(0.0, *it)));
  }
  return s;
}

// ---- Muon -----------------------------------------------------------------

MuonRef::MuonRef(const MuonOptions& o, int64_t rows, int64_t cols)
    : o_(o), m_(rows, cols) {}

void MuonRef::Step(Mat& p, const Mat& g, double lr) {
  m_ = Lerp(m_, g, 1 - o_.momentum);
  const Mat u = o_.nesterov ? Lerp(g, m_, o_.momentum) : m_;
  const bool polar = o_.ns_coefficients == NsCoefficients::kPolarExpress;
  const Mat x = NewtonSchulz(u, Coefficients(o_.ns_coefficients, o_.ns_steps),
                             polar ? 1.02 : 1.0, polar ? 1e-6 : o_.eps);
  const double rows = p.rows, cols = p.cols;
  const double s = o_.scale == MuonScale::kSpectral
                       ? std::sqrt(std::max(1.0, rows / cols))
                       : 0.2 * std::sqrt(std::max(rows, cols));
  for (size_t i = 0; i < p.a.size(); ++i) {
    p.a[i] = p.a[i] * (1 - lr * o_.weight_decay) - lr * s * x.a[i];
  }
}

// ---- AdamW ----------------------------------------------------------------

AdamWRef::AdamWRef(const AdamWOptions& o, int64_t numel)
    : o_(o), m_(1, numel), v_(1, numel) {}

void AdamWRef::Step(Mat& p, const Mat& g, double lr) {
  ++t_;
  const double bc1 = 1 - std::pow(o_.beta1, t_);
  const double bc2 = 1 - std::pow(o_.beta2, t_);
  for (size_t i = 0; i < p.a.size(); ++i) {
    p.a[i] *= 1 - lr * o_.weight_decay;
    m_.a[i] += (1 - o_.beta1) * (g.a[i] - m_.a[i]);
    v_.a[i] = o_.beta2 * v_.a[i] + (1 - o_.beta2) * g.a[i] * g.a[i];
    p.a[i] -=
        (lr / bc1) * m_.a[i] / (std::sqrt(v_.a[i]) / std::sqrt(bc2) + o_.eps);
  }
}

// ---- Shampoo --------------------------------------------------------------

ShampooRef::ShampooRef(const ShampooOptions& o, int64_t rows, int64_t cols)
    : o_(o) {
  for (auto [r0, br] : Split(rows, o.max_preconditioner_dim)) {
    for (auto [c0, bc] : Split(cols, o.max_preconditioner_dim)) {
      Block b{r0,          br,          c0,           bc,
              Mat(br, br), Mat(bc, bc), Identity(br), Identity(bc),
              Mat(br, bc), Mat(br, bc)};
      blocks_.push_back(std::move(b));
    }
  }
}

Mat ShampooRef::RootInverse(const Mat& f, double bc2) const {
  Mat a = Scaled(f, 1.0 / bc2);
  for (int64_t i = 0; i < a.rows; ++i) a(i, i) += o_.epsilon;
  std::vector<double> lam;
  Mat q;
  JacobiEigen(a, &lam, &q);
  const double mn = *std::min_element(lam.begin(), lam.end());
  if (mn < o_.epsilon) {
    for (double& l : lam) l = l - mn + o_.epsilon;
  }
  Mat qd = q;
  for (int64_t i = 0; i < q.rows; ++i) {
    for (int64_t j = 0; j < q.cols; ++j) qd(i, j) *= std::pow(lam[j], -0.25);
  }
  return MatMul(qd, Transposed(q));
}

void ShampooRef::Step(Mat& p, const Mat& full_g, double lr) {
  ++t_;
  const int64_t t = t_;
  const double w = o_.beta2 == 1 ? 1 : 1 - o_.beta2;
  const double bc2 = o_.beta2 < 1 ? 1 - std::pow(o_.beta2, t) : 1;
  const int64_t s = o_.start_preconditioning_step == -1
                        ? o_.precondition_frequency
                        : o_.start_preconditioning_step;
  const int64_t f = o_.precondition_frequency;
  Mat d_full(p.rows, p.cols);
  for (Block& b : blocks_) {
    Mat g(b.rows, b.cols);
    for (int64_t i = 0; i < b.rows; ++i) {
      for (int64_t j = 0; j < b.cols; ++j) g(i, j) = full_g(b.r0 + i, b.c0 + j);
    }
    // 1. Factors and grafting state.
    if (o_.beta2 != 1) {
      b.l = Scaled(b.l, o_.beta2);
      b.r = Scaled(b.r, o_.beta2);
    }
    const Mat ggt = MatMul(g, Transposed(g));
    const Mat gtg = MatMul(Transposed(g), g);
    for (size_t i = 0; i < b.l.a.size(); ++i) b.l.a[i] += w * ggt.a[i];
    for (size_t i = 0; i < b.r.a.size(); ++i) b.r.a[i] += w * gtg.a[i];
    double bcg = 1;
    if (o_.grafting == Grafting::kAdam) {
      const double gb2 = o_.grafting_beta2;
      for (size_t i = 0; i < g.a.size(); ++i) {
        b.v.a[i] = gb2 * b.v.a[i] + (1 - gb2) * g.a[i] * g.a[i];
      }
      bcg = 1 - std::pow(gb2, t);
    } else if (o_.grafting == Grafting::kAdagrad) {
      for (size_t i = 0; i < g.a.size(); ++i) b.v.a[i] += g.a[i] * g.a[i];
    }
    // 2. Root inverses.
    if ((t % f == 0 && t > s) || t == s) {
      b.l_inv = RootInverse(b.l, bc2);
      b.r_inv = RootInverse(b.r, bc2);
    }
    // 3. First moment.
    Mat gh = g;
    if (o_.beta1 != 0) {
      b.m = Lerp(b.m, g, 1 - o_.beta1);
      gh = Scaled(b.m, 1 / (1 - std::pow(o_.beta1, t)));
    }
    // 4. Direction.
    Mat dg(b.rows, b.cols);
    for (size_t i = 0; i < dg.a.size(); ++i) {
      dg.a[i] = gh.a[i] / (std::sqrt(b.v.a[i] / bcg) + o_.grafting_epsilon);
    }
    const bool grafting = o_.grafting != Grafting::kNone;
    Mat d;
    if (t < s) {
      d = grafting ? dg : gh;
    } else {
      d = MatMul(MatMul(b.l_inv, gh), b.r_inv);
      if (grafting)
        d = Scaled(d, FrobeniusNorm(dg) / (FrobeniusNorm(d) + 1e-16));
    }
    for (int64_t i = 0; i < b.rows; ++i) {
      for (int64_t j = 0; j < b.cols; ++j) d_full(b.r0 + i, b.c0 + j) = d(i, j);
    }
  }
  // 5. Weight decay and update.
  for (size_t i = 0; i < p.a.size(); ++i) {
    const double d = d_full.a[i] + o_.weight_decay * p.a[i];
    p.a[i] -= lr * d;
  }
}

// ---- SOAP -----------------------------------------------------------------

SoapRef::SoapRef(const SoapOptions& o, int64_t rows, int64_t cols)
    : o_(o),
      rows_(rows),
      cols_(cols),
      left_(rows <= o.max_precond_dim),
      right_(cols <= o.max_precond_dim),
      m_(rows, cols),
      v_(rows, cols),
      gl_(rows, rows),
      gr_(cols, cols) {}

Mat SoapRef::Proj(const Mat& x) const {
  Mat y = x;
  if (left_) y = MatMul(Transposed(ql_), y);
  if (right_) y = MatMul(y, qr_);
  return y;
}

Mat SoapRef::Back(const Mat& x) const {
  Mat y = x;
  if (left_) y = MatMul(ql_, y);
  if (right_) y = MatMul(y, Transposed(qr_));
  return y;
}

void SoapRef::UpdateFactors(const Mat& g) {
  const double sb = o_.shampoo_beta < 0 ? o_.beta2 : o_.shampoo_beta;
  if (left_) gl_ = Lerp(gl_, MatMul(g, Transposed(g)), 1 - sb);
  if (right_) gr_ = Lerp(gr_, MatMul(Transposed(g), g), 1 - sb);
}

void SoapRef::Refresh(bool left) {
  const Mat& gx = left ? gl_ : gr_;
  Mat& q = left ? ql_ : qr_;
  const int64_t k = q.rows;
  const Mat est = MatMul(Transposed(q), MatMul(gx, q));
  std::vector<int64_t> order(k);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return est(a, a) > est(b, b); });
  Mat qp(k, k);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < k; ++j) qp(i, j) = q(i, order[j]);
  }
  Mat vp = v_;
  for (int64_t i = 0; i < rows_; ++i) {
    for (int64_t j = 0; j < cols_; ++j) {
      vp(i, j) = left ? v_(order[i], j) : v_(i, order[j]);
    }
  }
  v_ = vp;
  q = HouseholderQ(MatMul(gx, qp));
}

void SoapRef::Step(Mat& p, const Mat& g, double lr) {
  if (!initialized_) {
    UpdateFactors(g);
    std::vector<double> unused;
    if (left_) {
      Mat s = gl_;
      for (int64_t i = 0; i < rows_; ++i) s(i, i) += 1e-30;
      ql_ = DescendingEigenbasis(s, &unused);
    }
    if (right_) {
      Mat s = gr_;
      for (int64_t i = 0; i < cols_; ++i) s(i, i) += 1e-30;
      qr_ = DescendingEigenbasis(s, &unused);
    }
    initialized_ = true;
    return;
  }
  const Mat gp = Proj(g);
  ++t_;
  const int64_t t = t_;
  for (size_t i = 0; i < gp.a.size(); ++i) {
    m_.a[i] = o_.beta1 * m_.a[i] + (1 - o_.beta1) * gp.a[i];
    v_.a[i] = o_.beta2 * v_.a[i] + (1 - o_.beta2) * gp.a[i] * gp.a[i];
  }
  double alpha = lr;
  if (o_.correct_bias) {
    alpha =
        lr * std::sqrt(1 - std::pow(o_.beta2, t)) / (1 - std::pow(o_.beta1, t));
  }
  Mat dir(rows_, cols_);
  for (size_t i = 0; i < dir.a.size(); ++i) {
    dir.a[i] = m_.a[i] / (std::sqrt(v_.a[i]) + o_.eps);
  }
  Mat n = Back(dir);
  if (o_.normalize_grads) {
    double ms = 0;
    for (double x : n.a) ms += x * x;
    ms /= static_cast<double>(n.a.size());
    n = Scaled(n, 1 / (1e-30 + std::sqrt(ms)));
  }
  for (size_t i = 0; i < p.a.size(); ++i) p.a[i] -= alpha * n.a[i];
  if (o_.weight_decay > 0) {
    for (double& x : p.a) x -= lr * o_.weight_decay * x;
  }
  m_ = Back(m_);
  UpdateFactors(g);
  if (t % o_.precondition_frequency == 0) {
    if (left_) Refresh(true);
    if (right_) Refresh(false);
  }
  m_ = Proj(m_);
}

}  // namespace canzona::optim_test
