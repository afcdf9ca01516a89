// Device conversions between the trainer's element types and float32 (the
// device half of kernels/base/dtype.h): the NCCL data plane widens bf16 /
// fp16 gradients into fp32 and rounds fp32 master weights into the
// trainer's dtype on the stream of the thread that moves them.
//
//   CANZONA_RETURN_IF_ERROR(CudaStatus(
//       ConvertDTypeAsync(stream, DType::kBFloat16, grads, DType::kFloat32,
//                         staged, n), "ConvertDTypeAsync"));
//
// Plain C++ header (no device code); its own target (canzona_cuda_convert)
// so that the communicators' CUDA seam links it without cuBLAS.
//
// Thread-safety: stateless; concurrent calls on distinct streams are safe.
#ifndef CANZONA_KERNELS_CUDA_DTYPE_CONVERT_H_
#define CANZONA_KERNELS_CUDA_DTYPE_CONVERT_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/base/dtype.h"

namespace canzona {

// `n` elements of `from` at `src` (device or managed memory) as `to` into
// `dst` on `stream`: widening is exact, narrowing rounds to nearest even
// (NaN stays NaN, overflow becomes infinity), equal types copy. The ranges
// must not overlap. Returns the launch error.
cudaError_t ConvertDTypeAsync(cudaStream_t stream, DType from, const void* src,
                              DType to, void* dst, int64_t n);
// kernels/base/dtype.h's ReloadMasters on `stream`: each of `n` float32
// `masters` whose rounding to `dtype` is not the trainer's value at
// `values` any more takes that value (device or managed memory, not
// overlapping). Returns the launch error.
cudaError_t ReloadMastersAsync(cudaStream_t stream, DType dtype,
                               const void* values, float* masters, int64_t n);

}  // namespace canzona

#endif  // CANZONA_KERNELS_CUDA_DTYPE_CONVERT_H_
