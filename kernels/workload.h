// Ready-to-run kernel invocations with their inputs allocated and filled,
// for timing. One definition of "what we measure" serves both the Google
// Benchmark binary (tests/bench) and `canzonactl bench kernels`, so their
// figures are comparable. Example:
//
//   CANZONA_ASSIGN_OR_RETURN(auto ns, KernelWorkload::NewtonSchulz(
//                                         backend, spec, 1, 5120, 25600));
//   CANZONA_ASSIGN_OR_RETURN(WorkloadTiming t, TimeWorkload(*ns, 2.0));
//   printf("%.1f GFLOP/s\n", ns->flops() / t.median_seconds / 1e9);
//
// Thread-safety: as the Backend it runs on (one owner thread).
#ifndef CANZONA_KERNELS_WORKLOAD_H_
#define CANZONA_KERNELS_WORKLOAD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace canzona {

// GEMM-equivalent flops of one Newton-Schulz iteration count on a rows x cols
// matrix (s = min, l = max): per step X X^T (2 s^2 l), A A (2 s^3) and B X
// (2 s^2 l). SYRK computes X X^T in half the flops, but rates are reported
// against the GEMM-equivalent count, as peers report them.
double NewtonSchulzFlops(int64_t rows, int64_t cols, int64_t steps);

class KernelWorkload {
 public:
  // `batch` same-shape matrices orthogonalized by one NewtonSchulz call.
  static absl::StatusOr<std::unique_ptr<KernelWorkload>> NewtonSchulz(
      Backend* backend, const NewtonSchulzSpec& spec, int64_t batch,
      int64_t rows, int64_t cols);
  // C[m x n] = A[m x k] B[k x n].
  static absl::StatusOr<std::unique_ptr<KernelWorkload>> Gemm(Backend* backend,
                                                              int64_t m,
                                                              int64_t n,
                                                              int64_t k);
  // Eigendecomposition of an n x n symmetric positive definite matrix
  // (flops counted as 9 n^3, the cost model's figure).
  static absl::StatusOr<std::unique_ptr<KernelWorkload>> SymmetricEigen(
      Backend* backend, int64_t n);
  // One AdamW step on n elements (bytes counted: read g, p, m, v; write p,
  // m, v: 28 n).
  static absl::StatusOr<std::unique_ptr<KernelWorkload>> AdamW(Backend* backend,
                                                               int64_t n);

  // Issues one invocation (asynchronous on cuda; TimeWorkload synchronizes).
  absl::Status Run() { return run_(); }
  const std::string& name() const { return name_; }
  double flops() const { return flops_; }
  double bytes() const { return bytes_; }
  Backend& backend() const { return *backend_; }

 private:
  KernelWorkload(Backend* backend, std::string name, double flops, double bytes)
      : backend_(backend),
        name_(std::move(name)),
        flops_(flops),
        bytes_(bytes) {}

  Backend* backend_;
  std::string name_;
  double flops_;
  double bytes_;
  std::vector<DeviceBuffer> buffers_;
  std::function<absl::Status()> run_;
};

struct WorkloadTiming {
  double median_seconds = 0;
  double min_seconds = 0;
  int64_t iterations = 0;
};

// One warm-up run, then timed runs (each synchronized) until `min_seconds`
// have passed and at least `min_iterations` ran.
absl::StatusOr<WorkloadTiming> TimeWorkload(KernelWorkload& workload,
                                            double min_seconds,
                                            int64_t min_iterations = 3);

}  // namespace canzona

#endif  // CANZONA_KERNELS_WORKLOAD_H_
