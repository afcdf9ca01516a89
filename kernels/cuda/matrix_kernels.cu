// Canzona's own CUDA kernels for the matrix helpers of the update rules
// (see cuda_kernels.h): identity shifts, column scaling and dots, the
// eigenvector sorts, transposes and the symmetric products' mirror.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/device_utils.cuh"

namespace canzona::cuda_kernels {
namespace {

using internal::CeilDiv;
using internal::GridFor;
using internal::kMaxGridYZ;
using internal::kThreads;
using internal::kTile;
using internal::kTileRows;

// 2-D grid-stride loops: x over columns (coalesced), y over rows.
#define CANZONA_FOR_2D(rows, cols, i, j)                                       \
  for (int64_t i = int64_t{blockIdx.y} * blockDim.y + threadIdx.y; i < rows;   \
       i += int64_t{gridDim.y} * blockDim.y)                                   \
    for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < cols; \
         j += int64_t{gridDim.x} * blockDim.x)

dim3 Grid2D(const LaunchConfig& cfg, int64_t rows, int64_t cols) {
  int64_t gx = CeilDiv(cols, 32);
  if (gx > 1024) gx = 1024;
  const int64_t budget = int64_t{cfg.num_sms > 0 ? cfg.num_sms : 1} * 8;
  int64_t gy = CeilDiv(rows, 8);
  int64_t gy_cap = budget / gx;
  if (gy_cap < 1) gy_cap = 1;
  if (gy > gy_cap) gy = gy_cap;
  if (gy > kMaxGridYZ) gy = kMaxGridYZ;
  if (gy < 1) gy = 1;
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy), 1);
}

__global__ void AddIdentityKernel(int64_t n, float alpha, float* a) {
  const int64_t stride = int64_t{blockDim.x} * gridDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    a[i * n + i] += alpha;
  }
}

__global__ void ScaleColumnsKernel(int64_t rows, int64_t cols, const float* d,
                                   float* a) {
  CANZONA_FOR_2D(rows, cols, i, j) { a[i * cols + j] *= d[j]; }
}

__global__ void GatherColumnsKernel(int64_t rows, int64_t cols,
                                    const int64_t* perm, const float* src,
                                    float* dst) {
  CANZONA_FOR_2D(rows, cols, i, j) {
    dst[i * cols + j] = src[i * cols + perm[j]];
  }
}

__global__ void GatherRowsKernel(int64_t rows, int64_t cols,
                                 const int64_t* perm, const float* src,
                                 float* dst) {
  CANZONA_FOR_2D(rows, cols, i, j) {
    dst[i * cols + j] = src[perm[i] * cols + j];
  }
}

#undef CANZONA_FOR_2D

// Whether key a at index ia comes before key b at index ib in descending
// order: NaN last, equal keys (-0 == +0, NaN with NaN) by index.
__device__ inline bool SortsBefore(float a, int64_t ia, float b, int64_t ib) {
  const bool a_nan = isnan(a);
  const bool b_nan = isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// order[rank of key j] = j: each thread counts the keys sorting before its
// own, reading them a block-wide tile at a time from shared memory. The
// loops' bounds are uniform across a block (its __syncthreads).
__global__ void DescendingOrderKernel(int64_t n, const float* keys,
                                      int64_t* order) {
  __shared__ float tile[kThreads];
  const int64_t stride = int64_t{blockDim.x} * gridDim.x;
  for (int64_t base = int64_t{blockIdx.x} * blockDim.x; base < n;
       base += stride) {
    const int64_t j = base + threadIdx.x;
    const float key = j < n ? keys[j] : 0.0f;
    int64_t rank = 0;
    for (int64_t t0 = 0; t0 < n; t0 += blockDim.x) {
      __syncthreads();
      if (t0 + threadIdx.x < n) tile[threadIdx.x] = keys[t0 + threadIdx.x];
      __syncthreads();
      const int64_t m = n - t0 < blockDim.x ? n - t0 : int64_t{blockDim.x};
      for (int64_t t = 0; t < m; ++t) {
        rank += SortsBefore(tile[t], t0 + t, key, j) ? 1 : 0;
      }
    }
    if (j < n) order[rank] = j;
  }
}

// Block (32, 8): each block owns 32 adjacent columns (coalesced row reads);
// the 8 thread rows split the matrix rows and are reduced in shared memory.
__global__ void ColumnDotsKernel(int64_t rows, int64_t cols, const float* a,
                                 const float* b, float* out) {
  __shared__ double sums[8][33];
  for (int64_t j0 = int64_t{blockIdx.x} * 32; j0 < cols;
       j0 += int64_t{gridDim.x} * 32) {
    const int64_t j = j0 + threadIdx.x;
    double sum = 0.0;
    if (j < cols) {
      for (int64_t i = threadIdx.y; i < rows; i += blockDim.y) {
        sum += double{a[i * cols + j]} * b[i * cols + j];
      }
    }
    sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
      double total = 0.0;
      for (int k = 0; k < 8; ++k) total += sums[k][threadIdx.x];
      out[j] = static_cast<float>(total);
    }
    __syncthreads();
  }
}

// Tile pairs (bi, bj) with bi >= bj: row-major tile (bi, bj) of the strict
// lower triangle receives the transpose of tile (bj, bi). Each block reads
// only its upper tile and writes only its lower tile (on the diagonal both
// are the same tile: all reads finish before the barrier), so blocks never
// race.
template <typename T>
__global__ void MirrorUpperToLowerKernel(int64_t batch, int64_t n, T* c,
                                         int64_t ldc, int64_t stride) {
  __shared__ T tile[kTile][kTile + 1];
  const int64_t tiles = CeilDiv(n, kTile);
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    T* m = c + b * stride;
    for (int64_t bi = blockIdx.y; bi < tiles; bi += gridDim.y) {
      for (int64_t bj = blockIdx.x; bj <= bi && bj < tiles; bj += gridDim.x) {
        // Load source tile (rows bj*T.., cols bi*T..) from the upper part.
        for (int k = threadIdx.y; k < kTile; k += kTileRows) {
          const int64_t r = bj * kTile + k;
          const int64_t col = bi * kTile + threadIdx.x;
          if (r < n && col < n) tile[k][threadIdx.x] = m[r * ldc + col];
        }
        __syncthreads();
        for (int k = threadIdx.y; k < kTile; k += kTileRows) {
          const int64_t r = bi * kTile + k;
          const int64_t col = bj * kTile + threadIdx.x;
          if (r < n && col < n && r > col) {
            m[r * ldc + col] = tile[threadIdx.x][k];
          }
        }
        __syncthreads();
      }
    }
  }
}

}  // namespace

cudaError_t AddIdentity(const LaunchConfig& cfg, int64_t n, float alpha,
                        float* a) {
  if (n <= 0) return cudaSuccess;
  AddIdentityKernel<<<GridFor(cfg, n), kThreads, 0, cfg.stream>>>(n, alpha, a);
  return cudaGetLastError();
}

cudaError_t ScaleColumns(const LaunchConfig& cfg, int64_t rows, int64_t cols,
                         const float* d, float* a) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  ScaleColumnsKernel<<<Grid2D(cfg, rows, cols), dim3(32, 8), 0, cfg.stream>>>(
      rows, cols, d, a);
  return cudaGetLastError();
}

cudaError_t ColumnDots(const LaunchConfig& cfg, int64_t rows, int64_t cols,
                       const float* a, const float* b, float* out) {
  if (cols <= 0) return cudaSuccess;
  if (rows <= 0)
    return cudaMemsetAsync(out, 0, cols * sizeof(float), cfg.stream);
  int64_t grid = CeilDiv(cols, 32);
  if (grid > 65535) grid = 65535;
  ColumnDotsKernel<<<static_cast<unsigned>(grid), dim3(32, 8), 0, cfg.stream>>>(
      rows, cols, a, b, out);
  return cudaGetLastError();
}

cudaError_t GatherColumns(const LaunchConfig& cfg, int64_t rows, int64_t cols,
                          const int64_t* perm, const float* src, float* dst) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  GatherColumnsKernel<<<Grid2D(cfg, rows, cols), dim3(32, 8), 0, cfg.stream>>>(
      rows, cols, perm, src, dst);
  return cudaGetLastError();
}

cudaError_t DescendingOrder(const LaunchConfig& cfg, int64_t n,
                            const float* keys, int64_t* order) {
  if (n <= 0) return cudaSuccess;
  DescendingOrderKernel<<<GridFor(cfg, n), kThreads, 0, cfg.stream>>>(n, keys,
                                                                      order);
  return cudaGetLastError();
}

cudaError_t GatherRows(const LaunchConfig& cfg, int64_t rows, int64_t cols,
                       const int64_t* perm, const float* src, float* dst) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  GatherRowsKernel<<<Grid2D(cfg, rows, cols), dim3(32, 8), 0, cfg.stream>>>(
      rows, cols, perm, src, dst);
  return cudaGetLastError();
}

cudaError_t Transpose(const LaunchConfig& cfg, int64_t batch, int64_t rows,
                      int64_t cols, const float* src, float* dst) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return cudaSuccess;
  internal::TransposeKernel<float, float>
      <<<internal::TransposeGrid(cfg, batch, rows, cols),
         dim3(kTile, kTileRows), 0, cfg.stream>>>(batch, rows, cols, src,
                                                  nullptr, dst);
  return cudaGetLastError();
}

cudaError_t TransposeDoubleToFloat(const LaunchConfig& cfg, int64_t rows,
                                   int64_t cols, const double* src,
                                   float* dst) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  internal::TransposeKernel<double, float>
      <<<internal::TransposeGrid(cfg, 1, rows, cols), dim3(kTile, kTileRows), 0,
         cfg.stream>>>(1, rows, cols, src, nullptr, dst);
  return cudaGetLastError();
}

namespace {

template <typename T>
cudaError_t LaunchMirrorUpperToLower(const LaunchConfig& cfg, int64_t batch,
                                     int64_t n, T* c, int64_t ldc,
                                     int64_t stride) {
  if (batch <= 0 || n <= 1) return cudaSuccess;
  int64_t tiles = CeilDiv(n, kTile);
  if (tiles > kMaxGridYZ) tiles = kMaxGridYZ;
  int64_t gz = batch > kMaxGridYZ ? kMaxGridYZ : batch;
  // Blocks above the diagonal (bj > bi) find no work and exit at once.
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(tiles),
                  static_cast<unsigned>(gz));
  MirrorUpperToLowerKernel<T><<<grid, dim3(kTile, kTileRows), 0, cfg.stream>>>(
      batch, n, c, ldc, stride);
  return cudaGetLastError();
}

}  // namespace

cudaError_t MirrorUpperToLower(const LaunchConfig& cfg, int64_t batch,
                               int64_t n, float* c, int64_t ldc,
                               int64_t stride) {
  return LaunchMirrorUpperToLower(cfg, batch, n, c, ldc, stride);
}

cudaError_t NsMirrorUpperToLower(const LaunchConfig& cfg, int64_t batch,
                                 int64_t n, NsElement elem, void* c) {
  if (elem == NsElement::kBfloat16) {
    return LaunchMirrorUpperToLower(cfg, batch, n,
                                    static_cast<__nv_bfloat16*>(c), n, n * n);
  }
  return LaunchMirrorUpperToLower(cfg, batch, n, static_cast<float*>(c), n,
                                  n * n);
}

}  // namespace canzona::cuda_kernels
