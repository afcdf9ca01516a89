// The cpu Backend's class, shared by the files that implement it:
// cpu_backend.cc (lifetime, memory, copies, the device-like stand-in's
// waits), cpu_backend_linalg.cc (OpenBLAS, LAPACKE, Newton-Schulz and the
// matrix helpers) and cpu_backend_elementwise.cc (the elementwise loops
// and the sums). Internal to kernels/cpu: everything else reaches the
// backend through CreateCpuBackend (cpu_backend.h) and the Backend
// interface.
#ifndef CANZONA_KERNELS_CPU_CPU_BACKEND_IMPL_H_
#define CANZONA_KERNELS_CPU_CPU_BACKEND_IMPL_H_

#include <lapacke.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/cpu/gram_newton_schulz.h"

namespace canzona {
namespace cpu_internal {

// Sum of value(i)^2 in double over i < n, in the one order every cpu sum
// of squares uses: four partial sums break the serial add dependency;
// float * float is exact in double, so only the additions round.
template <typename Value>
double SumSquaresOf(int64_t n, Value value) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int j = 0; j < 4; ++j) {
      const double v = value(i + j);
      s[j] += v * v;
    }
  }
  for (; i < n; ++i) {
    const double v = value(i);
    s[0] += v * v;
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// The OpenBLAS + LAPACKE backend. Host memory is its memory space and every
// call completes before returning, so Synchronize has nothing to wait for.
// Backend's entry points validate the arguments; the Do-methods check only
// BLAS/LAPACK's 32-bit index range and the float32-only Newton-Schulz.
//
// Thread-safety: not thread-safe (as Backend): the scratch buffers used by
// NewtonSchulz, QrOrthonormalize and ColumnDots are per-object state.
// Distinct CpuBackend objects may be used concurrently.
class CpuBackend final : public Backend {
 public:
  CpuBackend(MemorySpace space, bool page_aligned);
  BackendKind kind() const override { return BackendKind::kCpu; }
  MemorySpace memory_space() const override { return space_; }

  std::string description() const override;

 protected:
  void Free(float* data, int64_t size) override;
  const void* HostAlias(const float* p) const override;

 private:
  // The float32 loops below are all this backend has; a precision it lacks
  // is a configuration error, reported whatever the shape.
  absl::Status CheckSupported(const NewtonSchulzSpec& spec) const override;

  // ---- Memory -------------------------------------------------------------

  static size_t Bytes(int64_t count) {
    return static_cast<size_t>(count) * sizeof(float);
  }
  // aligned_alloc requires the size to be a multiple of the alignment; the
  // entry point bounds count * sizeof(float), so this cannot wrap.
  size_t Padded(int64_t count) const {
    return (Bytes(count) + alignment_ - 1) / alignment_ * alignment_;
  }

  absl::StatusOr<DeviceBuffer> DoAllocate(int64_t count) override;

  // Host memory is the backend's memory, so all three copies are one
  // memmove (callers may pass overlapping ranges).
  absl::Status DoCopyFromHost(const float* host, int64_t count,
                              float* dst) override;
  absl::Status DoCopyToHost(const float* src, int64_t count,
                            float* host) override;
  // Standing in for a GPU, an enqueued copy from the host reads it now but
  // remembers what it read: a source changed before the next wait (which
  // a GPU may not have read yet) fails that wait.
  absl::Status DoEnqueueCopyFromHost(const float* host, int64_t count,
                                     float* dst) override;
  // Standing in for a GPU, the host side of an enqueued copy is written
  // at the next wait, with the values the copy read when enqueued: a
  // caller that reads it before Synchronize sees what a GPU would leave
  // there (the old bytes), here as on the device.
  absl::Status DoEnqueueCopyToHost(const float* src, int64_t count,
                                   float* host) override;
  // Standing in for a GPU, before a copy by `what` between `host` and the
  // device: one from or to host memory the fake runtime did not page-lock
  // is one a GPU would stage through a bounce buffer, counted, and one the
  // driver makes wait for the work ahead of it, a host wait
  // (DoBeginHostWait): the cuda backend's BeforeHostCopy, modelled.
  absl::Status BeforeHostCopy(absl::string_view what, const float* host,
                              int64_t count);
  absl::Status DoCopy(const float* src, int64_t count, float* dst) override;
  absl::Status DoCopy2D(int64_t rows, int64_t cols, const float* src,
                        int64_t src_ld, float* dst, int64_t dst_ld) override;
  absl::Status DoFill(float value, int64_t count, float* dst) override;
  absl::Status DoSynchronize() override;
  absl::Status DoBeginHostWait(absl::string_view method) override;
  // At a wait: releases the enqueued copies' host sources,
  // FAILED_PRECONDITION where one changed since (checked first: a copy to
  // the host enqueued after one from the same range lands after it, in
  // stream order), then completes the enqueued copies to the host, in
  // order.
  absl::Status Deliver();

  // ---- Dense linear algebra ----------------------------------------------

  absl::Status DoGemm(Transpose trans_a, Transpose trans_b, int64_t m,
                      int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta,
                      float* c, int64_t ldc) override;
  absl::Status DoGemmStridedBatched(Transpose trans_a, Transpose trans_b,
                                    int64_t m, int64_t n, int64_t k,
                                    float alpha, const float* a, int64_t lda,
                                    int64_t stride_a, const float* b,
                                    int64_t ldb, int64_t stride_b, float beta,
                                    float* c, int64_t ldc, int64_t stride_c,
                                    int64_t batch) override;
  absl::Status DoSyrk(Transpose trans, int64_t n, int64_t k, float alpha,
                      const float* a, int64_t lda, float beta, float* c,
                      int64_t ldc) override;
  absl::Status DoSymmetricEigen(int64_t n, float* a, float* eigenvalues,
                                EigenPrecision precision) override;
  static absl::Status EigenvaluesFinite(int64_t n, const float* eigenvalues);
  absl::Status DoQrOrthonormalize(int64_t rows, int64_t cols,
                                  float* a) override;
  int64_t workspace_bytes() const override;
  absl::Status DoReserveNewtonSchulz(const NewtonSchulzSpec& spec,
                                     int64_t batch, int64_t rows,
                                     int64_t cols) override;
  absl::Status DoNewtonSchulz(const NewtonSchulzSpec& spec, int64_t batch,
                              int64_t rows, int64_t cols, const float* input,
                              float* output) override;

  // ---- Fused elementwise kernels -----------------------------------------
  // Plain loops in float, evaluated in the same order as PyTorch's CPU
  // kernels so results match torch as closely as float rounding allows.

  absl::Status DoLerp(int64_t n, const float* a, const float* b, float weight,
                      float* out) override;
  absl::Status DoNesterovMomentum(int64_t n, float beta, const float* grad,
                                  float* momentum, float* out) override;
  absl::Status DoAxpby(int64_t n, float alpha, const float* x, float beta,
                       float* y, SquaredChange change) override;
  absl::Status DoScale(int64_t n, float alpha, float* x) override;
  absl::Status DoEmaSquare(int64_t n, float decay, float weight, const float* g,
                           float* v) override;
  absl::Status DoAdamDirection(int64_t n, const float* m, float m_scale,
                               const float* v, float v_scale, float eps,
                               float* out) override;
  absl::Status DoAdamWStep(int64_t n, float lr, float beta1, float beta2,
                           float eps, float weight_decay, int64_t step,
                           const float* g, float* p, float* m, float* v,
                           SquaredChange change) override;
  absl::StatusOr<double> DoSumSquares(int64_t n, const float* x) override;
  absl::Status DoEnqueueSquaredDistance(int64_t n, const float* a,
                                        const float* b) override;
  absl::StatusOr<bool> DoAllFinite(int64_t n, const float* x) override;
  absl::Status DoScaleToNorm(int64_t n, const float* reference, Norm norm,
                             double eps, float* x) override;
  absl::Status DoLiftedPower(int64_t n, const float* x, double floor,
                             double exponent, float* out) override;

  // ---- Matrix helpers ----------------------------------------------------

  absl::Status DoAddIdentity(int64_t n, float alpha, float* a) override;
  absl::Status DoScaleColumns(int64_t rows, int64_t cols, const float* d,
                              float* a) override;
  absl::Status DoColumnDots(int64_t rows, int64_t cols, const float* a,
                            const float* b, float* out) override;

  // dst[:, j] = src[:, order[j]] for the stable descending order of keys.
  absl::Status DoSortColumns(int64_t rows, int64_t cols, const float* keys,
                             const float* src, float* dst) override;

  // dst[i, :] = src[order[i], :].
  absl::Status DoSortRows(int64_t rows, int64_t cols, const float* keys,
                          const float* src, float* dst) override;
  absl::Status DoTranspose2D(int64_t rows, int64_t cols, const float* src,
                             float* dst) override;

  // ---- Helpers -------------------------------------------------------------

  // The indices of keys[0, n) in descending order, stable, NaN last (the
  // order SortColumns and SortRows define); in a member reused call to call.
  const std::vector<int64_t>& DescendingOrder(int64_t n, const float* keys);
  static absl::Status Move(const float* src, int64_t count, float* dst);

  // Arguments already validated; no size is 0 but k.
  static void GemmUnchecked(Transpose trans_a, Transpose trans_b, int64_t m,
                            int64_t n, int64_t k, float alpha, const float* a,
                            int64_t lda, const float* b, int64_t ldb,
                            float beta, float* c, int64_t ldc);
  static void SyrkUnchecked(Transpose trans, int64_t n, int64_t k, float alpha,
                            const float* a, int64_t lda, float beta, float* c,
                            int64_t ldc);

  // C = beta * C for a product with nothing to multiply (k == 0), with
  // BLAS's rule that beta == 0 overwrites C (so garbage/NaN in C does not
  // survive).
  static void ScaleByBeta(int64_t rows, int64_t cols, float beta, float* c,
                          int64_t ldc);
  static absl::Status LapackStatus(absl::string_view routine, lapack_int info);

  // Grow-only scratch (see Scratch): Newton-Schulz X, next X, A = X X^T,
  // B = b A + c A A.
  std::vector<float> ns_x_;
  std::vector<float> ns_y_;
  std::vector<float> ns_a_;
  std::vector<float> ns_b_;
  GramWorkspace gram_ws_;  // the Gram iteration's s x s buffers
  std::vector<float> tau_;
  std::vector<double> eig_a_;
  std::vector<double> eig_w_;
  std::vector<double> col_acc_;
  std::vector<int64_t> order_;  // DescendingOrder's

  // Runs update(i) for every i < n, in order; with SquaredChange::kQueue
  // also queues the sum of squares of what it changed in `out` (new - old
  // as float), in SumSquaresOf's order: EnqueueSquaredDistance's bits.
  template <typename Update>
  void ApplyEach(int64_t n, float* out, SquaredChange change, Update update) {
    if (change == SquaredChange::kIgnore) {
      for (int64_t i = 0; i < n; ++i) update(i);
      return;
    }
    QueueHostSum(SumSquaresOf(n, [&](int64_t i) {
      const float old = out[i];
      update(i);
      return out[i] - old;
    }));
  }

  const MemorySpace space_;
  // Of every allocation's start and padded size: kAlignment, or a page.
  const size_t alignment_;
  // Device-like memory: copies to the host enqueued and not yet delivered
  // (DoEnqueueCopyToHost).
  struct PendingCopy {
    float* host;
    std::vector<float> values;
  };
  std::vector<PendingCopy> pending_;
  // Device-like memory: the host sources of enqueued copies from the host
  // and what they held (DoEnqueueCopyFromHost).
  struct SourceCopy {
    const float* host;
    std::vector<float> values;
  };
  std::vector<SourceCopy> sources_;
};

}  // namespace cpu_internal
}  // namespace canzona

#endif  // CANZONA_KERNELS_CPU_CPU_BACKEND_IMPL_H_
