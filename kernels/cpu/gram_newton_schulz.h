// The Gram Newton-Schulz iteration on the cpu backend (OpenBLAS, float32):
// the s x s half of the work, between the backend's normalization of X and
// its store of the result. Internal to kernels/cpu; CpuBackend validates the
// arguments and owns the workspace passed in here.
//
// On X (m x n, m <= n, already normalized), per segment of steps
// (GramSegmentEnd: a restart after step 2, then every 3 steps):
//   R = X X^T                 ssyrk
//   for each step (a, b, c) of the segment:
//     Z = b R + c R R         ssyrk of R (R R = R R^T): half a GEMM's flops
//     Q = Z + a I (first step), else Q <- a Q + Z Q
//     R <- P R P = a (a R + R Z) + Z (a R + R Z)   (not after the last)
//   X <- Q X
// Everything is float32; the restarts keep R's rounding errors from
// compounding (kernels/ns_algorithm.h has the measurement).
//
// Thread-safety: as the owning CpuBackend (not thread-safe; the workspace
// is per object).
#ifndef CANZONA_KERNELS_CPU_GRAM_NEWTON_SCHULZ_H_
#define CANZONA_KERNELS_CPU_GRAM_NEWTON_SCHULZ_H_

#include <cstdint>
#include <vector>

#include "kernels/backend.h"

namespace canzona::cpu_internal {

// Grow-only s x s buffers of the Gram iteration (never shrink, so a
// steady-state step allocates nothing).
struct GramWorkspace {
  std::vector<float> r, z, q, q_next, rz;

  // Grows every buffer to m x m floats.
  void Reserve(int64_t m);
  int64_t bytes() const;
};

// The Gram iteration of spec.coefficients applied to x (m x n, m <= n,
// normalized), restarting (R recomputed from the current X) at each of
// GramSegments' segments; y is a second m x n buffer. Returns the one of x
// and y that holds the result. m and n are within BLAS's 32-bit range.
float* GramNewtonSchulz(const NewtonSchulzSpec& spec, int64_t m, int64_t n,
                        float* x, float* y, GramWorkspace& ws);

}  // namespace canzona::cpu_internal

#endif  // CANZONA_KERNELS_CPU_GRAM_NEWTON_SCHULZ_H_
