// Backend's own behaviour beside its validating entry points
// (backend_validation.cc): the kind names, the Newton-Schulz choice, the
// bounded host waits, and the default Do-methods a backend may override.
#include "kernels/backend.h"

#include <atomic>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/base/poll.h"
#include "kernels/base/status_macros.h"
#include "kernels/pageable_copies.h"

namespace canzona {

absl::string_view BackendKindName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kCpu:
      return "cpu";
    case BackendKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name) {
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(absl::StrCat(
      "backend: unknown value \"", name, "\" (expected cpu or cuda)"));
}

NsAlgorithm ResolvedNsAlgorithm(const NewtonSchulzSpec& spec, BackendKind kind,
                                int64_t rows, int64_t cols) {
  const auto steps = static_cast<int64_t>(spec.coefficients.size());
  if (kind == BackendKind::kCpu && spec.algorithm == NsAlgorithm::kAuto) {
    // BLAS runs small GEMMs near its large-GEMM rate: on cpu Gram's measured
    // speed-up follows its flop ratio down to 256 x 512
    // (tests/bench/RESULTS.md), so the cpu takes it wherever the flops say
    // it wins. ResolveNsAlgorithm's minimum side is the GPU's small-GEMM
    // penalty; the cost test is the same.
    if (steps <= 0) return NsAlgorithm::kStandard;
    return GramNsCost(rows, cols, steps) <=
                   kGramMaxCostRatio * StandardNsFlops(rows, cols, steps)
               ? NsAlgorithm::kGram
               : NsAlgorithm::kStandard;
  }
  // cuda bf16 runs Gram's s x s products in TF32 on float32 operands, about
  // half its bf16 rate; everything else runs them at the X products' rate.
  const double weight =
      kind == BackendKind::kCuda && spec.precision == NsPrecision::kBfloat16
          ? 2.0
          : 1.0;
  return ResolveNsAlgorithm(spec.algorithm, rows, cols, steps, weight);
}

// ---- Host waits ------------------------------------------------------------

absl::Status Backend::BeginHostWait(absl::string_view method) {
  ++host_waits_;
  return DoBeginHostWait(method);
}

void Backend::NotePageableCopy(absl::string_view what, const void* host,
                               int64_t bytes) {
  pageable_copies_.fetch_add(1, std::memory_order_relaxed);
  CountPageableCopy(what, host, bytes);
}

absl::Status Backend::GaveUpButSucceeded(absl::string_view method) {
  return absl::InternalError(
      absl::StrCat(method,
                   ": returned success after a wait for the backend's work "
                   "gave up; its results were never read"));
}

absl::Status Backend::AwaitWork(
    absl::string_view method,
    const std::function<absl::StatusOr<bool>()>& finished,
    const std::function<absl::Status()>& block,
    const std::function<void(absl::Duration)>& pause) {
  if (stalled_) {
    // Work that did not finish within a whole timeout before: waiting for
    // it again, without a bound (a teardown, a checkpoint) or for another
    // timeout, would only hold the caller, perhaps for good.
    CANZONA_ASSIGN_OR_RETURN(const bool done, finished());
    if (!done) {
      ++waits_given_up_;
      return absl::FailedPreconditionError(absl::StrCat(
          method,
          ": the backend's work has not finished since an earlier "
          "wait gave up at its timeout; it may wait for good for a "
          "trainer's event that is never recorded"));
    }
    stalled_ = false;
    return absl::OkStatus();
  }
  if (wait_timeout_ == absl::InfiniteDuration()) return block();
  const absl::Time deadline = absl::Now() + wait_timeout_;
  CANZONA_RETURN_IF_ERROR(PollUntilDone(
      [&]() -> absl::StatusOr<bool> {
        CANZONA_ASSIGN_OR_RETURN(const bool done, finished());
        if (done) return true;
        if (absl::Now() < deadline) return false;
        stalled_ = true;
        ++waits_given_up_;
        return absl::DeadlineExceededError(absl::StrCat(
            method,
            ": the backend's work did not finish within the wait "
            "timeout (",
            absl::FormatDuration(wait_timeout_),
            "; a step's is --step-timeout); its stream may be waiting for a "
            "trainer's event that a dead or hung trainer never records"));
      },
      pause));
  stalled_ = false;
  return absl::OkStatus();
}

// ---- Default Do-methods: one call per item, host-side timing -------------

absl::Status Backend::DoAdamWStepMany(absl::Span<const AdamWTensor> tensors,
                                      float lr, float beta1, float beta2,
                                      float eps, float weight_decay,
                                      int64_t step, SquaredChange change) {
  for (const AdamWTensor& t : tensors) {
    CANZONA_RETURN_IF_ERROR(DoAdamWStep(t.n, lr, beta1, beta2, eps,
                                        weight_decay, step, t.g, t.p, t.m, t.v,
                                        change));
  }
  return absl::OkStatus();
}

absl::Status Backend::DoEnqueueSumSquares(int64_t n, const float* x) {
  CANZONA_ASSIGN_OR_RETURN(double s, DoSumSquares(n, x));
  queued_sum_squares_ += s;
  return absl::OkStatus();
}

absl::StatusOr<double> Backend::DoTakeSumSquares() {
  const double total = queued_sum_squares_;
  queued_sum_squares_ = 0;
  return total;
}

absl::Status Backend::DoSumSquaresMany(absl::Span<const float* const> xs,
                                       absl::Span<const int64_t> ns,
                                       absl::Span<double> out) {
  for (size_t k = 0; k < xs.size(); ++k) {
    if (ns[k] == 0) {
      out[k] = 0;
      continue;
    }
    CANZONA_ASSIGN_OR_RETURN(out[k], DoSumSquares(ns[k], xs[k]));
  }
  return absl::OkStatus();
}

absl::Status Backend::DoMark(int mark) {
  marked_ns_[mark] = absl::ToUnixNanos(absl::Now());
  return absl::OkStatus();
}

absl::StatusOr<double> Backend::DoSecondsBetween(int from, int to) {
  if (marked_ns_[from] == 0 || marked_ns_[to] == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("SecondsBetween: mark ", marked_ns_[from] == 0 ? from : to,
                     " was never set"));
  }
  return 1e-9 * static_cast<double>(marked_ns_[to] - marked_ns_[from]);
}

}  // namespace canzona
