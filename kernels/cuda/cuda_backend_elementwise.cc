// The cuda backend's fused elementwise kernels and reductions (the
// queued sums, the norm pass, the finiteness check).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/base/cuda_status.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cuda_kernels.h"

namespace canzona {
namespace cuda_internal {

// ---- Fused elementwise kernels --------------------------------------------

absl::Status CudaBackend::DoLerp(int64_t n, const float* a, const float* b,
                                 float weight, float* out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::Lerp(Cfg(), n, a, b, weight, out));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoNesterovMomentum(int64_t n, float beta,
                                             const float* grad, float* momentum,
                                             float* out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::NesterovMomentum(Cfg(), n, beta, grad, momentum, out));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoAxpby(int64_t n, float alpha, const float* x,
                                  float beta, float* y, SquaredChange change) {
  if (change == SquaredChange::kQueue) {
    return Enqueue([&](double* partials, double* result) {
      const cuda_kernels::ChangeSum sum{partials, result};
      return cuda_kernels::Axpby(Cfg(), n, alpha, x, beta, y, &sum);
    });
  }
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::Axpby(Cfg(), n, alpha, x, beta, y));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoScale(int64_t n, float alpha, float* x) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::Scale(Cfg(), n, alpha, x));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoEmaSquare(int64_t n, float decay, float weight,
                                      const float* g, float* v) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::EmaSquare(Cfg(), n, decay, weight, g, v));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoAdamDirection(int64_t n, const float* m,
                                          float m_scale, const float* v,
                                          float v_scale, float eps,
                                          float* out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::AdamDirection(Cfg(), n, m, m_scale, v, v_scale, eps, out));
  return absl::OkStatus();
}

namespace {

// torch computes these scalars in Python (double) and hands them to the
// kernels as float32: so do AdamWStep and AdamWStepMany.
cuda_kernels::AdamWScalars AdamWScalarsOf(float lr, float beta1, float beta2,
                                          float eps, float weight_decay,
                                          int64_t step) {
  const double bc1 =
      1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 =
      1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  cuda_kernels::AdamWScalars s;
  s.decay = static_cast<float>(1.0 - static_cast<double>(lr) *
                                         static_cast<double>(weight_decay));
  s.lerp_weight = static_cast<float>(1.0 - static_cast<double>(beta1));
  s.beta2 = beta2;
  s.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(beta2));
  s.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = eps;
  return s;
}

}  // namespace

absl::Status CudaBackend::DoAdamWStep(int64_t n, float lr, float beta1,
                                      float beta2, float eps,
                                      float weight_decay, int64_t step,
                                      const float* g, float* p, float* m,
                                      float* v, SquaredChange change) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const cuda_kernels::AdamWScalars s =
      AdamWScalarsOf(lr, beta1, beta2, eps, weight_decay, step);
  if (change == SquaredChange::kQueue) {
    return Enqueue([&](double* partials, double* result) {
      const cuda_kernels::ChangeSum sum{partials, result};
      return cuda_kernels::AdamWStep(Cfg(), n, s, g, p, m, v, &sum);
    });
  }
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::AdamWStep(Cfg(), n, s, g, p, m, v));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoAdamWStepMany(absl::Span<const AdamWTensor> tensors,
                                          float lr, float beta1, float beta2,
                                          float eps, float weight_decay,
                                          int64_t step, SquaredChange change) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const bool counted = change == SquaredChange::kQueue;
  cuda_kernels::AdamWMany many{};
  many.s = AdamWScalarsOf(lr, beta1, beta2, eps, weight_decay, step);
  for (size_t first = 0; first < tensors.size();
       first += cuda_kernels::kAdamWManyMax) {
    const int count = static_cast<int>(
        std::min<size_t>(cuda_kernels::kAdamWManyMax, tensors.size() - first));
    // Each change sum takes a queue slot, as AdamWStep's does.
    if (counted && queued_ + count > kQueuedSums) {
      CANZONA_RETURN_IF_ERROR(DrainQueuedSums());
    }
    many.count = count;
    int64_t total_blocks = 0;
    for (int k = 0; k < count; ++k) {
      const AdamWTensor& t = tensors[first + k];
      const int blocks =
          cuda_kernels::AdamWBlocks(Cfg(), t.n, t.g, t.p, t.m, t.v, counted);
      many.segments[k] = {
          t.g, t.p, t.m, t.v, t.n, static_cast<int32_t>(total_blocks), blocks};
      total_blocks += blocks;
    }
    if (total_blocks > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AdamWStepMany: ", total_blocks, " blocks exceed one launch"));
    }
    double* partials = nullptr;
    double* results = nullptr;
    if (counted) {
      partials = static_cast<double*>(many_ws_.data);
      results = static_cast<double*>(queued_ws_.data) +
                cuda_kernels::kMaxReductionBlocks + queued_;
    }
    CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::AdamWStepMany(
        Cfg(), many, static_cast<int>(total_blocks), partials, results));
    if (counted) queued_ += count;
  }
  return absl::OkStatus();
}

absl::StatusOr<double> CudaBackend::DoSumSquares(int64_t n, const float* x) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_ASSIGN_OR_RETURN(
      void* ws, Reserve(scratch_ws_, (cuda_kernels::kMaxReductionBlocks + 1) *
                                         sizeof(double)));
  auto* partials = static_cast<double*>(ws);
  double* result = partials + cuda_kernels::kMaxReductionBlocks;
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::SumSquares(Cfg(), n, x, partials, result));
  CANZONA_RETURN_IF_ERROR(
      FetchToPinned(result, sizeof(double), &pinned_->sum, "SumSquares"));
  return pinned_->sum;
}

absl::Status CudaBackend::DoScaleToNorm(int64_t n, const float* reference,
                                        Norm norm, double eps, float* x) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_ASSIGN_OR_RETURN(
      void* ws, Reserve(scratch_ws_, (cuda_kernels::kMaxReductionBlocks + 2) *
                                         sizeof(double)));
  auto* partials = static_cast<double*>(ws);
  double* sums = partials + cuda_kernels::kMaxReductionBlocks;
  const double divisor = norm == Norm::kRms ? static_cast<double>(n) : 1.0;
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::ScaleToNorm(
      Cfg(), n, reference, divisor, eps, x, partials, sums));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoLiftedPower(int64_t n, const float* x, double floor,
                                        double exponent, float* out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::LiftedPower(Cfg(), n, x, floor, exponent, out));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSumSquaresMany(absl::Span<const float* const> xs,
                                           absl::Span<const int64_t> ns,
                                           absl::Span<double> out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const size_t k = xs.size();  // > 0 (Backend::SumSquaresMany)
  // Every vector's blocks in one launch and their sums in a second (a
  // step's norm pass has one vector per gradient: hundreds of launches
  // before), each sum bitwise what SumSquares gives.
  if (k > pinned_segment_capacity_) {
    const size_t capacity = std::max<size_t>(k, 1024);
    void* table = nullptr;
    // [segments | results]: the results come back into page-locked memory,
    // so that their copy never waits inside cudaMemcpyAsync (into the
    // caller's pageable memory it would, unbounded) and the one bounded
    // wait below is the only one.
    const cudaError_t allocated = cudaHostAlloc(
        &table,
        capacity * (sizeof(cuda_kernels::SumSquaresSegment) + sizeof(double)),
        cudaHostAllocDefault);
    if (allocated != cudaSuccess) {
      (void)cudaGetLastError();  // not the next launch's error
      CANZONA_CUDA_RETURN_IF_ERROR(allocated);
    }
    // The smaller table stays until teardown: cudaFreeHost would
    // synchronize the device in a step.
    if (pinned_segments_ != nullptr) {
      retired_segments_.push_back(pinned_segments_);
    }
    pinned_segments_ = static_cast<cuda_kernels::SumSquaresSegment*>(table);
    pinned_results_ = reinterpret_cast<double*>(pinned_segments_ + capacity);
    pinned_segment_capacity_ = capacity;
  }
  int64_t total_blocks = 0;
  for (size_t i = 0; i < k; ++i) {
    const int blocks = cuda_kernels::SumSquaresBlocks(Cfg(), ns[i], xs[i]);
    pinned_segments_[i] = {xs[i], ns[i], static_cast<int32_t>(total_blocks),
                           blocks};
    total_blocks += blocks;
  }
  if (total_blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("SumSquaresMany: ", total_blocks, " reduction blocks for ",
                     k, " vectors exceed one launch"));
  }
  // [partials | results | segments], all 8-byte aligned.
  const size_t segments_at = (static_cast<size_t>(total_blocks) + k) * 8;
  CANZONA_ASSIGN_OR_RETURN(
      void* ws,
      Reserve(scratch_ws_,
              segments_at + k * sizeof(cuda_kernels::SumSquaresSegment)));
  auto* partials = static_cast<double*>(ws);
  double* results = partials + total_blocks;
  auto* segments = reinterpret_cast<cuda_kernels::SumSquaresSegment*>(
      static_cast<char*>(ws) + segments_at);
  // One copy and one wait for all of them, and for the queued sums
  // (Backend: a later TakeSumSquares does not wait).
  const int fetched = queued_;
  absl::Status status = [&]() -> absl::Status {
    CANZONA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        segments, pinned_segments_, k * sizeof(cuda_kernels::SumSquaresSegment),
        cudaMemcpyHostToDevice, stream_));
    CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::SumSquaresMany(
        Cfg(), static_cast<int>(k), segments, static_cast<int>(total_blocks),
        partials, results));
    CANZONA_RETURN_IF_ERROR(FetchQueuedSums());
    CANZONA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(pinned_results_, results, k * sizeof(double),
                        cudaMemcpyDeviceToHost, stream_));
    CANZONA_RETURN_IF_ERROR(AwaitStream("SumSquaresMany"));
    std::copy(pinned_results_, pinned_results_ + k, out.begin());
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    // Nothing may still copy from the table or into the pinned results
    // when the next call writes them, and the queued sums, still on the
    // device, stay queued.
    if (stalled()) {
      // The stream may run this call's copies whenever it resumes: the
      // block is left to them (freed at teardown) and the next call
      // takes a new one.
      retired_segments_.push_back(pinned_segments_);
      pinned_segments_ = nullptr;
      pinned_results_ = nullptr;
      pinned_segment_capacity_ = 0;
    } else {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaGetLastError();
    }
    queued_ = fetched;
    return status;
  }
  AddQueuedSums(fetched);
  return absl::OkStatus();
}

absl::Status CudaBackend::DoEnqueueSumSquares(int64_t n, const float* x) {
  return Enqueue([&](double* partials, double* result) {
    return cuda_kernels::SumSquares(Cfg(), n, x, partials, result);
  });
}

absl::Status CudaBackend::DoEnqueueSquaredDistance(int64_t n, const float* a,
                                                   const float* b) {
  return Enqueue([&](double* partials, double* result) {
    return cuda_kernels::SquaredDistance(Cfg(), n, a, b, partials, result);
  });
}

absl::Status CudaBackend::Enqueue(
    const std::function<cudaError_t(double*, double*)>& reduce) {
  CANZONA_RETURN_IF_ERROR(Activate());
  if (queued_ == kQueuedSums) CANZONA_RETURN_IF_ERROR(DrainQueuedSums());
  CANZONA_ASSIGN_OR_RETURN(
      void* ws,
      Reserve(queued_ws_, (cuda_kernels::kMaxReductionBlocks + kQueuedSums) *
                              sizeof(double)));
  auto* partials = static_cast<double*>(ws);
  double* results = partials + cuda_kernels::kMaxReductionBlocks;
  CANZONA_CUDA_RETURN_IF_ERROR(reduce(partials, results + queued_));
  ++queued_;
  return absl::OkStatus();
}

absl::Status CudaBackend::FetchQueuedSums() {
  if (queued_ == 0) return absl::OkStatus();
  const double* results = static_cast<const double*>(queued_ws_.data) +
                          cuda_kernels::kMaxReductionBlocks;
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(pinned_->queued, results, queued_ * sizeof(double),
                      cudaMemcpyDeviceToHost, stream_));
  // The queue's slots are free for new sums, which the stream orders after
  // this copy.
  queued_ = 0;
  return absl::OkStatus();
}

void CudaBackend::AddQueuedSums(int fetched) {
  for (int i = 0; i < fetched; ++i) queued_total_ += pinned_->queued[i];
}

absl::Status CudaBackend::DrainQueuedSums() {
  const int fetched = queued_;
  if (fetched == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(FetchQueuedSums());
  CANZONA_RETURN_IF_ERROR(AwaitStream("TakeSumSquares"));
  AddQueuedSums(fetched);
  return absl::OkStatus();
}

absl::StatusOr<double> CudaBackend::DoTakeSumSquares() {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_RETURN_IF_ERROR(DrainQueuedSums());
  const double total = queued_total_;
  queued_total_ = 0;
  return total;
}

absl::StatusOr<bool> CudaBackend::DoAllFinite(int64_t n, const float* x) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_ASSIGN_OR_RETURN(void* ws, Reserve(scratch_ws_, sizeof(int)));
  int* flag = static_cast<int*>(ws);
  CANZONA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag, 0, sizeof(int), stream_));
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::FlagNonFinite(Cfg(), n, x, flag));
  CANZONA_RETURN_IF_ERROR(
      FetchToPinned(flag, sizeof(int), &pinned_->flag, "AllFinite"));
  return pinned_->flag == 0;
}

}  // namespace cuda_internal
}  // namespace canzona
