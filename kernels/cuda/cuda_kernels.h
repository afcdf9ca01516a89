// Launch wrappers for Canzona's own CUDA kernels (elementwise_kernels.cu and
// newton_schulz_kernels.cu). Internal to kernels/cuda: the backend validates
// arguments, sizes workspaces and turns the returned cudaError_t into an
// absl::Status; these wrappers only launch (on cfg.stream) and report the
// launch error from cudaGetLastError. Every wrapper is a no-op for empty
// inputs. All matrices are row-major and contiguous unless an ld is given.
//
// The header is plain C++ (no device code) so .cc files compiled by the host
// compiler can include it; bf16 buffers are passed as void*.
//
// Thread-safety: stateless functions; concurrent calls on distinct streams
// are safe.
#ifndef CANZONA_KERNELS_CUDA_CUDA_KERNELS_H_
#define CANZONA_KERNELS_CUDA_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace canzona::cuda_kernels {

// Where and how wide to launch. num_sms sizes grid-stride grids so that every
// SM has enough resident blocks to saturate memory bandwidth.
struct LaunchConfig {
  cudaStream_t stream = nullptr;
  int num_sms = 1;
};

// ---- Elementwise (outputs may alias inputs element for element) ----------
cudaError_t Fill(const LaunchConfig& cfg, int64_t n, float value, float* dst);
// torch.lerp: |w| < 0.5 ? a + w (b - a) : b - (b - a) (1 - w).
cudaError_t Lerp(const LaunchConfig& cfg, int64_t n, const float* a,
                 const float* b, float weight, float* out);
// momentum = Lerp(momentum, grad, 1 - beta); out = Lerp(grad, momentum,
// beta), in one pass, bit for bit the two Lerps.
cudaError_t NesterovMomentum(const LaunchConfig& cfg, int64_t n, float beta,
                             const float* grad, float* momentum, float* out);
// Where an update that counts its change (Backend's SquaredChange::kQueue)
// puts the sum of squares of that change: the reduction's partials
// (kMaxReductionBlocks doubles) and the result (one double), both device.
struct ChangeSum {
  double* partials;
  double* result;
};

// With `change`, the update also sums (new - old)^2 of its output (y, p)
// into it, in SumSquares' order, in the same pass.
cudaError_t Axpby(const LaunchConfig& cfg, int64_t n, float alpha,
                  const float* x, float beta, float* y,
                  const ChangeSum* change = nullptr);
cudaError_t Scale(const LaunchConfig& cfg, int64_t n, float alpha, float* x);
cudaError_t EmaSquare(const LaunchConfig& cfg, int64_t n, float decay,
                      float weight, const float* g, float* v);
cudaError_t AdamDirection(const LaunchConfig& cfg, int64_t n, const float* m,
                          float m_scale, const float* v, float v_scale,
                          float eps, float* out);

// Scalars of one torch.optim.AdamW step, rounded to float32 exactly where
// torch rounds them (host Python doubles become float kernel scalars).
struct AdamWScalars {
  float decay;            // 1 - lr * weight_decay
  float lerp_weight;      // 1 - beta1
  float beta2;            // beta2
  float one_minus_beta2;  // 1 - beta2
  float step_size;        // lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  float eps;
};
cudaError_t AdamWStep(const LaunchConfig& cfg, int64_t n, const AdamWScalars& s,
                      const float* g, float* p, float* m, float* v,
                      const ChangeSum* change = nullptr);

// AdamWStep on up to kAdamWManyMax tensors in one launch (two with their
// change sums), passed by value as the launch's parameters (no table to
// copy, nothing to keep alive after the launch; 48 bytes a tensor keeps
// the parameters under CUDA's classic 4 KB). Tensor k runs on blocks
// [first_block, first_block + blocks) of the launch as AdamWStep runs it
// on a grid of `blocks` (AdamWBlocks), so every result, and every change
// sum, is bitwise AdamWStep's alone.
struct AdamWSegment {
  const float* g;
  float* p;
  float* m;
  float* v;
  int64_t n;
  int32_t first_block;
  int32_t blocks;
};
inline constexpr int kAdamWManyMax = 64;
struct AdamWMany {
  AdamWSegment segments[kAdamWManyMax];
  int count;
  AdamWScalars s;
};
static_assert(sizeof(AdamWMany) <= 4096,
              "AdamWMany is a kernel parameter: CUDA's classic limit is 4 KB");
// The blocks AdamWStep runs n elements on (counted: with a ChangeSum).
int AdamWBlocks(const LaunchConfig& cfg, int64_t n, const float* g,
                const float* p, const float* m, const float* v, bool counted);
// `total_blocks`: the segments' blocks together. With `partials`
// (total_blocks doubles) and `results` (count doubles), each tensor's
// change sum goes to results[k], as AdamWStep's ChangeSum::result.
cudaError_t AdamWStepMany(const LaunchConfig& cfg, const AdamWMany& many,
                          int total_blocks, double* partials = nullptr,
                          double* results = nullptr);

cudaError_t FloatToDouble(const LaunchConfig& cfg, int64_t n, const float* src,
                          double* dst);
cudaError_t DoubleToFloat(const LaunchConfig& cfg, int64_t n, const double* src,
                          float* dst);

// ---- Reductions -----------------------------------------------------------
// Number of doubles `partials` must hold for SumSquares.
inline constexpr int kMaxReductionBlocks = 1024;
// *result = sum x[i]^2 in double, deterministic (fixed reduction order).
// partials: kMaxReductionBlocks doubles; result: one double (both device).
cudaError_t SumSquares(const LaunchConfig& cfg, int64_t n, const float* x,
                       double* partials, double* result);
// One vector of SumSquaresMany: n floats at x, reduced by blocks
// [first_block, first_block + blocks) of the launch.
struct SumSquaresSegment {
  const float* x;
  int64_t n;
  int32_t first_block;
  int32_t blocks;  // SumSquaresBlocks(cfg, n, x)
};
// The blocks SumSquares reduces n floats at x on (0 when n == 0).
int SumSquaresBlocks(const LaunchConfig& cfg, int64_t n, const float* x);
// results[s] = sum of segment s's x[i]^2 for `count` segments in two
// launches, each bitwise SumSquares' sum (the same blocks, threads and
// order; an empty segment sums to 0). segments (device): first_block
// ascending from 0, blocks adding up to total_blocks; partials:
// total_blocks doubles; results: count doubles.
cudaError_t SumSquaresMany(const LaunchConfig& cfg, int count,
                           const SumSquaresSegment* segments, int total_blocks,
                           double* partials, double* results);
// *result = sum (a[i] - b[i])^2, the differences rounded to float: the bits
// SumSquares gives on Axpby(1, a, -1, b)'s output where a, b and that
// output share 16-byte alignment.
cudaError_t SquaredDistance(const LaunchConfig& cfg, int64_t n, const float* a,
                            const float* b, double* partials, double* result);
// x *= float(numerator / (sqrt(sums[1] / divisor) + eps)) where sums[1] is
// SumSquares(x) and numerator sqrt(sums[0] / divisor), sums[0] being
// SumSquares(reference), or 1 with reference null: Backend::ScaleToNorm
// without a host wait. partials: kMaxReductionBlocks doubles; sums: two
// doubles (both device).
cudaError_t ScaleToNorm(const LaunchConfig& cfg, int64_t n,
                        const float* reference, double divisor, double eps,
                        float* x, double* partials, double* sums);
// Backend::LiftedPower: out[i] = float(pow(x[i] - m + floor, exponent))
// where m = min(x) < floor, else float(pow(x[i], exponent)); one block.
cudaError_t LiftedPower(const LaunchConfig& cfg, int64_t n, const float* x,
                        double floor, double exponent, float* out);
// Sets *flag = 1 when some x[i] is not finite; *flag must be zeroed first.
cudaError_t FlagNonFinite(const LaunchConfig& cfg, int64_t n, const float* x,
                          int* flag);

// ---- Matrix helpers -------------------------------------------------------
cudaError_t AddIdentity(const LaunchConfig& cfg, int64_t n, float alpha,
                        float* a);
cudaError_t ScaleColumns(const LaunchConfig& cfg, int64_t rows, int64_t cols,
                         const float* d, float* a);
// out[j] = sum_i a[i, j] b[i, j], accumulated in double.
cudaError_t ColumnDots(const LaunchConfig& cfg, int64_t rows, int64_t cols,
                       const float* a, const float* b, float* out);
// order[r] = the index of the r-th key of keys[0, n) in descending order:
// stable, NaN last (Backend::SortColumns). order: n device int64s.
cudaError_t DescendingOrder(const LaunchConfig& cfg, int64_t n,
                            const float* keys, int64_t* order);
// perm is a device array.
cudaError_t GatherColumns(const LaunchConfig& cfg, int64_t rows, int64_t cols,
                          const int64_t* perm, const float* src, float* dst);
cudaError_t GatherRows(const LaunchConfig& cfg, int64_t rows, int64_t cols,
                       const int64_t* perm, const float* src, float* dst);
// dst[b] (cols x rows) = src[b]^T (rows x cols) for `batch` contiguous
// matrices. dst must not alias src.
cudaError_t Transpose(const LaunchConfig& cfg, int64_t batch, int64_t rows,
                      int64_t cols, const float* src, float* dst);
cudaError_t TransposeDoubleToFloat(const LaunchConfig& cfg, int64_t rows,
                                   int64_t cols, const double* src, float* dst);
// For each of `batch` n x n matrices c + b * stride (leading dimension ldc):
// copies the upper triangle onto the strict lower one (c[i][j] = c[j][i] for
// i > j), completing a SYRK result that cuBLAS wrote to one triangle only.
cudaError_t MirrorUpperToLower(const LaunchConfig& cfg, int64_t batch,
                               int64_t n, float* c, int64_t ldc,
                               int64_t stride);

// ---- Newton-Schulz helpers (newton_schulz_kernels.cu) --------------------
enum class NsElement { kFloat32, kBfloat16 };

// Blocks per matrix of the per-matrix norm reduction (partials per matrix).
int NsNormParts(int64_t matrix_size);
// partials[b * parts + p] = partial sums of squares of matrix b (in double).
cudaError_t NsSumSquares(const LaunchConfig& cfg, int64_t batch,
                         int64_t matrix_size, const float* x, int parts,
                         double* partials);
// denom[b] = norm_scale * sqrt(sum_p partials[b * parts + p]) + norm_eps.
cudaError_t NsDenominators(const LaunchConfig& cfg, int64_t batch, int parts,
                           const double* partials, float norm_scale,
                           float norm_eps, float* denom);
// dst[b] = src[b] / denom[b], converted to `elem`; src[b] is rows x cols and
// dst[b] is rows x cols, or cols x rows when `transpose`.
cudaError_t NsLoad(const LaunchConfig& cfg, int64_t batch, int64_t rows,
                   int64_t cols, bool transpose, const float* src,
                   const float* denom, NsElement elem, void* dst);
// dst[b] = src[b] converted to float32; src[b] is rows x cols of `elem`, dst[b]
// is rows x cols, or cols x rows when `transpose`.
cudaError_t NsStore(const LaunchConfig& cfg, int64_t batch, int64_t rows,
                    int64_t cols, bool transpose, NsElement elem,
                    const void* src, float* dst);
// MirrorUpperToLower on `batch` contiguous n x n matrices of `elem`.
cudaError_t NsMirrorUpperToLower(const LaunchConfig& cfg, int64_t batch,
                                 int64_t n, NsElement elem, void* c);
// The pointer arrays of the symmetric products' tiles
// (kernels/symmetric_tiles.h) for `batch` matrices of short side n and long
// side l, `count` tiles of side `side` each: nine arrays of batch * count
// pointers, one after the other in `out`, entry i * count + t of each
// being matrix i's tile t:
//   [0, 3): X X^T from x0 (A operands, B operands, results in a),
//   [3, 6): the same from x1,
//   [6, 9): A A (A operands and B operands in a, results in b).
// Element sizes by `elem`; x0 / x1 matrices l * n apart, a / b ones n * n.
cudaError_t NsSymmetricTilePointers(const LaunchConfig& cfg, int64_t batch,
                                    int64_t n, int64_t l, int64_t side,
                                    int64_t count, NsElement elem,
                                    const void* x0, const void* x1,
                                    const void* a, void* b, void** out);
// dst[b] = scale * src[b] + shift * I for `batch` contiguous n x n matrices
// of `elem`, computed in float32 and rounded once: the start of a
// Newton-Schulz step's polynomial a I + b A + c A A, to which cuBLAS adds
// c A A with beta 1, so that X B needs no copy of X for "a X".
cudaError_t NsScaleAddIdentity(const LaunchConfig& cfg, int64_t batch,
                               int64_t n, float scale, float shift,
                               NsElement elem, const void* src, void* dst);

}  // namespace canzona::cuda_kernels

#endif  // CANZONA_KERNELS_CUDA_CUDA_KERNELS_H_
