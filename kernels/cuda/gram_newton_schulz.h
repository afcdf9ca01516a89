// The Gram Newton-Schulz iteration on the GPU (kernels/ns_algorithm.h): the
// part between newton_schulz.cc's normalized load of X and its store, with
// one cuBLAS strided-batched call per product over same-shape matrices.
// Internal to kernels/cuda; RunNewtonSchulz calls it with the stream, handle
// and workspace CudaBackend owns.
//
// On X (n x m row-major, n <= m, bf16 or float32 as the precision says),
// per segment of steps (GramSegmentEnd: a restart after step 2, then every
// 3 steps, as on the cpu):
//   R = X X^T                     float32 output (bf16 operands for bf16;
//                                 float32: SYRK per matrix + mirror)
//   per step (a, b, c) of the segment:
//     Z = b R + c R R
//     Q = Z + a I (first step), else Q <- a Q + Z Q
//     RZ = a R + R Z; R <- a RZ + Z RZ   (R <- P R P; not after the last)
//   X <- Q X                      in X's precision
// R, Z, Q and RZ are float32 at both precisions: R squares X's conditioning
// and bf16 storage would flatten its small eigenvalues. Their products are
// float32 GEMMs (no TF32) for kFloat32 and TF32 GEMMs on float32 operands
// for kBfloat16 (8 more mantissa bits than bf16, float32 accumulation).
//
// Thread-safety: as the owning CudaBackend (one thread per stream).
#ifndef CANZONA_KERNELS_CUDA_GRAM_NEWTON_SCHULZ_H_
#define CANZONA_KERNELS_CUDA_GRAM_NEWTON_SCHULZ_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/newton_schulz.h"

namespace canzona::cuda_internal {

// Device bytes of the Gram iteration's s x s buffers for `batch` n x n
// problems (n = the short side).
size_t GramWorkspaceBytes(NsPrecision precision, int64_t batch, int64_t n);

// Runs the Gram iteration of spec.coefficients on x (batch x n x m, X's
// element type), using `other` (same size, distinct) as the second X
// buffer; on return x points at the result and other at the spare buffer
// (they swap once per segment). `workspace` holds GramWorkspaceBytes
// bytes, 256-byte aligned.
absl::Status RunGramSteps(const NsContext& ctx, const NewtonSchulzSpec& spec,
                          int64_t batch, int64_t n, int64_t m, void*& x,
                          void*& other, void* workspace);

}  // namespace canzona::cuda_internal

#endif  // CANZONA_KERNELS_CUDA_GRAM_NEWTON_SCHULZ_H_
