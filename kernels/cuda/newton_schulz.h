// Batched Newton-Schulz orthogonalization on the GPU (the Muon inner loop),
// driven from the host with cuBLAS strided-batched GEMMs and the kernels of
// newton_schulz_kernels.cu. Internal to kernels/cuda; CudaBackend validates
// arguments and owns the stream, handle and workspace passed in here.
//
// Per step (a, b, c), on the wide orientation X (n x m, n <= m), batched over
// same-shape matrices, with no host synchronization anywhere:
//   A = X X^T                 one product, symmetric (below)
//   B = a I + b A + c A A     a scale-and-shift kernel fills C with
//                             a I + b A, one product adds c A A (beta 1),
//                             symmetric too
//   X' = B X                  one GEMM into the other X buffer (no copy of
//                             X for "a X": a I is in B)
// The symmetric products compute one triangle and mirror it
// (NewtonSchulzSpec::symmetric_products): SYRK in float32 where it runs,
// the lower tiles as one pointer-array batched GEMM in bf16
// (kernels/symmetric_tiles.h), full GEMMs otherwise.
// kBfloat16 keeps X, A, B in bf16 with float32 accumulation (tensor cores)
// inside each product; cuBLAS may still add split-K partial sums in bf16
// (the handle does not set CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
// as torch by default allows it: allow_bf16_reduced_precision_reduction).
// kFloat32 keeps everything in float32 with TF32 off.
//
// Thread-safety: as the owning CudaBackend (one thread per stream).
#ifndef CANZONA_KERNELS_CUDA_NEWTON_SCHULZ_H_
#define CANZONA_KERNELS_CUDA_NEWTON_SCHULZ_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace canzona::cuda_internal {

// Workspace parts start on 256-byte boundaries (cuBLAS and vectorized
// kernels want aligned operands): `bytes` rounded up to the next one.
inline size_t WorkspaceRoundUp(size_t bytes) {
  constexpr size_t kAlign = 256;
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

struct NsContext {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;  // bound to `stream`
  int num_sms = 1;
  // False: full GEMMs whatever spec.symmetric_products asks
  // (CANZONA_NS_SYMMETRIC=0 in the daemon's environment).
  bool symmetric_products = true;
};

// Whether a run computes one triangle of its symmetric products: the spec
// asks for it and the context allows it.
inline bool SymmetricProducts(const NsContext& ctx,
                              const NewtonSchulzSpec& spec) {
  return ctx.symmetric_products && spec.symmetric_products;
}

// Device workspace bytes RunNewtonSchulz needs for this problem in this
// context; `algorithm` is kStandard or kGram (resolved, never kAuto).
size_t NewtonSchulzWorkspaceBytes(const NsContext& ctx,
                                  const NewtonSchulzSpec& spec,
                                  NsAlgorithm algorithm, int64_t batch,
                                  int64_t rows, int64_t cols);

// Orthogonalizes `batch` contiguous rows x cols float32 matrices from `input`
// into `output` (may alias) with `algorithm` (kStandard or kGram; the Gram
// steps are gram_newton_schulz.h's). `workspace` holds
// NewtonSchulzWorkspaceBytes bytes of device memory that no queued work
// still uses. Arguments must already be validated and non-empty.
absl::Status RunNewtonSchulz(const NsContext& ctx, const NewtonSchulzSpec& spec,
                             NsAlgorithm algorithm, int64_t batch, int64_t rows,
                             int64_t cols, const float* input, float* output,
                             void* workspace);

// Column-major GEMM C = alpha op(A) op(B) + beta C over `batch` strided
// matrices, in bf16 (tensor cores, float32 accumulate; split-K partial sums
// may be reduced in bf16, see above) or float32 (no TF32: the handle is in
// CUBLAS_DEFAULT_MATH).
absl::Status NsBatchedGemm(const NsContext& ctx, bool bf16,
                           cublasOperation_t ta, cublasOperation_t tb,
                           int64_t m, int64_t n, int64_t k, float alpha,
                           const void* a, int64_t lda, int64_t stride_a,
                           const void* b, int64_t ldb, int64_t stride_b,
                           float beta, void* c, int64_t ldc, int64_t stride_c,
                           int64_t batch);

}  // namespace canzona::cuda_internal

#endif  // CANZONA_KERNELS_CUDA_NEWTON_SCHULZ_H_
