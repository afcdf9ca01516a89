// Canzona's own CUDA kernels for the fused elementwise parts of the update
// rules and the reductions (see cuda_kernels.h); the matrix helpers are in
// matrix_kernels.cu.
//
// Elementwise kernels are grid-stride loops; when every pointer is 16-byte
// aligned they move float4s (one 128-bit load/store per operand per
// iteration), which is what it takes to reach HBM bandwidth on H100.
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/device_utils.cuh"

namespace canzona::cuda_kernels {
namespace {

using internal::Aligned16;
using internal::BlockSum;
using internal::CeilDiv;
using internal::GridFor;
using internal::kThreads;

__device__ inline float4 Load4(const float* p, int64_t i) {
  return *reinterpret_cast<const float4*>(p + i);
}
__device__ inline void Store4(float* p, int64_t i, float4 v) {
  *reinterpret_cast<float4*>(p + i) = v;
}

// One thread's share of op.Apply1(i) for every i < n, or op.Apply4(i) for
// every multiple of 4 below n (then Apply1 for the tail) when `vectorized`,
// as block `block` of `blocks` grid-striding over n.
template <class Op>
__device__ inline void ThreadElementwise(int64_t n, const Op& op,
                                         bool vectorized, int64_t block,
                                         int64_t blocks) {
  const int64_t stride = int64_t{blockDim.x} * blocks;
  const int64_t tid = block * blockDim.x + threadIdx.x;
  int64_t start = 0;
  if (vectorized) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) op.Apply4(i * 4);
    start = n4 * 4;
  }
  for (int64_t i = start + tid; i < n; i += stride) op.Apply1(i);
}

template <class Op>
__global__ void ElementwiseKernel(int64_t n, Op op, bool vectorized) {
  ThreadElementwise(n, op, vectorized, blockIdx.x, gridDim.x);
}

template <class Op>
cudaError_t LaunchElementwise(const LaunchConfig& cfg, int64_t n, const Op& op,
                              bool vectorized) {
  if (n <= 0) return cudaSuccess;
  const int grid = GridFor(cfg, vectorized ? CeilDiv(n, 4) : n);
  ElementwiseKernel<Op><<<grid, kThreads, 0, cfg.stream>>>(n, op, vectorized);
  return cudaGetLastError();
}

// torch's lerp (aten/src/ATen/native/Lerp.h): the two formulas keep the
// result exact at weight 0 and weight 1 respectively.
__device__ inline float LerpValue(float a, float b, float w) {
  return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

struct FillOp {
  float* dst;
  float value;
  __device__ void Apply1(int64_t i) const { dst[i] = value; }
  __device__ void Apply4(int64_t i) const {
    Store4(dst, i, make_float4(value, value, value, value));
  }
};

struct LerpOp {
  const float* a;
  const float* b;
  float* out;
  float w;
  __device__ void Apply1(int64_t i) const { out[i] = LerpValue(a[i], b[i], w); }
  __device__ void Apply4(int64_t i) const {
    const float4 x = Load4(a, i);
    const float4 y = Load4(b, i);
    Store4(out, i,
           make_float4(LerpValue(x.x, y.x, w), LerpValue(x.y, y.y, w),
                       LerpValue(x.z, y.z, w), LerpValue(x.w, y.w, w)));
  }
};

struct NesterovMomentumOp {
  const float* g;
  float* m;
  float* out;
  float w;  // 1 - beta
  float beta;
  __device__ void Apply1(int64_t i) const {
    const float gv = g[i];
    const float mv = LerpValue(m[i], gv, w);
    m[i] = mv;
    out[i] = LerpValue(gv, mv, beta);
  }
  __device__ void Apply4(int64_t i) const {
    const float4 gv = Load4(g, i);
    const float4 old = Load4(m, i);
    const float4 mv =
        make_float4(LerpValue(old.x, gv.x, w), LerpValue(old.y, gv.y, w),
                    LerpValue(old.z, gv.z, w), LerpValue(old.w, gv.w, w));
    Store4(m, i, mv);
    Store4(
        out, i,
        make_float4(LerpValue(gv.x, mv.x, beta), LerpValue(gv.y, mv.y, beta),
                    LerpValue(gv.z, mv.z, beta), LerpValue(gv.w, mv.w, beta)));
  }
};

struct AxpbyOp {
  const float* x;
  float* y;
  float alpha;
  float beta;
  // Plain formula, as the cpu backend: beta == 0 still reads y.
  __device__ float F(float xv, float yv) const {
    return alpha * xv + beta * yv;
  }
  __device__ void Apply1(int64_t i) const { y[i] = F(x[i], y[i]); }
  __device__ void Apply4(int64_t i) const {
    const float4 a = Load4(x, i);
    const float4 b = Load4(y, i);
    Store4(y, i,
           make_float4(F(a.x, b.x), F(a.y, b.y), F(a.z, b.z), F(a.w, b.w)));
  }
};

struct ScaleOp {
  float* x;
  float alpha;
  __device__ void Apply1(int64_t i) const { x[i] = alpha * x[i]; }
  __device__ void Apply4(int64_t i) const {
    const float4 a = Load4(x, i);
    Store4(x, i,
           make_float4(alpha * a.x, alpha * a.y, alpha * a.z, alpha * a.w));
  }
};

struct EmaSquareOp {
  const float* g;
  float* v;
  float decay;
  float weight;
  __device__ float F(float gv, float vv) const {
    return decay * vv + weight * gv * gv;
  }
  __device__ void Apply1(int64_t i) const { v[i] = F(g[i], v[i]); }
  __device__ void Apply4(int64_t i) const {
    const float4 a = Load4(g, i);
    const float4 b = Load4(v, i);
    Store4(v, i,
           make_float4(F(a.x, b.x), F(a.y, b.y), F(a.z, b.z), F(a.w, b.w)));
  }
};

struct AdamDirectionOp {
  const float* m;
  const float* v;
  float* out;
  float m_scale;
  float v_scale;
  float eps;
  __device__ float F(float mv, float vv) const {
    return (mv * m_scale) / (sqrtf(vv * v_scale) + eps);
  }
  __device__ void Apply1(int64_t i) const { out[i] = F(m[i], v[i]); }
  __device__ void Apply4(int64_t i) const {
    const float4 a = Load4(m, i);
    const float4 b = Load4(v, i);
    Store4(out, i,
           make_float4(F(a.x, b.x), F(a.y, b.y), F(a.z, b.z), F(a.w, b.w)));
  }
};

struct AdamWOp {
  const float* g;
  float* p;
  float* m;
  float* v;
  AdamWScalars s;
  // Same operation order as torch.optim.AdamW's single-tensor path:
  //   param.mul_(1 - lr * wd); exp_avg.lerp_(grad, 1 - beta1);
  //   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2);
  //   denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps);
  //   param.addcdiv_(exp_avg, denom, value=-step_size)
  __device__ void Step(float gv, float& pv, float& mv, float& vv) const {
    pv = pv * s.decay;
    mv = LerpValue(mv, gv, s.lerp_weight);
    vv = vv * s.beta2;
    vv = vv + s.one_minus_beta2 * gv * gv;
    const float denom = sqrtf(vv) / s.bc2_sqrt + s.eps;
    pv = pv + (-s.step_size) * (mv / denom);
  }
  __device__ void Apply1(int64_t i) const {
    float pv = p[i], mv = m[i], vv = v[i];
    Step(g[i], pv, mv, vv);
    p[i] = pv;
    m[i] = mv;
    v[i] = vv;
  }
  __device__ void Apply4(int64_t i) const {
    const float4 gv = Load4(g, i);
    float4 pv = Load4(p, i), mv = Load4(m, i), vv = Load4(v, i);
    Step(gv.x, pv.x, mv.x, vv.x);
    Step(gv.y, pv.y, mv.y, vv.y);
    Step(gv.z, pv.z, mv.z, vv.z);
    Step(gv.w, pv.w, mv.w, vv.w);
    Store4(p, i, pv);
    Store4(m, i, mv);
    Store4(v, i, vv);
  }
};

template <typename TIn, typename TOut>
__global__ void ConvertKernel(int64_t n, const TIn* src, TOut* dst) {
  const int64_t stride = int64_t{blockDim.x} * gridDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dst[i] = static_cast<TOut>(src[i]);
  }
}

// ---- Reductions -----------------------------------------------------------

// What a sum of squares squares: x[i], or a[i] - b[i] rounded to float
// (bitwise what Axpby(1, a, -1, b) leaves), one or four at a time.
struct Elements {
  const float* x;
  __device__ float One(int64_t i) const { return x[i]; }
  __device__ float4 Four(int64_t i) const { return Load4(x, i); }
};
struct Differences {
  const float* a;
  const float* b;
  __device__ float One(int64_t i) const { return a[i] - b[i]; }
  __device__ float4 Four(int64_t i) const {
    const float4 u = Load4(a, i), w = Load4(b, i);
    return make_float4(u.x - w.x, u.y - w.y, u.z - w.z, u.w - w.w);
  }
};

// An elementwise op (Apply1 / Apply4) that writes `out`, applied while its
// changes are summed: new - old of each element of `out`, as float. Every
// element is visited exactly once, as by ElementwiseKernel.
template <class Op>
struct Changes {
  Op op;
  float* out;
  __device__ float One(int64_t i) const {
    const float old = out[i];
    op.Apply1(i);
    return out[i] - old;
  }
  __device__ float4 Four(int64_t i) const {
    const float4 old = Load4(out, i);
    op.Apply4(i);
    const float4 now = Load4(out, i);
    return make_float4(now.x - old.x, now.y - old.y, now.z - old.z,
                       now.w - old.w);
  }
};

// One thread's share of a sum of squares in double, as block `block` of
// `blocks` grid-striding over n values, in one fixed order for every kind
// of values (so a sum is the same bits whichever way its floats came, and
// whether it was reduced alone or among many: SumSquaresMany).
template <typename Values>
__device__ inline double ThreadSumSquares(int64_t n, const Values& values,
                                          bool vectorized, int64_t block,
                                          int64_t blocks) {
  const int64_t stride = int64_t{blockDim.x} * blocks;
  const int64_t tid = block * blockDim.x + threadIdx.x;
  double sum = 0.0;
  int64_t start = 0;
  if (vectorized) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 v = values.Four(i * 4);
      sum += double{v.x} * v.x + double{v.y} * v.y + double{v.z} * v.z +
             double{v.w} * v.w;
    }
    start = n4 * 4;
  }
  for (int64_t i = start + tid; i < n; i += stride) {
    const float v = values.One(i);
    sum += double{v} * v;
  }
  return sum;
}

// Per-block sums of squares.
template <typename Values>
__global__ void SumSquaresPartialKernel(int64_t n, Values values,
                                        bool vectorized, double* partials) {
  const double sum =
      BlockSum(ThreadSumSquares(n, values, vectorized, blockIdx.x, gridDim.x));
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// The sum of `count` partials over the block, in a fixed order (valid in
// thread 0).
__device__ inline double BlockSumOf(int count, const double* partials) {
  double sum = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  return BlockSum(sum);
}

// One block: sums `count` partials.
__global__ void SumPartialsKernel(int count, const double* partials,
                                  double* result) {
  const double sum = BlockSumOf(count, partials);
  if (threadIdx.x == 0) *result = sum;
}

// The segment block b of a launch over `count` segments works for: the
// last whose first_block is at or before b (empty segments start where the
// next one does, so the next one is found).
template <typename Segment>
__device__ inline int SegmentOfBlock(const Segment* segments, int count,
                                     int b) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (segments[mid].first_block <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// SumSquaresMany's partials: block b works for the segment whose blocks
// hold b, as that segment's block b - first_block of its own grid.
__global__ void SumSquaresManyPartialKernel(int count,
                                            const SumSquaresSegment* segments,
                                            double* partials) {
  const int b = blockIdx.x;
  const SumSquaresSegment s = segments[SegmentOfBlock(segments, count, b)];
  const double sum = BlockSum(ThreadSumSquares(
      s.n, Elements{s.x}, Aligned16(s.x), b - s.first_block, s.blocks));
  if (threadIdx.x == 0) partials[b] = sum;
}

// One block per segment: its partials into its result.
__global__ void SumSquaresManyResultKernel(const SumSquaresSegment* segments,
                                           const double* partials,
                                           double* results) {
  const SumSquaresSegment s = segments[blockIdx.x];
  const double sum = BlockSumOf(s.blocks, partials + s.first_block);
  if (threadIdx.x == 0) results[blockIdx.x] = sum;
}

__device__ inline bool AdamWVectorized(const AdamWSegment& t) {
  return Aligned16(t.g) && Aligned16(t.p) && Aligned16(t.m) && Aligned16(t.v);
}

// Block b works for its segment as that segment's block b - first_block of
// ElementwiseKernel's grid of `blocks` (elementwise results do not depend
// on the grid), or, with `partials`, of SumSquaresPartialKernel's over
// the changes (the same order: each change sum bitwise AdamWStep's).
__global__ void AdamWManyKernel(const __grid_constant__ AdamWMany many,
                                double* partials) {
  const int b = blockIdx.x;
  const AdamWSegment& t =
      many.segments[SegmentOfBlock(many.segments, many.count, b)];
  const AdamWOp op{t.g, t.p, t.m, t.v, many.s};
  const bool vectorized = AdamWVectorized(t);
  const int64_t block = b - t.first_block;
  if (partials != nullptr) {
    const double sum = BlockSum(ThreadSumSquares(t.n, Changes<AdamWOp>{op, t.p},
                                                 vectorized, block, t.blocks));
    if (threadIdx.x == 0) partials[b] = sum;
    return;
  }
  ThreadElementwise(t.n, op, vectorized, block, t.blocks);
}

// One block per segment: its partials into its result.
__global__ void AdamWManyResultKernel(const __grid_constant__ AdamWMany many,
                                      const double* partials, double* results) {
  const AdamWSegment& t = many.segments[blockIdx.x];
  const double sum = BlockSumOf(t.blocks, partials + t.first_block);
  if (threadIdx.x == 0) results[blockIdx.x] = sum;
}

__global__ void FlagNonFiniteKernel(int64_t n, const float* x, int* flag) {
  const int64_t stride = int64_t{blockDim.x} * gridDim.x;
  bool bad = false;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    bad |= !isfinite(x[i]);
  }
  // Racing writers all store the same value.
  if (bad) *flag = 1;
}

// x *= float(numerator / (size(x) + eps)) from the sums of squares in
// sums[0] (the reference's, when there is one) and sums[1] (x's): every
// thread takes the same double arithmetic the host would, then ScaleOp.
__global__ void ScaleToNormKernel(int64_t n, const double* sums,
                                  bool has_reference, double divisor,
                                  double eps, float* x, bool vectorized) {
  const double numerator = has_reference ? sqrt(sums[0] / divisor) : 1.0;
  const float factor =
      static_cast<float>(numerator / (sqrt(sums[1] / divisor) + eps));
  ThreadElementwise(n, ScaleOp{x, factor}, vectorized, blockIdx.x, gridDim.x);
}

// One block: n is a factor's side (its eigenvalues). The smallest x
// (NaN ignored, as fmin does) is reduced in shared memory, then each thread
// lifts and raises its own elements in double, as the host loop did. Every
// thread reads x before the barrier and only its own elements after it, so
// out may alias x.
__global__ void LiftedPowerKernel(int64_t n, const float* x, double floor,
                                  double exponent, float* out) {
  __shared__ float lowest[kThreads];
  float m = CUDART_INF_F;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = fminf(m, x[i]);
  lowest[threadIdx.x] = m;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      lowest[threadIdx.x] = fminf(lowest[threadIdx.x], lowest[threadIdx.x + s]);
    }
    __syncthreads();
  }
  const double m_all = lowest[0];
  const bool lift = m_all < floor;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    double v = x[i];
    if (lift) v = v - m_all + floor;
    out[i] = static_cast<float>(pow(v, exponent));
  }
}

// The blocks a sum of squares of n values runs on (0 for none).
int ReductionBlocks(const LaunchConfig& cfg, int64_t n, bool vectorized) {
  if (n <= 0) return 0;
  const int blocks = GridFor(cfg, vectorized ? CeilDiv(n, 4) : n);
  return blocks > kMaxReductionBlocks ? kMaxReductionBlocks : blocks;
}

template <typename Values>
cudaError_t LaunchSumSquares(const LaunchConfig& cfg, int64_t n, Values values,
                             bool vectorized, double* partials,
                             double* result) {
  if (n <= 0) return cudaMemsetAsync(result, 0, sizeof(double), cfg.stream);
  const int blocks = ReductionBlocks(cfg, n, vectorized);
  SumSquaresPartialKernel<<<blocks, kThreads, 0, cfg.stream>>>(
      n, values, vectorized, partials);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  SumPartialsKernel<<<1, kThreads, 0, cfg.stream>>>(blocks, partials, result);
  return cudaGetLastError();
}

// `op` applied to n elements while the sum of squares of its changes to
// `out` goes to change.result (ChangeSum).
template <class Op>
cudaError_t LaunchCounted(const LaunchConfig& cfg, int64_t n, const Op& op,
                          float* out, bool vectorized,
                          const ChangeSum& change) {
  return LaunchSumSquares(cfg, n, Changes<Op>{op, out}, vectorized,
                          change.partials, change.result);
}

}  // namespace

// ---- Wrappers -------------------------------------------------------------

cudaError_t Fill(const LaunchConfig& cfg, int64_t n, float value, float* dst) {
  return LaunchElementwise(cfg, n, FillOp{dst, value}, Aligned16(dst));
}

cudaError_t Lerp(const LaunchConfig& cfg, int64_t n, const float* a,
                 const float* b, float weight, float* out) {
  return LaunchElementwise(cfg, n, LerpOp{a, b, out, weight},
                           Aligned16(a) && Aligned16(b) && Aligned16(out));
}

cudaError_t NesterovMomentum(const LaunchConfig& cfg, int64_t n, float beta,
                             const float* grad, float* momentum, float* out) {
  return LaunchElementwise(
      cfg, n, NesterovMomentumOp{grad, momentum, out, 1.0f - beta, beta},
      Aligned16(grad) && Aligned16(momentum) && Aligned16(out));
}

cudaError_t Axpby(const LaunchConfig& cfg, int64_t n, float alpha,
                  const float* x, float beta, float* y,
                  const ChangeSum* change) {
  const AxpbyOp op{x, y, alpha, beta};
  const bool vectorized = Aligned16(x) && Aligned16(y);
  if (change != nullptr) {
    return LaunchCounted(cfg, n, op, y, vectorized, *change);
  }
  return LaunchElementwise(cfg, n, op, vectorized);
}

cudaError_t Scale(const LaunchConfig& cfg, int64_t n, float alpha, float* x) {
  return LaunchElementwise(cfg, n, ScaleOp{x, alpha}, Aligned16(x));
}

cudaError_t ScaleToNorm(const LaunchConfig& cfg, int64_t n,
                        const float* reference, double divisor, double eps,
                        float* x, double* partials, double* sums) {
  if (n <= 0) return cudaSuccess;
  if (reference != nullptr) {
    const cudaError_t err = SumSquares(cfg, n, reference, partials, sums);
    if (err != cudaSuccess) return err;
  }
  const cudaError_t err = SumSquares(cfg, n, x, partials, sums + 1);
  if (err != cudaSuccess) return err;
  const bool vectorized = Aligned16(x);
  const int grid = GridFor(cfg, vectorized ? CeilDiv(n, 4) : n);
  ScaleToNormKernel<<<grid, kThreads, 0, cfg.stream>>>(
      n, sums, reference != nullptr, divisor, eps, x, vectorized);
  return cudaGetLastError();
}

cudaError_t LiftedPower(const LaunchConfig& cfg, int64_t n, const float* x,
                        double floor, double exponent, float* out) {
  if (n <= 0) return cudaSuccess;
  LiftedPowerKernel<<<1, kThreads, 0, cfg.stream>>>(n, x, floor, exponent, out);
  return cudaGetLastError();
}

cudaError_t EmaSquare(const LaunchConfig& cfg, int64_t n, float decay,
                      float weight, const float* g, float* v) {
  return LaunchElementwise(cfg, n, EmaSquareOp{g, v, decay, weight},
                           Aligned16(g) && Aligned16(v));
}

cudaError_t AdamDirection(const LaunchConfig& cfg, int64_t n, const float* m,
                          float m_scale, const float* v, float v_scale,
                          float eps, float* out) {
  return LaunchElementwise(cfg, n,
                           AdamDirectionOp{m, v, out, m_scale, v_scale, eps},
                           Aligned16(m) && Aligned16(v) && Aligned16(out));
}

cudaError_t AdamWStep(const LaunchConfig& cfg, int64_t n, const AdamWScalars& s,
                      const float* g, float* p, float* m, float* v,
                      const ChangeSum* change) {
  const AdamWOp op{g, p, m, v, s};
  const bool vectorized =
      Aligned16(g) && Aligned16(p) && Aligned16(m) && Aligned16(v);
  if (change != nullptr) {
    return LaunchCounted(cfg, n, op, p, vectorized, *change);
  }
  return LaunchElementwise(cfg, n, op, vectorized);
}

int AdamWBlocks(const LaunchConfig& cfg, int64_t n, const float* g,
                const float* p, const float* m, const float* v, bool counted) {
  if (n <= 0) return 0;
  const bool vectorized =
      Aligned16(g) && Aligned16(p) && Aligned16(m) && Aligned16(v);
  if (counted) return ReductionBlocks(cfg, n, vectorized);
  return GridFor(cfg, vectorized ? CeilDiv(n, 4) : n);
}

cudaError_t AdamWStepMany(const LaunchConfig& cfg, const AdamWMany& many,
                          int total_blocks, double* partials, double* results) {
  if (many.count <= 0 || total_blocks <= 0) return cudaSuccess;
  AdamWManyKernel<<<total_blocks, kThreads, 0, cfg.stream>>>(many, partials);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || partials == nullptr) return err;
  AdamWManyResultKernel<<<many.count, kThreads, 0, cfg.stream>>>(many, partials,
                                                                 results);
  return cudaGetLastError();
}

cudaError_t FloatToDouble(const LaunchConfig& cfg, int64_t n, const float* src,
                          double* dst) {
  if (n <= 0) return cudaSuccess;
  ConvertKernel<float, double>
      <<<GridFor(cfg, n), kThreads, 0, cfg.stream>>>(n, src, dst);
  return cudaGetLastError();
}

cudaError_t DoubleToFloat(const LaunchConfig& cfg, int64_t n, const double* src,
                          float* dst) {
  if (n <= 0) return cudaSuccess;
  ConvertKernel<double, float>
      <<<GridFor(cfg, n), kThreads, 0, cfg.stream>>>(n, src, dst);
  return cudaGetLastError();
}

cudaError_t SumSquares(const LaunchConfig& cfg, int64_t n, const float* x,
                       double* partials, double* result) {
  return LaunchSumSquares(cfg, n, Elements{x}, Aligned16(x), partials, result);
}

int SumSquaresBlocks(const LaunchConfig& cfg, int64_t n, const float* x) {
  return ReductionBlocks(cfg, n, Aligned16(x));
}

cudaError_t SumSquaresMany(const LaunchConfig& cfg, int count,
                           const SumSquaresSegment* segments, int total_blocks,
                           double* partials, double* results) {
  if (count <= 0) return cudaSuccess;
  if (total_blocks > 0) {
    SumSquaresManyPartialKernel<<<total_blocks, kThreads, 0, cfg.stream>>>(
        count, segments, partials);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  SumSquaresManyResultKernel<<<count, kThreads, 0, cfg.stream>>>(
      segments, partials, results);
  return cudaGetLastError();
}

cudaError_t SquaredDistance(const LaunchConfig& cfg, int64_t n, const float* a,
                            const float* b, double* partials, double* result) {
  return LaunchSumSquares(cfg, n, Differences{a, b},
                          Aligned16(a) && Aligned16(b), partials, result);
}

cudaError_t FlagNonFinite(const LaunchConfig& cfg, int64_t n, const float* x,
                          int* flag) {
  if (n <= 0) return cudaSuccess;
  FlagNonFiniteKernel<<<GridFor(cfg, n), kThreads, 0, cfg.stream>>>(n, x, flag);
  return cudaGetLastError();
}

}  // namespace canzona::cuda_kernels
