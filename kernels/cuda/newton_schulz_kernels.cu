// Device kernels of the batched Newton-Schulz iteration (newton_schulz.cc
// drives them together with cuBLAS): the per-matrix Frobenius norm, computed
// entirely on the device so the iteration never waits for the host, and the
// load/store conversions that fuse the normalization, the float32 <-> bf16
// conversion and the transposition to the wide orientation into one pass.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/symmetric_tiles.h"

namespace canzona::cuda_kernels {
namespace {

using internal::BlockSum;
using internal::CeilDiv;
using internal::FromFloat;
using internal::kMaxGridYZ;
using internal::kThreads;
using internal::kTile;
using internal::kTileRows;
using internal::ToFloat;

constexpr int kMaxNormParts = 256;

// grid (parts, min(batch, 65535)): block p of matrix b writes
// partials[b * parts + p]; fixed order, so the norm is deterministic.
__global__ void NormPartialsKernel(int64_t batch, int64_t size, const float* x,
                                   bool vectorized, double* partials) {
  const int parts = gridDim.x;
  const int64_t stride = int64_t{parts} * blockDim.x;
  const int64_t tid = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const float* m = x + b * size;
    double sum = 0.0;
    int64_t start = 0;
    if (vectorized) {
      const int64_t n4 = size / 4;
      for (int64_t i = tid; i < n4; i += stride) {
        const float4 v = *reinterpret_cast<const float4*>(m + i * 4);
        sum += double{v.x} * v.x + double{v.y} * v.y + double{v.z} * v.z +
               double{v.w} * v.w;
      }
      start = n4 * 4;
    }
    for (int64_t i = start + tid; i < size; i += stride) {
      sum += double{m[i]} * m[i];
    }
    sum = BlockSum(sum);
    if (threadIdx.x == 0) partials[b * parts + blockIdx.x] = sum;
  }
}

__global__ void DenominatorsKernel(int64_t batch, int parts,
                                   const double* partials, float norm_scale,
                                   float norm_eps, float* denom) {
  const int64_t stride = int64_t{blockDim.x} * gridDim.x;
  for (int64_t b = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; b < batch;
       b += stride) {
    double sum = 0.0;
    for (int p = 0; p < parts; ++p) sum += partials[b * parts + p];
    // Same rounding as torch: the norm is a float32 value, then scaled and
    // offset by eps in float32.
    const float norm = static_cast<float>(sqrt(sum));
    denom[b] = norm_scale * norm + norm_eps;
  }
}

// dst[b][i] = convert(src[b][i] / denom[b]) (denom == nullptr: no scaling).
// grid (x, min(batch, 65535)).
template <typename TIn, typename TOut>
__global__ void ConvertScaleKernel(int64_t batch, int64_t size, const TIn* src,
                                   const float* denom, TOut* dst) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const TIn* s = src + b * size;
    TOut* d = dst + b * size;
    const float div = denom != nullptr ? denom[b] : 1.0f;
    for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < size;
         i += stride) {
      float value = ToFloat(s[i]);
      if (denom != nullptr) value = value / div;
      d[i] = FromFloat<TOut>(value);
    }
  }
}

template <typename TIn, typename TOut>
cudaError_t LaunchConvert(const LaunchConfig& cfg, int64_t batch, int64_t rows,
                          int64_t cols, bool transpose, const TIn* src,
                          const float* denom, TOut* dst) {
  if (transpose) {
    internal::TransposeKernel<TIn, TOut>
        <<<internal::TransposeGrid(cfg, batch, rows, cols),
           dim3(kTile, kTileRows), 0, cfg.stream>>>(batch, rows, cols, src,
                                                    denom, dst);
    return cudaGetLastError();
  }
  const int64_t size = rows * cols;
  const int64_t gy = batch > kMaxGridYZ ? kMaxGridYZ : batch;
  // About 8 blocks per SM in total across the batch.
  const int64_t budget = int64_t{cfg.num_sms > 0 ? cfg.num_sms : 1} * 8;
  int64_t gx = CeilDiv(budget, gy);
  const int64_t needed = CeilDiv(size, kThreads);
  if (gx > needed) gx = needed;
  if (gx < 1) gx = 1;
  ConvertScaleKernel<TIn, TOut>
      <<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads,
         0, cfg.stream>>>(batch, size, src, denom, dst);
  return cudaGetLastError();
}

// Grid-stride over batch * n * n elements.
template <typename T>
__global__ void ScaleAddIdentityKernel(int64_t total, int64_t n, float scale,
                                       float shift, const T* src, T* dst) {
  const int64_t size = n * n;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t at = i % size;
    float value = scale * ToFloat(src[i]);
    if (at / n == at % n) value += shift;
    dst[i] = FromFloat<T>(value);
  }
}

// One thread per (matrix, tile): the nine pointer arrays of
// NsSymmetricTilePointers, offsets from kernels/symmetric_tiles.h.
__global__ void SymmetricTilePointersKernel(int64_t batch, int64_t n, int64_t l,
                                            int64_t side, int64_t count,
                                            int64_t elem_bytes, const char* x0,
                                            const char* x1, const char* a,
                                            char* b, void** out) {
  const int64_t entries = batch * count;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < entries;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = e / count;
    const int64_t t = e % count;
    const int64_t sx = i * n * l * elem_bytes;
    const int64_t sa = i * n * n * elem_bytes;
    const TileOperands gram = GramTileOperands(t, side, n, l);
    const TileOperands square = SquareTileOperands(t, side, n);
    const char* xs[2] = {x0, x1};
    for (int p = 0; p < 2; ++p) {
      out[(3 * p + 0) * entries + e] =
          const_cast<char*>(xs[p] + sx + gram.a * elem_bytes);
      out[(3 * p + 1) * entries + e] =
          const_cast<char*>(xs[p] + sx + gram.b * elem_bytes);
      out[(3 * p + 2) * entries + e] =
          const_cast<char*>(a + sa + gram.c * elem_bytes);
    }
    out[6 * entries + e] = const_cast<char*>(a + sa + square.a * elem_bytes);
    out[7 * entries + e] = const_cast<char*>(a + sa + square.b * elem_bytes);
    out[8 * entries + e] = b + sa + square.c * elem_bytes;
  }
}

}  // namespace

cudaError_t NsSymmetricTilePointers(const LaunchConfig& cfg, int64_t batch,
                                    int64_t n, int64_t l, int64_t side,
                                    int64_t count, NsElement elem,
                                    const void* x0, const void* x1,
                                    const void* a, void* b, void** out) {
  if (batch <= 0 || count <= 0) return cudaSuccess;
  const int64_t elem_bytes = elem == NsElement::kBfloat16 ? 2 : 4;
  SymmetricTilePointersKernel<<<internal::GridFor(cfg, batch * count), kThreads,
                                0, cfg.stream>>>(
      batch, n, l, side, count, elem_bytes, static_cast<const char*>(x0),
      static_cast<const char*>(x1), static_cast<const char*>(a),
      static_cast<char*>(b), out);
  return cudaGetLastError();
}

int NsNormParts(int64_t matrix_size) {
  // ~16 float4 per thread; capped so the per-matrix finalization stays cheap.
  int64_t parts = CeilDiv(matrix_size, int64_t{kThreads} * 16);
  if (parts > kMaxNormParts) parts = kMaxNormParts;
  if (parts < 1) parts = 1;
  return static_cast<int>(parts);
}

cudaError_t NsSumSquares(const LaunchConfig& cfg, int64_t batch,
                         int64_t matrix_size, const float* x, int parts,
                         double* partials) {
  if (batch <= 0) return cudaSuccess;
  if (matrix_size <= 0) {
    return cudaMemsetAsync(partials, 0, batch * parts * sizeof(double),
                           cfg.stream);
  }
  // Every matrix start is 16-byte aligned when the base is and sizes are
  // multiples of 4.
  const bool vectorized = internal::Aligned16(x) && matrix_size % 4 == 0;
  const int64_t gy = batch > kMaxGridYZ ? kMaxGridYZ : batch;
  NormPartialsKernel<<<dim3(static_cast<unsigned>(parts),
                            static_cast<unsigned>(gy)),
                       kThreads, 0, cfg.stream>>>(batch, matrix_size, x,
                                                  vectorized, partials);
  return cudaGetLastError();
}

cudaError_t NsDenominators(const LaunchConfig& cfg, int64_t batch, int parts,
                           const double* partials, float norm_scale,
                           float norm_eps, float* denom) {
  if (batch <= 0) return cudaSuccess;
  const int64_t grid = CeilDiv(batch, 128);
  DenominatorsKernel<<<static_cast<unsigned>(grid > 65535 ? 65535 : grid), 128,
                       0, cfg.stream>>>(batch, parts, partials, norm_scale,
                                        norm_eps, denom);
  return cudaGetLastError();
}

cudaError_t NsLoad(const LaunchConfig& cfg, int64_t batch, int64_t rows,
                   int64_t cols, bool transpose, const float* src,
                   const float* denom, NsElement elem, void* dst) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return cudaSuccess;
  if (elem == NsElement::kBfloat16) {
    return LaunchConvert(cfg, batch, rows, cols, transpose, src, denom,
                         static_cast<__nv_bfloat16*>(dst));
  }
  return LaunchConvert(cfg, batch, rows, cols, transpose, src, denom,
                       static_cast<float*>(dst));
}

cudaError_t NsStore(const LaunchConfig& cfg, int64_t batch, int64_t rows,
                    int64_t cols, bool transpose, NsElement elem,
                    const void* src, float* dst) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return cudaSuccess;
  if (elem == NsElement::kBfloat16) {
    return LaunchConvert(cfg, batch, rows, cols, transpose,
                         static_cast<const __nv_bfloat16*>(src),
                         static_cast<const float*>(nullptr), dst);
  }
  return LaunchConvert(cfg, batch, rows, cols, transpose,
                       static_cast<const float*>(src),
                       static_cast<const float*>(nullptr), dst);
}

cudaError_t NsScaleAddIdentity(const LaunchConfig& cfg, int64_t batch,
                               int64_t n, float scale, float shift,
                               NsElement elem, const void* src, void* dst) {
  if (batch <= 0 || n <= 0) return cudaSuccess;
  const int64_t total = batch * n * n;
  const int grid = internal::GridFor(cfg, total);
  if (elem == NsElement::kBfloat16) {
    ScaleAddIdentityKernel<<<grid, kThreads, 0, cfg.stream>>>(
        total, n, scale, shift, static_cast<const __nv_bfloat16*>(src),
        static_cast<__nv_bfloat16*>(dst));
  } else {
    ScaleAddIdentityKernel<<<grid, kThreads, 0, cfg.stream>>>(
        total, n, scale, shift, static_cast<const float*>(src),
        static_cast<float*>(dst));
  }
  return cudaGetLastError();
}

}  // namespace canzona::cuda_kernels
