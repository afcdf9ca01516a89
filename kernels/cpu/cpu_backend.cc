#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>
#include <lapacke.h>
#include <sanitizer/asan_interface.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/backend_checks.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/device_like_memory.h"
#include "kernels/cpu/gram_newton_schulz.h"

namespace canzona {
namespace {

namespace checks = backend_checks;

// Allocations are 64-byte aligned so that every buffer starts on a cache
// line and the widest vector loads (AVX-512) never straddle one.
constexpr size_t kAlignment = 64;

// Debian's OpenBLAS is LP64: BLAS/LAPACK index with 32-bit integers, so a
// larger size or leading dimension would wrap. This limit is the cpu
// backend's own (cuBLAS has a 64-bit API), hence checked here rather than in
// Backend's entry points.
static_assert(sizeof(blasint) == sizeof(int32_t));
absl::Status BlasIndex(absl::string_view what, absl::string_view field,
                       int64_t value) {
  return checks::Int32Index(what, field, value, "BLAS/LAPACK");
}

// Every size and leading dimension of one GEMM shape within BLAS's range.
absl::Status BlasGemmIndices(absl::string_view what, int64_t m, int64_t n,
                             int64_t k, int64_t lda, int64_t ldb, int64_t ldc) {
  CANZONA_RETURN_IF_ERROR(BlasIndex(what, "m", m));
  CANZONA_RETURN_IF_ERROR(BlasIndex(what, "n", n));
  CANZONA_RETURN_IF_ERROR(BlasIndex(what, "k", k));
  CANZONA_RETURN_IF_ERROR(BlasIndex(what, "lda", lda));
  CANZONA_RETURN_IF_ERROR(BlasIndex(what, "ldb", ldb));
  return BlasIndex(what, "ldc", ldc);
}

CBLAS_TRANSPOSE ToCblas(Transpose t) {
  return t == Transpose::kYes ? CblasTrans : CblasNoTrans;
}

// Copies the upper triangle of the n x n matrix c onto its lower triangle.
// ssyrk writes only one triangle; the interface promises the full matrix.
void MirrorUpperToLower(int64_t n, float* c, int64_t ldc) {
  for (int64_t i = 1; i < n; ++i) {
    float* row = c + i * ldc;
    for (int64_t j = 0; j < i; ++j) row[j] = c[j * ldc + i];
  }
}

// Cache-blocked transpose: a naive loop strides through dst by `rows` floats
// per element, touching a new cache line every store.
void TransposeBlocked(int64_t rows, int64_t cols, const float* src,
                      int64_t src_ld, float* dst, int64_t dst_ld) {
  constexpr int64_t kBlock = 32;
  for (int64_t i0 = 0; i0 < rows; i0 += kBlock) {
    const int64_t i1 = std::min(rows, i0 + kBlock);
    for (int64_t j0 = 0; j0 < cols; j0 += kBlock) {
      const int64_t j1 = std::min(cols, j0 + kBlock);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = j0; j < j1; ++j) {
          dst[j * dst_ld + i] = src[i * src_ld + j];
        }
      }
    }
  }
}

// Grows `v` to at least `n` elements; never shrinks, so steady-state calls
// with the same shapes do not allocate.
template <typename T>
T* Scratch(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

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
// Backend's entry points validate the arguments; the Do-methods below check
// only BLAS/LAPACK's 32-bit index range and the float32-only Newton-Schulz.
//
// Thread-safety: not thread-safe (as Backend): the scratch buffers used by
// NewtonSchulz, QrOrthonormalize and ColumnDots are per-object state.
// Distinct CpuBackend objects may be used concurrently.
std::atomic<bool> device_like_work_blocked{false};

class CpuBackend final : public Backend {
 public:
  CpuBackend(MemorySpace space, bool page_aligned)
      : space_(space),
        alignment_(page_aligned ? static_cast<size_t>(::sysconf(_SC_PAGESIZE))
                                : kAlignment) {}

  BackendKind kind() const override { return BackendKind::kCpu; }
  MemorySpace memory_space() const override { return space_; }

  std::string description() const override {
    const char* config = openblas_get_config();
    return absl::StrCat("cpu (", config != nullptr ? config : "OpenBLAS", ", ",
                        openblas_get_num_threads(), " threads)");
  }

 protected:
  void Free(float* data, int64_t size) override {
    if (space_ == MemorySpace::kDevice) {
      float* host =
          const_cast<float*>(static_cast<const float*>(HostAlias(data)));
      device_like::Unmap(data, Bytes(size));
      data = host;
    }
    ASAN_UNPOISON_MEMORY_REGION(data + size, Padded(size) - Bytes(size));
    std::free(data);
  }
  const void* HostAlias(const float* p) const override {
    return space_ == MemorySpace::kDevice ? device_like::HostAlias(p) : nullptr;
  }

 private:
  // The float32 loops below are all this backend has; a precision it lacks
  // is a configuration error, reported whatever the shape.
  absl::Status CheckSupported(const NewtonSchulzSpec& spec) const override {
    if (spec.precision == NsPrecision::kFloat32) return absl::OkStatus();
    return absl::UnimplementedError(
        "cpu backend: Newton-Schulz supports only float32");
  }

  // ---- Memory -------------------------------------------------------------

  static size_t Bytes(int64_t count) {
    return static_cast<size_t>(count) * sizeof(float);
  }
  // aligned_alloc requires the size to be a multiple of the alignment; the
  // entry point bounds count * sizeof(float), so this cannot wrap.
  size_t Padded(int64_t count) const {
    return (Bytes(count) + alignment_ - 1) / alignment_ * alignment_;
  }

  absl::StatusOr<DeviceBuffer> DoAllocate(int64_t count) override {
    const size_t bytes = Padded(count);
    void* p = std::aligned_alloc(alignment_, bytes);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "Allocate: cannot allocate ", count, " floats (", bytes, " bytes)"));
    }
    // The buffer is exactly `count` floats, as on a device: the range
    // checks use that size, and AddressSanitizer sees any access to the
    // alignment padding.
    std::memset(p, 0, Bytes(count));
    ASAN_POISON_MEMORY_REGION(static_cast<char*>(p) + Bytes(count),
                              bytes - Bytes(count));
    if (space_ == MemorySpace::kDevice) {
      // Standing in for a GPU: hand out an address the host cannot touch;
      // the entry points pass this memory's alias to the kernels below.
      absl::StatusOr<void*> device = device_like::Map(
          p, static_cast<int64_t>(Bytes(count)), "cpu backend as a device");
      if (!device.ok()) {
        std::free(p);
        return device.status();
      }
      p = *device;
    }
    backend_internal::CountAllocation();
    return DeviceBuffer(this, static_cast<float*>(p), count);
  }

  // Host memory is the backend's memory, so all three copies are one
  // memmove (callers may pass overlapping ranges).
  absl::Status DoCopyFromHost(const float* host, int64_t count,
                              float* dst) override {
    CountPageable("CopyFromHost", host, count);
    return Move(host, count, dst);
  }
  absl::Status DoCopyToHost(const float* src, int64_t count,
                            float* host) override {
    CountPageable("CopyToHost", host, count);
    CANZONA_RETURN_IF_ERROR(Deliver());
    return Move(src, count, host);
  }
  // Standing in for a GPU, an enqueued copy from the host reads it now but
  // remembers what it read: a source changed before the next wait (which
  // a GPU may not have read yet) fails that wait.
  absl::Status DoEnqueueCopyFromHost(const float* host, int64_t count,
                                     float* dst) override {
    if (space_ == MemorySpace::kDevice) {
      CountPageable("EnqueueCopyFromHost", host, count);
      sources_.push_back({host, std::vector<float>(host, host + count)});
    }
    return Move(host, count, dst);
  }
  // Standing in for a GPU, the host side of an enqueued copy is written
  // at the next wait, with the values the copy read when enqueued: a
  // caller that reads it before Synchronize sees what a GPU would leave
  // there (the old bytes), here as on the device.
  absl::Status DoEnqueueCopyToHost(const float* src, int64_t count,
                                   float* host) override {
    if (space_ == MemorySpace::kHost) return Move(src, count, host);
    CountPageable("EnqueueCopyToHost", host, count);
    pending_.push_back({host, std::vector<float>(src, src + count)});
    return absl::OkStatus();
  }
  // Standing in for a GPU: a copy from or to host memory the fake runtime
  // did not page-lock is one a GPU would stage through a bounce buffer.
  void CountPageable(absl::string_view what, const float* host, int64_t count) {
    const auto bytes = static_cast<int64_t>(Bytes(count));
    if (space_ == MemorySpace::kDevice && count > 0 &&
        !device_like::HostLocked(host, bytes)) {
      NotePageableCopy(what, host, bytes);
    }
  }
  absl::Status DoCopy(const float* src, int64_t count, float* dst) override {
    return Move(src, count, dst);
  }

  absl::Status DoCopy2D(int64_t rows, int64_t cols, const float* src,
                        int64_t src_ld, float* dst, int64_t dst_ld) override {
    if (src == dst) return absl::OkStatus();
    if (src_ld == cols && dst_ld == cols) return Move(src, rows * cols, dst);
    for (int64_t i = 0; i < rows; ++i) {
      std::memmove(dst + i * dst_ld, src + i * src_ld,
                   static_cast<size_t>(cols) * sizeof(float));
    }
    return absl::OkStatus();
  }

  absl::Status DoFill(float value, int64_t count, float* dst) override {
    std::fill(dst, dst + count, value);
    return absl::OkStatus();
  }

  absl::Status DoSynchronize() override { return Deliver(); }

  absl::Status DoBeginHostWait(absl::string_view method) override {
    if (space_ != MemorySpace::kDevice) return absl::OkStatus();
    auto finished = []() -> absl::StatusOr<bool> {
      return !device_like_work_blocked.load();
    };
    return AwaitWork(method, finished, [&]() -> absl::Status {
      const absl::Time give_up = absl::Now() + absl::Seconds(20);
      while (device_like_work_blocked.load() && absl::Now() < give_up) {
        absl::SleepFor(absl::Milliseconds(10));
      }
      if (!device_like_work_blocked.load()) return absl::OkStatus();
      return absl::InternalError(
          absl::StrCat(method,
                       ": a wait without a timeout on work that never "
                       "finishes; on a GPU it would never return"));
    });
  }
  // At a wait: releases the enqueued copies' host sources,
  // FAILED_PRECONDITION where one changed since (checked first: a copy to
  // the host enqueued after one from the same range lands after it, in
  // stream order), then completes the enqueued copies to the host, in
  // order.
  absl::Status Deliver() {
    absl::Status status;
    for (const SourceCopy& c : sources_) {
      if (status.ok() && std::memcmp(c.host, c.values.data(),
                                     c.values.size() * sizeof(float)) != 0) {
        status = absl::FailedPreconditionError(absl::StrCat(
            "EnqueueCopyFromHost: its host source (", c.values.size(),
            " floats at ", absl::Hex(reinterpret_cast<uintptr_t>(c.host)),
            ") changed before the wait that releases it; a GPU may copy "
            "the new bytes"));
      }
    }
    sources_.clear();
    for (const PendingCopy& c : pending_) {
      std::memcpy(c.host, c.values.data(), c.values.size() * sizeof(float));
    }
    pending_.clear();
    return status;
  }

  // ---- Dense linear algebra ----------------------------------------------

  absl::Status DoGemm(Transpose trans_a, Transpose trans_b, int64_t m,
                      int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta,
                      float* c, int64_t ldc) override {
    CANZONA_RETURN_IF_ERROR(BlasGemmIndices("Gemm", m, n, k, lda, ldb, ldc));
    GemmUnchecked(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c,
                  ldc);
    return absl::OkStatus();
  }

  absl::Status DoGemmStridedBatched(Transpose trans_a, Transpose trans_b,
                                    int64_t m, int64_t n, int64_t k,
                                    float alpha, const float* a, int64_t lda,
                                    int64_t stride_a, const float* b,
                                    int64_t ldb, int64_t stride_b, float beta,
                                    float* c, int64_t ldc, int64_t stride_c,
                                    int64_t batch) override {
    CANZONA_RETURN_IF_ERROR(
        BlasGemmIndices("GemmStridedBatched", m, n, k, lda, ldb, ldc));
    for (int64_t i = 0; i < batch; ++i) {
      GemmUnchecked(trans_a, trans_b, m, n, k, alpha, a + i * stride_a, lda,
                    b + i * stride_b, ldb, beta, c + i * stride_c, ldc);
    }
    return absl::OkStatus();
  }

  absl::Status DoSyrk(Transpose trans, int64_t n, int64_t k, float alpha,
                      const float* a, int64_t lda, float beta, float* c,
                      int64_t ldc) override {
    constexpr absl::string_view kWhat = "Syrk";
    CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "n", n));
    CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "k", k));
    CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "lda", lda));
    CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "ldc", ldc));
    SyrkUnchecked(trans, n, k, alpha, a, lda, beta, c, ldc);
    return absl::OkStatus();
  }

  absl::Status DoSymmetricEigen(int64_t n, float* a, float* eigenvalues,
                                EigenPrecision precision) override {
    CANZONA_RETURN_IF_ERROR(BlasIndex("SymmetricEigen", "n", n));
    const lapack_int ln = static_cast<lapack_int>(n);
    if (precision == EigenPrecision::kFloat32) {
      const lapack_int info =
          LAPACKE_ssyevd(LAPACK_ROW_MAJOR, 'V', 'U', ln, a, ln, eigenvalues);
      CANZONA_RETURN_IF_ERROR(LapackStatus("LAPACKE_ssyevd", info));
      return EigenvaluesFinite(n, eigenvalues);
    }
    // Shampoo falls back to double when the float32 solver fails; doing the
    // whole solve in double (not just refining) is what makes that retry
    // meaningful.
    const int64_t nn = n * n;
    double* da = Scratch(eig_a_, nn);
    double* dw = Scratch(eig_w_, n);
    for (int64_t i = 0; i < nn; ++i) da[i] = a[i];
    const lapack_int info =
        LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'U', ln, da, ln, dw);
    CANZONA_RETURN_IF_ERROR(LapackStatus("LAPACKE_dsyevd", info));
    for (int64_t i = 0; i < nn; ++i) a[i] = static_cast<float>(da[i]);
    for (int64_t i = 0; i < n; ++i) eigenvalues[i] = static_cast<float>(dw[i]);
    return EigenvaluesFinite(n, eigenvalues);
  }
  static absl::Status EigenvaluesFinite(int64_t n, const float* eigenvalues) {
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(eigenvalues[i])) return NonFiniteEigenvalue();
    }
    return absl::OkStatus();
  }

  absl::Status DoQrOrthonormalize(int64_t rows, int64_t cols,
                                  float* a) override {
    // cols <= rows, so rows bounds every index.
    CANZONA_RETURN_IF_ERROR(BlasIndex("QrOrthonormalize", "rows", rows));
    const lapack_int m = static_cast<lapack_int>(rows);
    const lapack_int n = static_cast<lapack_int>(cols);
    float* tau = Scratch(tau_, cols);
    CANZONA_RETURN_IF_ERROR(LapackStatus(
        "LAPACKE_sgeqrf", LAPACKE_sgeqrf(LAPACK_ROW_MAJOR, m, n, a, n, tau)));
    return LapackStatus("LAPACKE_sorgqr",
                        LAPACKE_sorgqr(LAPACK_ROW_MAJOR, m, n, n, a, n, tau));
  }

  int64_t workspace_bytes() const override {
    int64_t bytes = 0;
    for (const std::vector<float>* v :
         {&ns_x_, &ns_y_, &ns_a_, &ns_b_, &tau_}) {
      bytes += static_cast<int64_t>(v->capacity() * sizeof(float));
    }
    for (const std::vector<double>* v : {&eig_a_, &eig_w_, &col_acc_}) {
      bytes += static_cast<int64_t>(v->capacity() * sizeof(double));
    }
    bytes += static_cast<int64_t>(order_.capacity() * sizeof(int64_t));
    return bytes + gram_ws_.bytes();
  }

  absl::Status DoReserveNewtonSchulz(const NewtonSchulzSpec& spec,
                                     int64_t /*batch*/, int64_t rows,
                                     int64_t cols) override {
    // The matrices run one at a time: the workspace DoNewtonSchulz takes.
    const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
    Scratch(ns_x_, m * n);
    Scratch(ns_y_, m * n);
    if (ResolvedNsAlgorithm(spec, kind(), rows, cols) == NsAlgorithm::kGram) {
      gram_ws_.Reserve(m);
    } else {
      Scratch(ns_a_, m * m);
      Scratch(ns_b_, m * m);
    }
    return absl::OkStatus();
  }

  absl::Status DoNewtonSchulz(const NewtonSchulzSpec& spec, int64_t batch,
                              int64_t rows, int64_t cols, const float* input,
                              float* output) override {
    constexpr absl::string_view kWhat = "NewtonSchulz";
    CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "rows", rows));
    CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "cols", cols));
    const int64_t per_matrix = rows * cols;

    // Work on the wide orientation (m <= n) so X X^T is the smaller Gram
    // matrix.
    const bool transposed = rows > cols;
    const int64_t m = transposed ? cols : rows;
    const int64_t n = transposed ? rows : cols;
    // Gram (kernels/ns_algorithm.h) replaces the per-step loop below; its
    // s x s buffers are its own.
    const bool gram =
        ResolvedNsAlgorithm(spec, kind(), rows, cols) == NsAlgorithm::kGram;
    float* x = Scratch(ns_x_, m * n);
    float* y = Scratch(ns_y_, m * n);
    float* gram_xx = gram ? nullptr : Scratch(ns_a_, m * m);
    float* poly = gram ? nullptr : Scratch(ns_b_, m * m);
    const size_t x_bytes = static_cast<size_t>(m * n) * sizeof(float);

    for (int64_t i = 0; i < batch; ++i) {
      const float* in = input + i * per_matrix;
      float* out = output + i * per_matrix;
      if (transposed) {
        TransposeBlocked(rows, cols, in, cols, x, n);
      } else {
        std::memcpy(x, in, x_bytes);
      }

      double sum_squares = 0.0;
      for (int64_t j = 0; j < m * n; ++j) {
        sum_squares += static_cast<double>(x[j]) * x[j];
      }
      // Same float arithmetic as X / (norm_scale * X.norm() + eps) in torch.
      const float norm = static_cast<float>(std::sqrt(sum_squares));
      const float denom = spec.norm_scale * norm + spec.norm_eps;
      for (int64_t j = 0; j < m * n; ++j) x[j] = x[j] / denom;

      if (gram && !spec.coefficients.empty()) {
        if (cpu_internal::GramNewtonSchulz(spec, m, n, x, y, gram_ws_) == y) {
          std::swap(x, y);
        }
      }
      for (const std::array<float, 3>& abc :
           gram ? absl::Span<const std::array<float, 3>>()
                : absl::MakeConstSpan(spec.coefficients)) {
        // A = X X^T (ssyrk: half the flops of sgemm), both triangles.
        if (spec.symmetric_products) {
          SyrkUnchecked(Transpose::kNo, m, n, 1.0f, x, n, 0.0f, gram_xx, m);
        } else {
          GemmUnchecked(Transpose::kNo, Transpose::kYes, m, m, n, 1.0f, x, n, x,
                        n, 0.0f, gram_xx, m);
        }
        // B = a I + b A + c A A, so that X = B X has no "a X" term, which
        // would need a copy of X (sgemm's C must not alias its inputs); the
        // cuda backend does the same (newton_schulz.cc).
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t c = 0; c < m; ++c) {
            poly[r * m + c] = abc[1] * gram_xx[r * m + c];
          }
          poly[r * m + r] += abc[0];
        }
        // A is symmetric (mirrored), so A A = A A^T: ssyrk again, half the
        // flops, onto the symmetric a I + b A, whose upper triangle it
        // updates before mirroring.
        if (spec.symmetric_products) {
          SyrkUnchecked(Transpose::kNo, m, m, abc[2], gram_xx, m, 1.0f, poly,
                        m);
        } else {
          GemmUnchecked(Transpose::kNo, Transpose::kNo, m, m, m, abc[2],
                        gram_xx, m, gram_xx, m, 1.0f, poly, m);
        }
        GemmUnchecked(Transpose::kNo, Transpose::kNo, m, n, m, 1.0f, poly, m, x,
                      n, 0.0f, y, n);
        std::swap(x, y);
      }

      if (transposed) {
        TransposeBlocked(m, n, x, n, out, cols);
      } else {
        std::memcpy(out, x, x_bytes);
      }
    }
    return absl::OkStatus();
  }

  // ---- Fused elementwise kernels -----------------------------------------
  // Plain loops in float, evaluated in the same order as PyTorch's CPU
  // kernels so results match torch as closely as float rounding allows.

  absl::Status DoLerp(int64_t n, const float* a, const float* b, float weight,
                      float* out) override {
    // torch picks the formula that is exact at its nearer endpoint
    // (weight 0 -> a, weight 1 -> b).
    if (std::abs(weight) < 0.5f) {
      for (int64_t i = 0; i < n; ++i) out[i] = a[i] + weight * (b[i] - a[i]);
    } else {
      const float one_minus = 1.0f - weight;
      for (int64_t i = 0; i < n; ++i) {
        out[i] = b[i] - (b[i] - a[i]) * one_minus;
      }
    }
    return absl::OkStatus();
  }

  absl::Status DoNesterovMomentum(int64_t n, float beta, const float* grad,
                                  float* momentum, float* out) override {
    // The two Lerps themselves (on the host the saved passes matter little;
    // the bits are theirs by construction). Elementwise, so `out` may alias
    // either input.
    CANZONA_RETURN_IF_ERROR(DoLerp(n, momentum, grad, 1.0f - beta, momentum));
    return DoLerp(n, grad, momentum, beta, out);
  }

  absl::Status DoAxpby(int64_t n, float alpha, const float* x, float beta,
                       float* y, SquaredChange change) override {
    ApplyEach(n, y, change,
              [=](int64_t i) { y[i] = alpha * x[i] + beta * y[i]; });
    return absl::OkStatus();
  }

  absl::Status DoScale(int64_t n, float alpha, float* x) override {
    for (int64_t i = 0; i < n; ++i) x[i] = alpha * x[i];
    return absl::OkStatus();
  }

  absl::Status DoEmaSquare(int64_t n, float decay, float weight, const float* g,
                           float* v) override {
    // v.mul_(decay).addcmul_(g, g, value=weight): (weight * g) * g.
    for (int64_t i = 0; i < n; ++i) v[i] = v[i] * decay + weight * g[i] * g[i];
    return absl::OkStatus();
  }

  absl::Status DoAdamDirection(int64_t n, const float* m, float m_scale,
                               const float* v, float v_scale, float eps,
                               float* out) override {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = (m[i] * m_scale) / (std::sqrt(v[i] * v_scale) + eps);
    }
    return absl::OkStatus();
  }

  absl::Status DoAdamWStep(int64_t n, float lr, float beta1, float beta2,
                           float eps, float weight_decay, int64_t step,
                           const float* g, float* p, float* m, float* v,
                           SquaredChange change) override {
    // torch computes the scalars as Python floats (double) and rounds each to
    // float when it meets a float32 tensor; mirror that exactly.
    const double lr_d = lr;
    const double steps = static_cast<double>(step);
    const float decay = static_cast<float>(1.0 - lr_d * weight_decay);
    const float m_weight = static_cast<float>(1.0 - static_cast<double>(beta1));
    const float v_weight = static_cast<float>(1.0 - static_cast<double>(beta2));
    const double bias_correction1 = 1.0 - std::pow(double{beta1}, steps);
    const double bias_correction2 = 1.0 - std::pow(double{beta2}, steps);
    const float neg_step_size = static_cast<float>(-(lr_d / bias_correction1));
    const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
    // exp_avg.lerp_(grad, 1 - beta1) takes the small-weight branch unless
    // beta1 <= 0.5.
    const bool small_weight = std::abs(m_weight) < 0.5f;
    const float m_one_minus = 1.0f - m_weight;
    ApplyEach(n, p, change, [=](int64_t i) {
      const float gi = g[i];
      const float pi = p[i] * decay;
      const float mi = small_weight ? m[i] + m_weight * (gi - m[i])
                                    : gi - (gi - m[i]) * m_one_minus;
      const float vi = v[i] * beta2 + v_weight * gi * gi;
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      p[i] = pi + neg_step_size * mi / denom;
      m[i] = mi;
      v[i] = vi;
    });
    return absl::OkStatus();
  }

  absl::StatusOr<double> DoSumSquares(int64_t n, const float* x) override {
    return SumSquaresOf(n, [x](int64_t i) { return x[i]; });
  }

  absl::Status DoEnqueueSquaredDistance(int64_t n, const float* a,
                                        const float* b) override {
    // a - b rounded once: Axpby's 1 * a + -1 * b, bit for bit.
    QueueHostSum(SumSquaresOf(n, [a, b](int64_t i) { return a[i] - b[i]; }));
    return absl::OkStatus();
  }

  absl::StatusOr<bool> DoAllFinite(int64_t n, const float* x) override {
    // No early exit: a branch-free AND over the array lets the loop
    // vectorize, and non-finite values are the rare case.
    bool finite = true;
    for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(x[i]);
    return finite;
  }

  absl::Status DoScaleToNorm(int64_t n, const float* reference, Norm norm,
                             double eps, float* x) override {
    const double divisor = norm == Norm::kRms ? static_cast<double>(n) : 1.0;
    double numerator = 1.0;
    if (reference != nullptr) {
      CANZONA_ASSIGN_OR_RETURN(const double sum, DoSumSquares(n, reference));
      numerator = std::sqrt(sum / divisor);
    }
    CANZONA_ASSIGN_OR_RETURN(const double sum, DoSumSquares(n, x));
    return DoScale(
        n, static_cast<float>(numerator / (std::sqrt(sum / divisor) + eps)), x);
  }

  absl::Status DoLiftedPower(int64_t n, const float* x, double floor,
                             double exponent, float* out) override {
    double lowest = std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      lowest = std::fmin(lowest, static_cast<double>(x[i]));
    }
    const bool lift = lowest < floor;
    for (int64_t i = 0; i < n; ++i) {
      double v = x[i];
      if (lift) v = v - lowest + floor;
      out[i] = static_cast<float>(std::pow(v, exponent));
    }
    return absl::OkStatus();
  }

  // ---- Matrix helpers ----------------------------------------------------

  absl::Status DoAddIdentity(int64_t n, float alpha, float* a) override {
    for (int64_t i = 0; i < n; ++i) a[i * n + i] += alpha;
    return absl::OkStatus();
  }

  absl::Status DoScaleColumns(int64_t rows, int64_t cols, const float* d,
                              float* a) override {
    for (int64_t i = 0; i < rows; ++i) {
      float* row = a + i * cols;
      for (int64_t j = 0; j < cols; ++j) row[j] *= d[j];
    }
    return absl::OkStatus();
  }

  absl::Status DoColumnDots(int64_t rows, int64_t cols, const float* a,
                            const float* b, float* out) override {
    // Row-wise traversal keeps the reads contiguous; the per-column sums are
    // kept in double so long columns do not lose precision.
    double* acc = Scratch(col_acc_, cols);
    std::fill(acc, acc + cols, 0.0);
    for (int64_t i = 0; i < rows; ++i) {
      const float* ar = a + i * cols;
      const float* br = b + i * cols;
      for (int64_t j = 0; j < cols; ++j) {
        acc[j] += static_cast<double>(ar[j]) * br[j];
      }
    }
    for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<float>(acc[j]);
    return absl::OkStatus();
  }

  // dst[:, j] = src[:, order[j]] for the stable descending order of keys.
  absl::Status DoSortColumns(int64_t rows, int64_t cols, const float* keys,
                             const float* src, float* dst) override {
    const std::vector<int64_t>& order = DescendingOrder(cols, keys);
    for (int64_t i = 0; i < rows; ++i) {
      const float* s = src + i * cols;
      float* d = dst + i * cols;
      for (int64_t j = 0; j < cols; ++j) d[j] = s[order[j]];
    }
    return absl::OkStatus();
  }

  // dst[i, :] = src[order[i], :].
  absl::Status DoSortRows(int64_t rows, int64_t cols, const float* keys,
                          const float* src, float* dst) override {
    const std::vector<int64_t>& order = DescendingOrder(rows, keys);
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(dst + i * cols, src + order[i] * cols,
                  static_cast<size_t>(cols) * sizeof(float));
    }
    return absl::OkStatus();
  }

  absl::Status DoTranspose2D(int64_t rows, int64_t cols, const float* src,
                             float* dst) override {
    TransposeBlocked(rows, cols, src, cols, dst, rows);
    return absl::OkStatus();
  }

  // ---- Helpers -------------------------------------------------------------

  // The indices of keys[0, n) in descending order, stable, NaN last (the
  // order SortColumns and SortRows define); in a member reused call to call.
  const std::vector<int64_t>& DescendingOrder(int64_t n, const float* keys) {
    order_.resize(static_cast<size_t>(n));
    std::iota(order_.begin(), order_.end(), int64_t{0});
    std::stable_sort(order_.begin(), order_.end(),
                     [keys](int64_t a, int64_t b) {
                       return !std::isnan(keys[a]) &&
                              (std::isnan(keys[b]) || keys[a] > keys[b]);
                     });
    return order_;
  }

  static absl::Status Move(const float* src, int64_t count, float* dst) {
    std::memmove(dst, src, static_cast<size_t>(count) * sizeof(float));
    return absl::OkStatus();
  }

  // Arguments already validated; no size is 0 but k.
  static void GemmUnchecked(Transpose trans_a, Transpose trans_b, int64_t m,
                            int64_t n, int64_t k, float alpha, const float* a,
                            int64_t lda, const float* b, int64_t ldb,
                            float beta, float* c, int64_t ldc) {
    if (k == 0) {
      ScaleByBeta(m, n, beta, c, ldc);
      return;
    }
    cblas_sgemm(CblasRowMajor, ToCblas(trans_a), ToCblas(trans_b),
                static_cast<blasint>(m), static_cast<blasint>(n),
                static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
                static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
  }

  static void SyrkUnchecked(Transpose trans, int64_t n, int64_t k, float alpha,
                            const float* a, int64_t lda, float beta, float* c,
                            int64_t ldc) {
    if (k == 0) {
      ScaleByBeta(n, n, beta, c, ldc);
      return;
    }
    cblas_ssyrk(CblasRowMajor, CblasUpper, ToCblas(trans),
                static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
                static_cast<blasint>(lda), beta, c, static_cast<blasint>(ldc));
    MirrorUpperToLower(n, c, ldc);
  }

  // C = beta * C for a product with nothing to multiply (k == 0), with
  // BLAS's rule that beta == 0 overwrites C (so garbage/NaN in C does not
  // survive).
  static void ScaleByBeta(int64_t rows, int64_t cols, float beta, float* c,
                          int64_t ldc) {
    for (int64_t i = 0; i < rows; ++i) {
      float* row = c + i * ldc;
      for (int64_t j = 0; j < cols; ++j) {
        row[j] = beta == 0.0f ? 0.0f : beta * row[j];
      }
    }
  }

  static absl::Status LapackStatus(absl::string_view routine, lapack_int info) {
    if (info == 0) return absl::OkStatus();
    if (info < 0) {
      // LAPACKE reports a NaN in the input matrix as an invalid argument.
      return absl::InternalError(absl::StrCat(
          "cpu backend: ", routine, " failed (info=", info,
          ": invalid argument ", -info, ", e.g. NaN in the input)"));
    }
    return absl::InternalError(absl::StrCat(
        "cpu backend: ", routine, " failed to converge (info=", info, ")"));
  }

  // Grow-only scratch (see Scratch): Newton-Schulz X, next X, A = X X^T,
  // B = b A + c A A.
  std::vector<float> ns_x_;
  std::vector<float> ns_y_;
  std::vector<float> ns_a_;
  std::vector<float> ns_b_;
  cpu_internal::GramWorkspace gram_ws_;  // the Gram iteration's s x s buffers
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

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(MemorySpace space,
                                                          bool page_aligned) {
  return std::unique_ptr<Backend>(
      std::make_unique<CpuBackend>(space, page_aligned));
}

void SetDeviceLikeWorkBlocked(bool blocked) {
  device_like_work_blocked.store(blocked);
}

void SetCpuBlasThreads(int threads) {
  openblas_set_num_threads(threads < 1 ? 1 : threads);
}

}  // namespace canzona
