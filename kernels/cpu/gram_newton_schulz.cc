#include "kernels/cpu/gram_newton_schulz.h"

#include <cblas.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/ns_algorithm.h"

namespace canzona::cpu_internal {
namespace {

// ssyrk fills the upper triangle; the products below read both.
void MirrorUpper(int64_t m, float* c) {
  for (int64_t i = 1; i < m; ++i) {
    for (int64_t j = 0; j < i; ++j) c[i * m + j] = c[j * m + i];
  }
}

// c (m x m) = alpha * a * b + beta * c, all m x m row-major.
void Product(int64_t m, float alpha, const float* a, const float* b, float beta,
             float* c) {
  const blasint k = static_cast<blasint>(m);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, k, k, alpha, a, k,
              b, k, beta, c, k);
}

float* Grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

}  // namespace

void GramWorkspace::Reserve(int64_t m) {
  for (std::vector<float>* v : {&r, &z, &q, &q_next, &rz}) Grow(*v, m * m);
}

int64_t GramWorkspace::bytes() const {
  int64_t total = 0;
  for (const std::vector<float>* v : {&r, &z, &q, &q_next, &rz}) {
    total += static_cast<int64_t>(v->capacity() * sizeof(float));
  }
  return total;
}

float* GramNewtonSchulz(const NewtonSchulzSpec& spec, int64_t m, int64_t n,
                        float* x, float* y, GramWorkspace& ws) {
  ws.Reserve(m);
  const size_t bytes = static_cast<size_t>(m * m) * sizeof(float);
  const blasint bm = static_cast<blasint>(m);
  const blasint bn = static_cast<blasint>(n);
  const int64_t steps = static_cast<int64_t>(spec.coefficients.size());
  for (int64_t first = 0; first < steps;) {
    const int64_t end = GramSegmentEnd(first, steps);
    const int64_t count = end - first;
    float* r = ws.r.data();
    float* z = ws.z.data();
    float* q = ws.q.data();
    float* q_next = ws.q_next.data();
    float* rz = ws.rz.data();
    // R = X X^T: with the final Q X, the only products with the long side.
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, bm, bn, 1.0f, x, bn,
                0.0f, r, bm);
    MirrorUpper(m, r);
    for (int64_t k = 0; k < count; ++k) {
      const auto& [a, b, c] = spec.coefficients[first + k];
      // Z = c R R^T + b R: ssyrk reads only R's upper triangle, which also
      // keeps Z exactly symmetric whatever rounding did to R.
      std::memcpy(z, r, bytes);
      cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, bm, bm, c, r, bm, b,
                  z, bm);
      MirrorUpper(m, z);
      if (k == 0) {
        // Q = P = a I + Z (Q starts as I: no product).
        std::memcpy(q, z, bytes);
        for (int64_t i = 0; i < m; ++i) q[i * m + i] += a;
      } else {
        // Q <- P Q = a Q + Z Q.
        std::memcpy(q_next, q, bytes);
        Product(m, 1.0f, z, q, a, q_next);
        std::swap(q, q_next);
      }
      if (k + 1 == count) break;  // R is not needed after the segment
      // R <- P R P, as RZ = R P = a R + R Z, then R = P RZ = a RZ + Z RZ.
      std::memcpy(rz, r, bytes);
      Product(m, 1.0f, r, z, a, rz);
      std::memcpy(r, rz, bytes);
      Product(m, 1.0f, z, rz, a, r);
    }
    // X <- Q X.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bm, bn, bm, 1.0f, q,
                bm, x, bn, 0.0f, y, bn);
    std::swap(x, y);
    first = end;
  }
  return x;
}

}  // namespace canzona::cpu_internal
