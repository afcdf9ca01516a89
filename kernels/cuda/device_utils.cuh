// Device-side helpers shared by Canzona's .cu files: grid sizing, block
// reductions, element conversions and the tiled (shared-memory) transpose.
// Internal to kernels/cuda; include only from .cu files.
//
// Thread-safety: stateless.
#ifndef CANZONA_KERNELS_CUDA_DEVICE_UTILS_CUH_
#define CANZONA_KERNELS_CUDA_DEVICE_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"

namespace canzona::cuda_kernels::internal {

inline constexpr int kThreads = 256;
// Transpose tiles are kTile x kTile, processed by kTile x kTileRows threads.
inline constexpr int kTile = 32;
inline constexpr int kTileRows = 8;
// Largest grid.y / grid.z; kernels loop when the logical extent is larger.
inline constexpr int64_t kMaxGridYZ = 65535;

__host__ __device__ inline int64_t CeilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Blocks for a 1-D grid-stride loop over `work` items: enough to fill every
// SM (8 x 256 threads = the 2048-thread SM limit on sm_80/sm_90), no more,
// so large arrays amortize block start-up in the loop.
inline int GridFor(const LaunchConfig& cfg, int64_t work) {
  int64_t blocks = CeilDiv(work, kThreads);
  const int64_t cap = int64_t{cfg.num_sms > 0 ? cfg.num_sms : 1} * 8;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks);
}

__host__ __device__ inline bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Sum over the block; the result is valid in thread 0 only. Every thread of
// the block must call it (it synchronizes). Order is fixed, so results are
// deterministic for a fixed launch shape.
template <typename T>
__device__ inline T BlockSum(T value) {
  __shared__ T warp_sums[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  __syncthreads();  // warp_sums may still be read by a previous call
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  const int num_warps = (blockDim.x + 31) / 32;
  if (warp == 0) {
    value = lane < num_warps ? warp_sums[lane] : T(0);
    for (int offset = 16; offset > 0; offset /= 2) {
      value += __shfl_down_sync(0xffffffffu, value, offset);
    }
  }
  return value;
}

template <typename T>
__device__ inline float ToFloat(T x) {
  return static_cast<float>(x);
}
template <>
__device__ inline float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ inline T FromFloat(float x) {
  return static_cast<T>(x);
}
template <>
__device__ inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// dst[b] (cols x rows) = src[b]^T (rows x cols) / denom[b] for `batch`
// contiguous matrices (denom == nullptr: no scaling). The shared tile is
// padded to 33 columns so the transposed reads hit distinct banks; both the
// global loads and the global stores are coalesced.
// Launch: block (kTile, kTileRows), grid from TransposeGrid().
template <typename TIn, typename TOut>
__global__ void TransposeKernel(int64_t batch, int64_t rows, int64_t cols,
                                const TIn* src, const float* denom, TOut* dst) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t size = rows * cols;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const TIn* s = src + b * size;
    TOut* d = dst + b * size;
    const float div = denom != nullptr ? denom[b] : 1.0f;
    for (int64_t r0 = int64_t{blockIdx.y} * kTile; r0 < rows;
         r0 += int64_t{gridDim.y} * kTile) {
      for (int64_t c0 = int64_t{blockIdx.x} * kTile; c0 < cols;
           c0 += int64_t{gridDim.x} * kTile) {
        for (int k = threadIdx.y; k < kTile; k += kTileRows) {
          const int64_t r = r0 + k;
          const int64_t c = c0 + threadIdx.x;
          if (r < rows && c < cols)
            tile[k][threadIdx.x] = ToFloat(s[r * cols + c]);
        }
        __syncthreads();
        for (int k = threadIdx.y; k < kTile; k += kTileRows) {
          const int64_t c = c0 + k;            // dst row
          const int64_t r = r0 + threadIdx.x;  // dst column
          if (r < rows && c < cols) {
            float value = tile[threadIdx.x][k];
            if (denom != nullptr) value = value / div;
            d[c * rows + r] = FromFloat<TOut>(value);
          }
        }
        __syncthreads();  // the tile is reused by the next iteration
      }
    }
  }
}

inline dim3 TransposeGrid(const LaunchConfig& cfg, int64_t batch, int64_t rows,
                          int64_t cols) {
  int64_t gx = CeilDiv(cols, kTile);
  int64_t gy = CeilDiv(rows, kTile);
  if (gx > 1024) gx = 1024;
  if (gy > kMaxGridYZ) gy = kMaxGridYZ;
  // Enough blocks in flight to cover the SMs several times over; the loops
  // in the kernel handle what the grid does not.
  const int64_t per_matrix = gx * gy;
  const int64_t target = int64_t{cfg.num_sms > 0 ? cfg.num_sms : 1} * 64;
  int64_t gz = per_matrix >= target ? 1 : CeilDiv(target, per_matrix);
  if (gz > batch) gz = batch;
  if (gz > kMaxGridYZ) gz = kMaxGridYZ;
  if (gz < 1) gz = 1;
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy),
              static_cast<unsigned>(gz));
}

}  // namespace canzona::cuda_kernels::internal

#endif  // CANZONA_KERNELS_CUDA_DEVICE_UTILS_CUH_
