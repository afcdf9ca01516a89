// Grid-stride conversion kernels behind ConvertDTypeAsync. The conversions
// are the CUDA intrinsics torch's .to() uses (__float2bfloat16_rn,
// __float2half_rn: round to nearest even), so a finite or infinite
// parameter rounded here has the bits the host path (kernels/base/dtype.cc)
// gives it. A NaN stays a NaN with its payload's bits the intrinsic's
// (canonical), where the host keeps sign and payload: the GPU test lets
// NaNs differ.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dtype_convert.h"

namespace canzona {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

__device__ inline float Load(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

__device__ inline void Store(DType t, void* p, int64_t i, float v) {
  switch (t) {
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    case DType::kFloat16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}

__global__ void ConvertKernel(DType from, const void* src, DType to, void* dst,
                              int64_t n) {
  const int64_t stride = int64_t{blockDim.x} * gridDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    Store(to, dst, i, Load(from, src, i));
  }
}

// The bits of `v` rounded to `t` (bf16 / fp16).
__device__ inline uint16_t RoundedBits(DType t, float v) {
  return t == DType::kBFloat16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v))
                               : __half_as_ushort(__float2half_rn(v));
}

__global__ void ReloadMastersKernel(DType dtype, const void* values,
                                    float* masters, int64_t n) {
  const auto* bits = static_cast<const uint16_t*>(values);
  const int64_t stride = int64_t{blockDim.x} * gridDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    if (RoundedBits(dtype, masters[i]) != bits[i]) {
      masters[i] = Load(dtype, values, i);
    }
  }
}

int Blocks(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<int>(blocks);
}

}  // namespace

cudaError_t ConvertDTypeAsync(cudaStream_t stream, DType from, const void* src,
                              DType to, void* dst, int64_t n) {
  if (n <= 0) return cudaSuccess;
  if (from == to) {
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * DTypeBytes(to),
                           cudaMemcpyDefault, stream);
  }
  ConvertKernel<<<Blocks(n), kThreads, 0, stream>>>(from, src, to, dst, n);
  return cudaGetLastError();
}

cudaError_t ReloadMastersAsync(cudaStream_t stream, DType dtype,
                               const void* values, float* masters, int64_t n) {
  if (n <= 0) return cudaSuccess;
  if (dtype == DType::kFloat32) {
    return cudaMemcpyAsync(masters, values,
                           static_cast<size_t>(n) * sizeof(float),
                           cudaMemcpyDefault, stream);
  }
  ReloadMastersKernel<<<Blocks(n), kThreads, 0, stream>>>(dtype, values,
                                                          masters, n);
  return cudaGetLastError();
}

}  // namespace canzona
