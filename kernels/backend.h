// The numeric backend interface: the dense linear algebra and fused
// elementwise kernels that Canzona's optimizer update rules are written in.
//
// Two implementations: `cpu` (OpenBLAS + LAPACKE, kernels/cpu) and `cuda`
// (cuBLAS + cuSOLVER + our kernels, kernels/cuda). Update rules in
// server/optim call only this interface, so the same rule runs on either.
//
// Conventions (all methods):
// - Matrices are float32, row-major (like PyTorch): element (i, j) of a
//   rows x cols matrix with leading dimension ld lives at a[i * ld + j].
// - Every pointer argument points into the backend's own memory space
//   (host memory for cpu, device memory for cuda): allocate with Allocate()
//   and move data with CopyFromHost / CopyToHost. Index arrays (`perm`) and
//   scalars are host values.
// - Outputs may alias inputs for elementwise kernels; GEMM/SYRK outputs must
//   not alias their inputs.
// - Work is ordered: each call sees the results of the previous calls on the
//   same backend. Only methods returning host values (SumSquares, CopyToHost,
//   Synchronize) wait for the device; the Enqueue copies leave their host
//   side to the next Synchronize.
//
// Example:
//   CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
//                            CreateBackend(BackendKind::kCpu));
//   CANZONA_ASSIGN_OR_RETURN(DeviceBuffer x, backend->Allocate(rows * cols));
//   CANZONA_RETURN_IF_ERROR(backend->CopyFromHost(host, x.size(), x.data()));
//   CANZONA_RETURN_IF_ERROR(backend->NewtonSchulz(spec, 1, rows, cols,
//                                                 x.data(), x.data()));
//
// Thread-safety: a Backend is not thread-safe. It is owned by one device
// worker thread (which owns its stream and library handles); distinct
// Backend objects may be used from distinct threads concurrently.
#ifndef CANZONA_KERNELS_BACKEND_H_
#define CANZONA_KERNELS_BACKEND_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/allocation_registry.h"
#include "kernels/ns_algorithm.h"

namespace canzona {

enum class BackendKind { kCpu, kCuda };

// Where a backend's memory lives, which decides how its entry points check
// the ranges they are given (kernels/allocation_registry.h):
//  - kHost (cpu): host memory is the backend's memory; a range may be one
//    of its allocations or any other host memory, but never one that
//    starts in an allocation and leaves it, or runs into one.
//  - kDevice (cuda, and the tests' device-like backend): every device
//    argument lies inside one of its live allocations or memory registered
//    with it (RegisterMemory); every host argument lies outside them all.
enum class MemorySpace { kHost, kDevice };

// "cpu" / "cuda".
absl::string_view BackendKindName(BackendKind kind);
// Parses "cpu" / "cuda"; INVALID_ARGUMENT naming the value otherwise.
absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name);

enum class Transpose { kNo, kYes };

// Arithmetic precision of Newton-Schulz's GEMMs. Accumulation is always
// float32; kBfloat16 rounds the operands (X, A, B) to bfloat16 as every peer
// implementation does on GPUs. The cpu backend supports only kFloat32.
enum class NsPrecision { kFloat32, kBfloat16 };

// Precision of a symmetric eigendecomposition. kFloat64 computes in double
// internally (inputs and outputs stay float32); Shampoo retries with it when
// the float32 solver fails to converge.
enum class EigenPrecision { kFloat32, kFloat64 };

// A fully resolved Newton-Schulz iteration:
//   X <- X / (norm_scale * ||X||_F + norm_eps)
//   for each (a, b, c) in coefficients:
//     A = X X^T; B = a I + b A + c A A; X = B X
// applied to the wide orientation of the matrix (transposed when
// rows > cols, transposed back afterwards).
//
// `algorithm` kGram computes the same polynomial through the s x s Gram
// matrix (kernels/ns_algorithm.h): R = X X^T once, per step
// P = a I + b R + c R R, Q <- P Q, R <- P R P, finally X <- Q X. R and the
// products that feed Q stay float32 at either precision (R squares X's
// conditioning; bf16 would lose the small singular values). kAuto picks per
// shape with ResolveNsAlgorithm.
struct NewtonSchulzSpec {
  std::vector<std::array<float, 3>> coefficients;  // one triple per step
  float norm_scale = 1.0f;
  float norm_eps = 1e-7f;
  NsPrecision precision = NsPrecision::kFloat32;
  NsAlgorithm algorithm = NsAlgorithm::kStandard;
  // The standard iteration's symmetric products X X^T and A A computed one
  // triangle only (cpu: SYRK for both; cuda float32: SYRK where it runs it;
  // cuda bf16: the lower tiles, kernels/symmetric_tiles.h, where the short
  // side splits into tiles of 1024 or more), then mirrored. False: full
  // GEMMs, the baseline `canzonactl bench kernels` times it against.
  bool symmetric_products = true;
};

// The algorithm `spec` runs as on `batch` rows x cols matrices on a backend
// of `kind` (kAuto resolved with that backend's s x s product cost).
NsAlgorithm ResolvedNsAlgorithm(const NewtonSchulzSpec& spec, BackendKind kind,
                                int64_t rows, int64_t cols);

class Backend;

// Foreign memory registered with a backend (Backend::RegisterMemory) for as
// long as this handle lives. Move-only; the backend must outlive it.
//
// Thread-safety: as the owning Backend.
class RegisteredMemory {
 public:
  RegisteredMemory() = default;
  RegisteredMemory(AllocationRegistry* registry, const void* begin)
      : registry_(registry), begin_(begin) {}
  RegisteredMemory(RegisteredMemory&& other) noexcept {
    *this = std::move(other);
  }
  RegisteredMemory& operator=(RegisteredMemory&& other) noexcept {
    if (this != &other) {
      Reset();
      registry_ = other.registry_;
      begin_ = other.begin_;
      other.registry_ = nullptr;
    }
    return *this;
  }
  ~RegisteredMemory() { Reset(); }
  void Reset() {
    if (registry_ != nullptr) registry_->Remove(begin_);
    registry_ = nullptr;
  }

 private:
  AllocationRegistry* registry_ = nullptr;
  const void* begin_ = nullptr;
};

// A float32 array in a backend's memory space. Move-only; returns its memory
// to the backend on destruction. The backend must outlive the buffer.
//
// Thread-safety: as the owning Backend.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend* owner, float* data, int64_t size)
      : owner_(owner), data_(data), size_(size) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  float* data() const { return data_; }
  int64_t size() const { return size_; }
  // The backend whose memory this is (null when empty).
  Backend* owner() const { return owner_; }
  bool empty() const { return size_ == 0; }
  inline void Reset();

 private:
  Backend* owner_ = nullptr;
  float* data_ = nullptr;
  int64_t size_ = 0;
};

// Whether an update (Axpby's y, AdamWStep's p) also queues the sum of
// squares of the change it makes, (new - old)^2 with the change rounded to
// float, on EnqueueSumSquares' queue, in the pass that applies it: an
// update's size at no extra memory traffic. The sum is the one
// EnqueueSquaredDistance(n, new, old) queues (on cpu bit for bit; on cuda
// in the same order where every array the update reads or writes is
// 16-byte aligned: Axpby's x and y, AdamWStep's g, p, m and v, and the
// distance's new and old; otherwise the two may differ in the last bits,
// as a float sum taken in another order does).
enum class SquaredChange { kIgnore, kQueue };

// Non-Virtual Interface: the public methods are the only entry points. Each
// validates its arguments once for every implementation (INVALID_ARGUMENT
// naming the method and the field, e.g. "Gemm: lda = 3 is smaller than the
// row length 5"), returns early from calls that touch no element, and then
// calls the matching private Do-method (Gemm -> DoGemm). An implementation
// therefore sees only valid, non-empty calls and checks nothing but its own
// limits (e.g. 32-bit library indices); kernels/backend_validation.cc holds
// the entry points.
class Backend {
 public:
  virtual ~Backend() = default;

  virtual BackendKind kind() const = 0;
  // Human-readable description, e.g. "cpu (OpenBLAS 0.3.21, 2 threads)" or
  // "cuda:0 (NVIDIA H100 80GB HBM3, sm_90)".
  virtual std::string description() const = 0;
  // The stream the backend's work runs on (a cudaStream_t), for callers
  // that order other streams after it with events; null for backends that
  // finish every call before returning (cpu).
  virtual void* native_stream() const { return nullptr; }
  // Where the backend's memory lives (see MemorySpace).
  virtual MemorySpace memory_space() const = 0;

  // ---- Memory ranges ------------------------------------------------------
  // Every entry point below checks each range it is given against these:
  // the backend's live allocations (exactly what Allocate was asked for)
  // and the memory registered with it. A violation is INVALID_ARGUMENT
  // naming the method, the argument, the range and the allocation.
  const AllocationRegistry& allocations() const { return allocations_; }
  // Registers [begin, begin + bytes), memory the backend did not allocate
  // but whose ranges its callers pass (a trainer's CUDA IPC or shared
  // memory buffers), until the returned handle goes. INVALID_ARGUMENT when
  // it overlaps a live allocation or registration.
  absl::StatusOr<RegisteredMemory> RegisterMemory(const void* begin,
                                                  int64_t bytes,
                                                  absl::string_view label);

  // ---- Memory -------------------------------------------------------------
  // Zero-filled float32 array of `count` elements (count >= 0).
  // RESOURCE_EXHAUSTED when the memory cannot be had.
  absl::StatusOr<DeviceBuffer> Allocate(int64_t count);
  absl::Status CopyFromHost(const float* host, int64_t count, float* dst);
  absl::Status CopyToHost(const float* src, int64_t count, float* host);
  // The same two copies enqueued in the backend's order without a wait:
  // `host` must stay as it is until the next Synchronize or waiting
  // CopyToHost (FromHost; other calls that wait on a GPU do not release
  // it by contract, and the device-like cpu backend holds callers to
  // that), and holds the values only after it (ToHost). On page-locked
  // host memory a GPU moves them by DMA at the link's rate while the host
  // goes on; a caller moving many ranges pays one wait instead of one per
  // range.
  absl::Status EnqueueCopyFromHost(const float* host, int64_t count,
                                   float* dst);
  absl::Status EnqueueCopyToHost(const float* src, int64_t count, float* host);
  // src == dst is a no-op; partly overlapping ranges are INVALID_ARGUMENT
  // (undefined on a GPU), as in Copy2D.
  absl::Status Copy(const float* src, int64_t count, float* dst);
  // Copies a rows x cols block between strided row-major layouts.
  absl::Status Copy2D(int64_t rows, int64_t cols, const float* src,
                      int64_t src_ld, float* dst, int64_t dst_ld);
  absl::Status Fill(float value, int64_t count, float* dst);
  // Waits until all work issued so far has finished.
  absl::Status Synchronize();

  // ---- Dense linear algebra (row-major) ----------------------------------
  // C[m x n] = alpha * op(A) * op(B) + beta * C, op(A) is m x k. C may
  // not overlap A or B (INVALID_ARGUMENT; undefined in cuBLAS), nor, in
  // the batched form, one entry's C another's; spans are compared, so an
  // interleaved layout that touches no common element is refused too.
  absl::Status Gemm(Transpose trans_a, Transpose trans_b, int64_t m, int64_t n,
                    int64_t k, float alpha, const float* a, int64_t lda,
                    const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc);
  // `batch` independent GEMMs; matrix i of A starts at a + i * stride_a, etc.
  absl::Status GemmStridedBatched(Transpose trans_a, Transpose trans_b,
                                  int64_t m, int64_t n, int64_t k, float alpha,
                                  const float* a, int64_t lda, int64_t stride_a,
                                  const float* b, int64_t ldb, int64_t stride_b,
                                  float beta, float* c, int64_t ldc,
                                  int64_t stride_c, int64_t batch);
  // Symmetric rank-k update, half the flops of the equivalent GEMM:
  //   kNo:  C[n x n] = alpha * A A^T + beta * C, A is n x k;
  //   kYes: C[n x n] = alpha * A^T A + beta * C, A is k x n.
  // Both triangles of C are written (the result is the full matrix). With
  // beta != 0 the old C must be symmetric: only one triangle of it is read.
  absl::Status Syrk(Transpose trans, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, float beta, float* c,
                    int64_t ldc);
  // Eigendecomposition of the symmetric n x n matrix `a` (both triangles
  // set). On success `a` holds the orthonormal eigenvectors as columns
  // (a[i * n + j] = component i of eigenvector j) and `eigenvalues` the n
  // eigenvalues in ascending order. INTERNAL if the solver fails to converge
  // or an eigenvalue is not finite (a NaN or an infinity in `a`): checked
  // with the solver's own report to the host, no wait of its own.
  absl::Status SymmetricEigen(int64_t n, float* a, float* eigenvalues,
                              EigenPrecision precision);
  // Householder QR of the rows x cols matrix `a` (rows >= cols), replacing
  // `a` by the thin Q factor, with LAPACK's sign convention (geqrf + orgqr).
  absl::Status QrOrthonormalize(int64_t rows, int64_t cols, float* a);
  // Orthogonalizes `batch` contiguous rows x cols matrices (matrix i at
  // input + i * rows * cols) into `output` (may equal `input`).
  // UNIMPLEMENTED when the backend lacks spec.precision, whatever the shape.
  absl::Status NewtonSchulz(const NewtonSchulzSpec& spec, int64_t batch,
                            int64_t rows, int64_t cols, const float* input,
                            float* output);
  // Grows the Newton-Schulz workspace for `batch` rows x cols matrices now,
  // so that NewtonSchulz of that size allocates nothing later (rules call
  // it at creation; a step then never allocates, not even the first).
  absl::Status ReserveNewtonSchulz(const NewtonSchulzSpec& spec, int64_t batch,
                                   int64_t rows, int64_t cols);
  // Bytes of the backend's grow-only workspaces held now (Newton-Schulz,
  // solvers, reductions): memory reports count them.
  virtual int64_t workspace_bytes() const { return 0; }

  // ---- Fused elementwise kernels (n elements, outputs may alias) ---------
  // out = a + weight * (b - a), computed as torch.lerp does (from the b end
  // when |weight| >= 0.5) so results match PyTorch bit for bit.
  absl::Status Lerp(int64_t n, const float* a, const float* b, float weight,
                    float* out);
  // Nesterov momentum in one pass (torch.optim.Muon's): momentum =
  // Lerp(momentum, grad, 1 - beta), then out = Lerp(grad, momentum, beta),
  // bit for bit those two calls (four memory passes instead of six).
  absl::Status NesterovMomentum(int64_t n, float beta, const float* grad,
                                float* momentum, float* out);
  // y = alpha * x + beta * y, literally: with beta == 0 a NaN in y stays NaN
  // (unlike BLAS), so non-finite values are never silently dropped.
  // With SquaredChange::kQueue (here and in AdamWStep) the update also
  // queues its change's sum of squares (see SquaredChange).
  absl::Status Axpby(int64_t n, float alpha, const float* x, float beta,
                     float* y, SquaredChange change = SquaredChange::kIgnore);
  // x = alpha * x
  absl::Status Scale(int64_t n, float alpha, float* x);
  // v = decay * v + weight * g * g
  absl::Status EmaSquare(int64_t n, float decay, float weight, const float* g,
                         float* v);
  // out = (m * m_scale) / (sqrt(v * v_scale) + eps)
  absl::Status AdamDirection(int64_t n, const float* m, float m_scale,
                             const float* v, float v_scale, float eps,
                             float* out);
  // One torch.optim.AdamW step (single-tensor path, same operation order):
  //   p *= 1 - lr * weight_decay; m = lerp(m, g, 1 - beta1);
  //   v = beta2 * v + (1 - beta2) * g * g;
  //   p -= (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
  absl::Status AdamWStep(int64_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, int64_t step,
                         const float* g, float* p, float* m, float* v,
                         SquaredChange change = SquaredChange::kIgnore);
  // AdamWStep on several tensors sharing the hyperparameters and the step
  // (one optimizer group's vectors: norms, biases, embeddings), bitwise
  // what AdamWStep on each in order gives, and with kQueue each tensor's
  // change sum queued as its own call queues it, in order. On cuda a few
  // launches for all of them, not one or two per tensor (at Qwen3-0.6B,
  // 115 AdamW tensors a step, most of 128 or 1024 elements). The tensors
  // must not share memory (on cuda they step concurrently).
  // INVALID_ARGUMENT naming "tensors[k].p" and so on.
  struct AdamWTensor {
    int64_t n = 0;
    const float* g = nullptr;
    float* p = nullptr;
    float* m = nullptr;
    float* v = nullptr;
  };
  absl::Status AdamWStepMany(absl::Span<const AdamWTensor> tensors, float lr,
                             float beta1, float beta2, float eps,
                             float weight_decay, int64_t step,
                             SquaredChange change = SquaredChange::kIgnore);
  // Sum of squares accumulated in double; returns to the host (waits).
  // Non-finite exactly when an element of x is (squares of floats summed
  // in double cannot overflow), which the step relies on.
  absl::StatusOr<double> SumSquares(int64_t n, const float* x);
  // SumSquares of several vectors (xs[k] of ns[k] elements, into out[k]),
  // with one wait for all of them where SumSquares waits once each: the
  // step's finiteness and norm pass over every gradient is one host round
  // trip. Each sum is bitwise SumSquares's.
  absl::Status SumSquaresMany(absl::Span<const float* const> xs,
                              absl::Span<const int64_t> ns,
                              absl::Span<double> out);
  // The same one wait where the vectors come one at a time between other
  // work (the update RMS over a step's updates): EnqueueSumSquares queues
  // SumSquares(n, x) without waiting; TakeSumSquares waits once and returns
  // the queued sums added in the order queued (0 for none), then starts
  // over. Each queued sum is bitwise SumSquares's.
  absl::Status EnqueueSumSquares(int64_t n, const float* x);
  // Queues the sum of (a[i] - b[i])^2, the differences rounded to float (an
  // update's size from its new and old values) without writing them: the
  // bits EnqueueSumSquares gives on Axpby(n, 1, a, -1, b)'s output where
  // the three arrays share 16-byte alignment, in one read of a and b.
  absl::Status EnqueueSquaredDistance(int64_t n, const float* a,
                                      const float* b);
  absl::StatusOr<double> TakeSumSquares();
  // Returns true when every element is finite (waits).
  absl::StatusOr<bool> AllFinite(int64_t n, const float* x);
  // x *= float(numerator / (size(x) + eps)), computed where x lives and
  // without a host wait: size is the l2 norm (kL2) or the root mean square
  // (kRms) of n elements, numerator is size(reference), or 1 with
  // `reference` null, the ratio taken in double from sums of squares each
  // bitwise SumSquares's; so bitwise Scale(n, float(ratio), x) after two
  // SumSquares calls, less their two host round trips (Shampoo's grafting
  // gives its direction the graft's norm, SOAP's normalize_grads its update
  // unit RMS: before, a round trip per matrix per step). reference may
  // alias x.
  enum class Norm { kL2, kRms };
  absl::Status ScaleToNorm(int64_t n, const float* reference, Norm norm,
                           double eps, float* x);
  // out[i] = float(pow(x[i] - m + floor, exponent)) where m, the smallest
  // x, is below `floor`, else float(pow(x[i], exponent)): the values lifted
  // so that the smallest is `floor`, raised to `exponent`, in double, where
  // x lives and without a host wait (Shampoo's inverse roots of a factor's
  // eigenvalues, which a host loop took after a round trip and uploaded
  // from pageable memory). m ignores NaN; a NaN x[i] gives a NaN out[i].
  // out may alias x.
  absl::Status LiftedPower(int64_t n, const float* x, double floor,
                           double exponent, float* out);

  // ---- Device time ---------------------------------------------------------
  // Phases of work the host only enqueues (a GPU runs it later) are timed
  // where it runs: Mark(k) marks the point the backend's work has reached
  // in its order (a CUDA event on its stream; cpu: the clock now, its work
  // being done on return); SecondsBetween(a, b) is the time between two
  // marks once the work before both has finished, UNAVAILABLE while it has
  // not (callers then keep their host time). Marks 0 .. kTimeMarks - 1.
  static constexpr int kTimeMarks = 4;
  absl::Status Mark(int mark);
  absl::StatusOr<double> SecondsBetween(int from, int to);

  // How many calls so far waited for the backend's work to finish (on a
  // GPU, each is a host round trip with the device idle behind it):
  // Synchronize, CopyToHost, SumSquares, SumSquaresMany, AllFinite,
  // SymmetricEigen (its solver reports to the host), and TakeSumSquares
  // while queued sums wait unread (SumSquaresMany reads them in its own
  // wait). Counted here for every backend alike, so a cpu backend's count
  // is a GPU's: the engine's tests hold a step to its budget of waits.
  int64_t host_waits() const { return host_waits_; }
  // How many copies so far between this backend's device memory and host
  // memory that is not page-locked (kernels/pageable_copies.h): on a GPU
  // each goes through the driver's bounce buffer and may wait for the
  // stream inside the call. A host backend counts none. Any thread may
  // read it (StepResponse.pageable_copies).
  int64_t pageable_copies() const {
    return pageable_copies_.load(std::memory_order_relaxed);
  }

  // ---- Bounded host waits --------------------------------------------------
  // Each of those waits lasts at most `timeout`: past it, DEADLINE_EXCEEDED
  // naming the method, the backend's work still in flight. A GPU stream
  // can wait for good for another process's event (a trainer that died or
  // hangs in its own collective before its record), and an unbounded wait
  // would hold the rank's worker, and with it the rank's removal, as long
  // (ScopedWaitTimeout: a step's waits each end within the step timeout,
  // as its waits for the DP lane and its peers do).
  // absl::InfiniteDuration(), the default, waits as long as the work takes.
  // Once a wait gave up the backend is `stalled` until a wait finds its
  // work finished: every later wait, with a timeout or without, asks once
  // and fails at once (FAILED_PRECONDITION) while the work is in flight,
  // rather than hang or wait out another timeout (a checkpoint, a
  // teardown, the step's later waits); and a stalled backend frees nothing
  // its work may still use when destroyed (the memory is lost to the
  // process rather than the process to a hang).
  void set_wait_timeout(absl::Duration timeout) { wait_timeout_ = timeout; }
  absl::Duration wait_timeout() const { return wait_timeout_; }
  bool stalled() const { return stalled_; }

  // ---- Matrix helpers (row-major, contiguous: ld == cols) ----------------
  // a[i, i] += alpha for the n x n matrix a.
  absl::Status AddIdentity(int64_t n, float alpha, float* a);
  // a[i, j] *= d[j]
  absl::Status ScaleColumns(int64_t rows, int64_t cols, const float* d,
                            float* a);
  // out[j] = sum_i a[i, j] * b[i, j]   (zeros when rows == 0)
  absl::Status ColumnDots(int64_t rows, int64_t cols, const float* a,
                          const float* b, float* out);
  // dst's columns are src's in descending order of keys[0, cols): stable
  // (equal keys keep their order, -0 equal to +0), NaN keys last; that is
  // dst[:, j] = src[:, perm[j]] with the permutation a stable host sort of
  // the keys gives, bit for bit, but sorted where the keys live (SOAP's
  // basis refresh copied its keys to the host and its permutation back: a
  // round trip and a pageable upload per side per refresh; the gathers by a
  // host permutation it used are gone with it). dst must not alias src;
  // keys may lie in either.
  absl::Status SortColumns(int64_t rows, int64_t cols, const float* keys,
                           const float* src, float* dst);
  // dst's rows are src's in descending order of keys[0, rows), as
  // SortColumns.
  absl::Status SortRows(int64_t rows, int64_t cols, const float* keys,
                        const float* src, float* dst);
  // dst[cols x rows] = src[rows x cols]^T   (dst must not alias src)
  absl::Status Transpose2D(int64_t rows, int64_t cols, const float* src,
                           float* dst);

 protected:
  friend class DeviceBuffer;
  // SymmetricEigen's INTERNAL for an eigenvalue that is not finite, the
  // same from every backend.
  static absl::Status NonFiniteEigenvalue();
  // Counts a copy by `what` of `bytes` whose host side at `host` is
  // pageable: here (pageable_copies) and process-wide (CountPageableCopy).
  void NotePageableCopy(absl::string_view what, const void* host,
                        int64_t bytes);
  // Returns memory obtained by DoAllocate. Never fails visibly.
  virtual void Free(float* data, int64_t size) = 0;
  // Where the host reaches the bytes at `data` (a buffer DoAllocate
  // returned, or memory registered with RegisterMemory), when not at
  // `data` (AllocationRegistry::Allocation::alias): the entry points hand
  // the Do-methods that address. Null for real memory (every production
  // backend).
  virtual const void* HostAlias(const float* /*data*/) const { return nullptr; }
  // Adds a sum computed on the host to the default queue (a backend whose
  // DoEnqueue-methods finish on return).
  void QueueHostSum(double sum) { queued_sum_squares_ += sum; }
  // How a Do-method waits for the backend's work, as the wait timeout
  // says: `finished` asks without blocking (cudaStreamQuery), `block`
  // waits without a bound (cudaStreamSynchronize: no polling where no
  // timeout is set), `pause` runs between two questions (PollUntilDone's
  // after its first 50 us). `method` names the wait in errors.
  absl::Status AwaitWork(
      absl::string_view method,
      const std::function<absl::StatusOr<bool>()>& finished,
      const std::function<absl::Status()>& block,
      const std::function<void(absl::Duration)>& pause = absl::SleepFor);

 private:
  // Counts a host wait of `method` (host_waits), then DoBeginHostWait.
  absl::Status BeginHostWait(absl::string_view method);
  // Runs a Do-method that waits for the backend's work: if a wait in it
  // gave up (AwaitWork), the call fails whatever the method returned, so
  // that no implementation can report results its wait never saw.
  template <typename Result, typename Call>
  Result RunWaiting(absl::string_view method, Call call) {
    const int64_t given_up = waits_given_up_;
    Result result = call();
    if (result.ok() && waits_given_up_ != given_up) {
      return GaveUpButSucceeded(method);
    }
    return result;
  }
  static absl::Status GaveUpButSucceeded(absl::string_view method);
  // Where a backend whose work is done when each call returns, standing
  // in for a GPU in tests, waits for work that may never finish (the cpu
  // backend's SetDeviceLikeWorkBlocked): at each host wait's start, through
  // AwaitWork. A GPU backend waits inside its Do-methods instead.
  virtual absl::Status DoBeginHostWait(absl::string_view /*method*/) {
    return absl::OkStatus();
  }

  // Forgets a buffer's allocation, then frees it (DeviceBuffer::Reset).
  void Release(float* data, int64_t size) {
    allocations_.Remove(data);
    Free(data, size);
  }

  AllocationRegistry allocations_;
  // The default EnqueueSumSquares' sums so far, added in order.
  double queued_sum_squares_ = 0;
  int64_t host_waits_ = 0;
  std::atomic<int64_t> pageable_copies_{0};
  absl::Duration wait_timeout_ = absl::InfiniteDuration();
  int64_t waits_given_up_ = 0;  // AwaitWork's, ever
  bool stalled_ = false;
  // The default DoMark's times (absl::Time as nanoseconds since the epoch;
  // 0: not marked).
  std::array<int64_t, kTimeMarks> marked_ns_ = {};
  // Sums queued since a wait last read them (host_waits).
  bool queued_unread_ = false;

  // ---- Implementations, one per public method ----------------------------
  // Called only with arguments the public method accepted and never for a
  // call that touches no element: every size below is >= 0, every pointer
  // addressing an element is set, every leading dimension covers its row,
  // every perm is a permutation, and the sizes the comments name are > 0.

  // A backend's own limits on a Newton-Schulz spec, checked before the
  // empty-call shortcut (an unsupported precision is a configuration error
  // whatever shape first meets it). Default: everything supported.
  virtual absl::Status CheckSupported(const NewtonSchulzSpec& /*spec*/) const {
    return absl::OkStatus();
  }

  // count > 0 and count * sizeof(float) fits in int64_t.
  virtual absl::StatusOr<DeviceBuffer> DoAllocate(int64_t count) = 0;
  // count > 0 (Copy: src != dst).
  virtual absl::Status DoCopyFromHost(const float* host, int64_t count,
                                      float* dst) = 0;
  virtual absl::Status DoCopyToHost(const float* src, int64_t count,
                                    float* host) = 0;
  // Default: the waiting copies (a backend whose copies never wait).
  virtual absl::Status DoEnqueueCopyFromHost(const float* host, int64_t count,
                                             float* dst) {
    return DoCopyFromHost(host, count, dst);
  }
  virtual absl::Status DoEnqueueCopyToHost(const float* src, int64_t count,
                                           float* host) {
    return DoCopyToHost(src, count, host);
  }
  virtual absl::Status DoCopy(const float* src, int64_t count, float* dst) = 0;
  // rows, cols > 0.
  virtual absl::Status DoCopy2D(int64_t rows, int64_t cols, const float* src,
                                int64_t src_ld, float* dst, int64_t dst_ld) = 0;
  // count > 0.
  virtual absl::Status DoFill(float value, int64_t count, float* dst) = 0;
  virtual absl::Status DoSynchronize() = 0;

  // m, n > 0; k may be 0 (then C = beta * C, and beta == 0 clears C).
  virtual absl::Status DoGemm(Transpose trans_a, Transpose trans_b, int64_t m,
                              int64_t n, int64_t k, float alpha, const float* a,
                              int64_t lda, const float* b, int64_t ldb,
                              float beta, float* c, int64_t ldc) = 0;
  // m, n, batch > 0; k may be 0; strides >= 0.
  virtual absl::Status DoGemmStridedBatched(
      Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k,
      float alpha, const float* a, int64_t lda, int64_t stride_a,
      const float* b, int64_t ldb, int64_t stride_b, float beta, float* c,
      int64_t ldc, int64_t stride_c, int64_t batch) = 0;
  // n > 0; k may be 0.
  virtual absl::Status DoSyrk(Transpose trans, int64_t n, int64_t k,
                              float alpha, const float* a, int64_t lda,
                              float beta, float* c, int64_t ldc) = 0;
  // n > 0.
  virtual absl::Status DoSymmetricEigen(int64_t n, float* a, float* eigenvalues,
                                        EigenPrecision precision) = 0;
  // rows >= cols > 0.
  virtual absl::Status DoQrOrthonormalize(int64_t rows, int64_t cols,
                                          float* a) = 0;
  // batch, rows, cols > 0; CheckSupported(spec) passed.
  virtual absl::Status DoNewtonSchulz(const NewtonSchulzSpec& spec,
                                      int64_t batch, int64_t rows, int64_t cols,
                                      const float* input, float* output) = 0;
  // The same arguments; a backend without a workspace has nothing to do.
  virtual absl::Status DoReserveNewtonSchulz(const NewtonSchulzSpec& /*spec*/,
                                             int64_t /*batch*/,
                                             int64_t /*rows*/,
                                             int64_t /*cols*/) {
    return absl::OkStatus();
  }

  // n > 0 for each of these.
  virtual absl::Status DoLerp(int64_t n, const float* a, const float* b,
                              float weight, float* out) = 0;
  virtual absl::Status DoNesterovMomentum(int64_t n, float beta,
                                          const float* grad, float* momentum,
                                          float* out) = 0;
  virtual absl::Status DoAxpby(int64_t n, float alpha, const float* x,
                               float beta, float* y, SquaredChange change) = 0;
  virtual absl::Status DoScale(int64_t n, float alpha, float* x) = 0;
  virtual absl::Status DoEmaSquare(int64_t n, float decay, float weight,
                                   const float* g, float* v) = 0;
  virtual absl::Status DoAdamDirection(int64_t n, const float* m, float m_scale,
                                       const float* v, float v_scale, float eps,
                                       float* out) = 0;
  // step >= 1.
  virtual absl::Status DoAdamWStep(int64_t n, float lr, float beta1,
                                   float beta2, float eps, float weight_decay,
                                   int64_t step, const float* g, float* p,
                                   float* m, float* v,
                                   SquaredChange change) = 0;
  // Every tensor non-empty, its pointers resolved. Default: DoAdamWStep on
  // each in order.
  virtual absl::Status DoAdamWStepMany(absl::Span<const AdamWTensor> tensors,
                                       float lr, float beta1, float beta2,
                                       float eps, float weight_decay,
                                       int64_t step, SquaredChange change);
  virtual absl::StatusOr<double> DoSumSquares(int64_t n, const float* x) = 0;
  // xs, ns and out of one size, each ns[k] >= 0 (a zero sum for 0); by
  // default DoSumSquares once each (a backend that waits per call batches).
  virtual absl::Status DoSumSquaresMany(absl::Span<const float* const> xs,
                                        absl::Span<const int64_t> ns,
                                        absl::Span<double> out);
  // n > 0. Default: DoSumSquares now, its sum kept on the host.
  virtual absl::Status DoEnqueueSumSquares(int64_t n, const float* x);
  virtual absl::Status DoEnqueueSquaredDistance(int64_t n, const float* a,
                                                const float* b) = 0;
  virtual absl::StatusOr<double> DoTakeSumSquares();
  // Default: the host clock (a backend whose calls finish on return).
  virtual absl::Status DoMark(int mark);
  virtual absl::StatusOr<double> DoSecondsBetween(int from, int to);
  virtual absl::StatusOr<bool> DoAllFinite(int64_t n, const float* x) = 0;
  virtual absl::Status DoScaleToNorm(int64_t n, const float* reference,
                                     Norm norm, double eps, float* x) = 0;
  // n > 0.
  virtual absl::Status DoLiftedPower(int64_t n, const float* x, double floor,
                                     double exponent, float* out) = 0;

  // n > 0.
  virtual absl::Status DoAddIdentity(int64_t n, float alpha, float* a) = 0;
  // rows, cols > 0.
  virtual absl::Status DoScaleColumns(int64_t rows, int64_t cols,
                                      const float* d, float* a) = 0;
  // cols > 0; rows may be 0 (then out is zeroed).
  virtual absl::Status DoColumnDots(int64_t rows, int64_t cols, const float* a,
                                    const float* b, float* out) = 0;
  // rows, cols > 0 for the sorts and the transpose.
  virtual absl::Status DoSortColumns(int64_t rows, int64_t cols,
                                     const float* keys, const float* src,
                                     float* dst) = 0;
  virtual absl::Status DoSortRows(int64_t rows, int64_t cols, const float* keys,
                                  const float* src, float* dst) = 0;
  virtual absl::Status DoTranspose2D(int64_t rows, int64_t cols,
                                     const float* src, float* dst) = 0;
};

inline DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    owner_ = other.owner_;
    data_ = other.data_;
    size_ = other.size_;
    other.owner_ = nullptr;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

inline void DeviceBuffer::Reset() {
  if (owner_ != nullptr && data_ != nullptr) owner_->Release(data_, size_);
  owner_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

// Sets a backend's wait timeout for a scope (a step: the step timeout)
// and puts the one before back when it ends.
// Thread-safety: the backend's owner thread.
class ScopedWaitTimeout {
 public:
  ScopedWaitTimeout(Backend& backend, absl::Duration timeout)
      : backend_(backend), before_(backend.wait_timeout()) {
    backend_.set_wait_timeout(timeout);
  }
  ~ScopedWaitTimeout() { backend_.set_wait_timeout(before_); }
  ScopedWaitTimeout(const ScopedWaitTimeout&) = delete;
  ScopedWaitTimeout& operator=(const ScopedWaitTimeout&) = delete;

 private:
  Backend& backend_;
  const absl::Duration before_;
};

// The factory (kernels/backend_factory.cc, target canzona_kernels, which
// links every backend; the interface alone is canzona_backend).
//
// Creates a backend. `device` selects the GPU for kCuda (ignored for kCpu).
// kCuda without a usable device (or in a build without CUDA) returns
// FAILED_PRECONDITION whose message starts with "no usable CUDA device".
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind,
                                                       int device = 0);

// "auto" -> cuda when a device is present, else cpu; "cpu"; "cuda".
absl::StatusOr<std::unique_ptr<Backend>> CreateBackendByName(
    absl::string_view name, int device = 0);

// Memory allocations every backend in this process has made so far:
// Allocate() calls (host memory on cpu) and the cuda backend's device
// allocations (its pool and grow-only workspaces). A steady-state
// optimizer step must not change it; tests count it. Thread-safe.
// (Inline, so that every backend library counts into one variable without
// linking the factory.)
// The largest Allocate() so far (floats) bounds the daemon's working
// buffers in tests of the memory model.
namespace backend_internal {
inline std::atomic<int64_t> allocation_count{0};
inline std::atomic<int64_t> largest_allocation{0};
inline void CountAllocation() {
  allocation_count.fetch_add(1, std::memory_order_relaxed);
}
inline void NoteAllocationSize(int64_t floats) {
  int64_t seen = largest_allocation.load(std::memory_order_relaxed);
  while (floats > seen &&
         !largest_allocation.compare_exchange_weak(seen, floats)) {
  }
}
}  // namespace backend_internal
inline int64_t BackendAllocationCount() {
  return backend_internal::allocation_count.load();
}
inline int64_t BackendLargestAllocation() {
  return backend_internal::largest_allocation.load();
}
inline void ResetBackendLargestAllocation() {
  backend_internal::largest_allocation.store(0);
}

}  // namespace canzona

#endif  // CANZONA_KERNELS_BACKEND_H_
