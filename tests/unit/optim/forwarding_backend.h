// ForwardingBackend: a Backend that hands every call to an inner one, for
// tests that watch or perturb what an update rule asks of its backend
// (override the Do-method of interest, call inner() for the rest). Buffers
// belong to the inner backend, so this wrapper never frees.
//
//   class CountingBackend : public ForwardingBackend {
//     absl::StatusOr<DeviceBuffer> DoAllocate(int64_t count) override {
//       ++allocations_;
//       return ForwardingBackend::DoAllocate(count);
//     }
//   };
//
// Thread-safety: as Backend (one thread).
#ifndef CANZONA_TESTS_UNIT_OPTIM_FORWARDING_BACKEND_H_
#define CANZONA_TESTS_UNIT_OPTIM_FORWARDING_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"

namespace canzona {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner)
      : inner_(std::move(inner)) {}

  BackendKind kind() const override { return inner_->kind(); }
  std::string description() const override { return inner_->description(); }
  MemorySpace memory_space() const override { return inner_->memory_space(); }

 protected:
  Backend& inner() { return *inner_; }

  void Free(float*, int64_t) override {}

  absl::StatusOr<DeviceBuffer> DoAllocate(int64_t count) override {
    return inner_->Allocate(count);
  }
  absl::Status DoCopyFromHost(const float* h, int64_t n, float* d) override {
    return inner_->CopyFromHost(h, n, d);
  }
  absl::Status DoCopyToHost(const float* d, int64_t n, float* h) override {
    return inner_->CopyToHost(d, n, h);
  }
  absl::Status DoCopy(const float* s, int64_t n, float* d) override {
    return inner_->Copy(s, n, d);
  }
  absl::Status DoCopy2D(int64_t r, int64_t c, const float* s, int64_t sl,
                        float* d, int64_t dl) override {
    return inner_->Copy2D(r, c, s, sl, d, dl);
  }
  absl::Status DoFill(float v, int64_t n, float* d) override {
    return inner_->Fill(v, n, d);
  }
  absl::Status DoSynchronize() override { return inner_->Synchronize(); }
  absl::Status DoGemm(Transpose ta, Transpose tb, int64_t m, int64_t n,
                      int64_t k, float alpha, const float* a, int64_t lda,
                      const float* b, int64_t ldb, float beta, float* c,
                      int64_t ldc) override {
    return inner_->Gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  absl::Status DoGemmStridedBatched(Transpose ta, Transpose tb, int64_t m,
                                    int64_t n, int64_t k, float alpha,
                                    const float* a, int64_t lda, int64_t sa,
                                    const float* b, int64_t ldb, int64_t sb,
                                    float beta, float* c, int64_t ldc,
                                    int64_t sc, int64_t batch) override {
    return inner_->GemmStridedBatched(ta, tb, m, n, k, alpha, a, lda, sa, b,
                                      ldb, sb, beta, c, ldc, sc, batch);
  }
  absl::Status DoSyrk(Transpose t, int64_t n, int64_t k, float alpha,
                      const float* a, int64_t lda, float beta, float* c,
                      int64_t ldc) override {
    return inner_->Syrk(t, n, k, alpha, a, lda, beta, c, ldc);
  }
  absl::Status DoSymmetricEigen(int64_t n, float* a, float* w,
                                EigenPrecision p) override {
    return inner_->SymmetricEigen(n, a, w, p);
  }
  absl::Status DoQrOrthonormalize(int64_t r, int64_t c, float* a) override {
    return inner_->QrOrthonormalize(r, c, a);
  }
  absl::Status DoNewtonSchulz(const NewtonSchulzSpec& spec, int64_t batch,
                              int64_t r, int64_t c, const float* in,
                              float* out) override {
    return inner_->NewtonSchulz(spec, batch, r, c, in, out);
  }
  absl::Status DoLerp(int64_t n, const float* a, const float* b, float w,
                      float* out) override {
    return inner_->Lerp(n, a, b, w, out);
  }
  absl::Status DoNesterovMomentum(int64_t n, float beta, const float* grad,
                                  float* momentum, float* out) override {
    return inner_->NesterovMomentum(n, beta, grad, momentum, out);
  }
  absl::Status DoAxpby(int64_t n, float alpha, const float* x, float beta,
                       float* y, SquaredChange change) override {
    return inner_->Axpby(n, alpha, x, beta, y, change);
  }
  absl::Status DoScale(int64_t n, float alpha, float* x) override {
    return inner_->Scale(n, alpha, x);
  }
  absl::Status DoEmaSquare(int64_t n, float decay, float weight, const float* g,
                           float* v) override {
    return inner_->EmaSquare(n, decay, weight, g, v);
  }
  absl::Status DoAdamDirection(int64_t n, const float* m, float ms,
                               const float* v, float vs, float eps,
                               float* out) override {
    return inner_->AdamDirection(n, m, ms, v, vs, eps, out);
  }
  absl::Status DoAdamWStep(int64_t n, float lr, float b1, float b2, float eps,
                           float wd, int64_t step, const float* g, float* p,
                           float* m, float* v, SquaredChange change) override {
    return inner_->AdamWStep(n, lr, b1, b2, eps, wd, step, g, p, m, v, change);
  }
  absl::Status DoAdamWStepMany(absl::Span<const AdamWTensor> tensors, float lr,
                               float b1, float b2, float eps, float wd,
                               int64_t step, SquaredChange change) override {
    return inner_->AdamWStepMany(tensors, lr, b1, b2, eps, wd, step, change);
  }
  absl::StatusOr<double> DoSumSquares(int64_t n, const float* x) override {
    return inner_->SumSquares(n, x);
  }
  // The queue is the inner backend's.
  absl::Status DoEnqueueSumSquares(int64_t n, const float* x) override {
    return inner_->EnqueueSumSquares(n, x);
  }
  absl::Status DoEnqueueSquaredDistance(int64_t n, const float* a,
                                        const float* b) override {
    return inner_->EnqueueSquaredDistance(n, a, b);
  }
  absl::StatusOr<double> DoTakeSumSquares() override {
    return inner_->TakeSumSquares();
  }
  absl::StatusOr<bool> DoAllFinite(int64_t n, const float* x) override {
    return inner_->AllFinite(n, x);
  }
  absl::Status DoScaleToNorm(int64_t n, const float* reference, Norm norm,
                             double eps, float* x) override {
    return inner_->ScaleToNorm(n, reference, norm, eps, x);
  }
  absl::Status DoLiftedPower(int64_t n, const float* x, double floor,
                             double exponent, float* out) override {
    return inner_->LiftedPower(n, x, floor, exponent, out);
  }
  absl::Status DoAddIdentity(int64_t n, float alpha, float* a) override {
    return inner_->AddIdentity(n, alpha, a);
  }
  absl::Status DoScaleColumns(int64_t r, int64_t c, const float* d,
                              float* a) override {
    return inner_->ScaleColumns(r, c, d, a);
  }
  absl::Status DoColumnDots(int64_t r, int64_t c, const float* a,
                            const float* b, float* out) override {
    return inner_->ColumnDots(r, c, a, b, out);
  }
  absl::Status DoSortColumns(int64_t r, int64_t c, const float* keys,
                             const float* s, float* d) override {
    return inner_->SortColumns(r, c, keys, s, d);
  }
  absl::Status DoSortRows(int64_t r, int64_t c, const float* keys,
                          const float* s, float* d) override {
    return inner_->SortRows(r, c, keys, s, d);
  }
  absl::Status DoTranspose2D(int64_t r, int64_t c, const float* s,
                             float* d) override {
    return inner_->Transpose2D(r, c, s, d);
  }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace canzona

#endif  // CANZONA_TESTS_UNIT_OPTIM_FORWARDING_BACKEND_H_
