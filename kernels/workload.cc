#include "kernels/workload.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"

namespace canzona {
namespace {

// N(0, scale^2) values from a fixed seed. The last few draws are kept
// (per thread): a benchmark times several workloads of one shape (the
// standard, Gram and full-products Newton-Schulz of seed 1, the GEMM of
// seeds 2 and 3), and drawing the 131 M values of a 25600 x 5120 matrix
// again for each took seconds of a GPU visit's few minutes.
const std::vector<float>& RandomValues(int64_t count, uint32_t seed,
                                       float scale) {
  struct Draw {
    int64_t count;
    uint32_t seed;
    float scale;
    std::vector<float> values;
  };
  constexpr size_t kKept = 3;
  thread_local std::deque<Draw> kept;
  for (const Draw& d : kept) {
    if (d.count == count && d.seed == seed && d.scale == scale) {
      return d.values;
    }
  }
  if (kept.size() == kKept) kept.pop_front();
  Draw& d = kept.emplace_back(Draw{count, seed, scale, {}});
  d.values.resize(static_cast<size_t>(count));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  for (float& x : d.values) x = normal(rng);
  return d.values;
}

// Fills a backend buffer with RandomValues, so that timings never run on
// zeros (denormal-free, data-independent kernels aside).
absl::StatusOr<DeviceBuffer> RandomBuffer(Backend& backend, int64_t count,
                                          uint32_t seed, float scale = 1.0f) {
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer buffer, backend.Allocate(count));
  const std::vector<float>& host = RandomValues(count, seed, scale);
  CANZONA_RETURN_IF_ERROR(
      backend.CopyFromHost(host.data(), count, buffer.data()));
  return buffer;
}

}  // namespace

double NewtonSchulzFlops(int64_t rows, int64_t cols, int64_t steps) {
  const double s = static_cast<double>(std::min(rows, cols));
  const double l = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(steps) * (4.0 * s * s * l + 2.0 * s * s * s);
}

absl::StatusOr<std::unique_ptr<KernelWorkload>> KernelWorkload::NewtonSchulz(
    Backend* backend, const NewtonSchulzSpec& spec, int64_t batch, int64_t rows,
    int64_t cols) {
  const char* precision =
      spec.precision == NsPrecision::kBfloat16 ? "bf16" : "fp32";
  std::unique_ptr<KernelWorkload> w(new KernelWorkload(
      backend,
      absl::StrCat("newton_schulz/", precision, "/", batch, "x", rows, "x",
                   cols),
      static_cast<double>(batch) *
          NewtonSchulzFlops(rows, cols,
                            static_cast<int64_t>(spec.coefficients.size())),
      0.0));
  const int64_t count = batch * rows * cols;
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer input,
                           RandomBuffer(*backend, count, 1));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer output, backend->Allocate(count));
  const float* in = input.data();
  float* out = output.data();
  w->buffers_.push_back(std::move(input));
  w->buffers_.push_back(std::move(output));
  w->run_ = [backend, spec, batch, rows, cols, in, out] {
    return backend->NewtonSchulz(spec, batch, rows, cols, in, out);
  };
  return w;
}

absl::StatusOr<std::unique_ptr<KernelWorkload>> KernelWorkload::Gemm(
    Backend* backend, int64_t m, int64_t n, int64_t k) {
  std::unique_ptr<KernelWorkload> w(
      new KernelWorkload(backend, absl::StrCat("gemm/fp32/", m, "x", n, "x", k),
                         2.0 * static_cast<double>(m) * n * k, 0.0));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer a, RandomBuffer(*backend, m * k, 2));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer b, RandomBuffer(*backend, k * n, 3));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer c, backend->Allocate(m * n));
  const float* pa = a.data();
  const float* pb = b.data();
  float* pc = c.data();
  w->buffers_.push_back(std::move(a));
  w->buffers_.push_back(std::move(b));
  w->buffers_.push_back(std::move(c));
  w->run_ = [backend, m, n, k, pa, pb, pc] {
    return backend->Gemm(Transpose::kNo, Transpose::kNo, m, n, k, 1.0f, pa, k,
                         pb, n, 0.0f, pc, n);
  };
  return w;
}

absl::StatusOr<std::unique_ptr<KernelWorkload>> KernelWorkload::SymmetricEigen(
    Backend* backend, int64_t n) {
  const double nd = static_cast<double>(n);
  std::unique_ptr<KernelWorkload> w(new KernelWorkload(
      backend, absl::StrCat("eigh/fp32/", n), 9.0 * nd * nd * nd, 0.0));
  // A G G^T + I: symmetric positive definite, well separated spectrum.
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer g, RandomBuffer(*backend, n * n, 4));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer spd, backend->Allocate(n * n));
  CANZONA_RETURN_IF_ERROR(backend->Syrk(Transpose::kNo, n, n, 1.0f / nd,
                                        g.data(), n, 0.0f, spd.data(), n));
  CANZONA_RETURN_IF_ERROR(backend->AddIdentity(n, 1.0f, spd.data()));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer work, backend->Allocate(n * n));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer eigenvalues, backend->Allocate(n));
  const float* source = spd.data();
  float* a = work.data();
  float* lam = eigenvalues.data();
  w->buffers_.push_back(std::move(g));
  w->buffers_.push_back(std::move(spd));
  w->buffers_.push_back(std::move(work));
  w->buffers_.push_back(std::move(eigenvalues));
  w->run_ = [backend, n, source, a, lam]() -> absl::Status {
    // The solver overwrites its input: restore it each time (an n^2 copy,
    // negligible next to the n^3 solve).
    CANZONA_RETURN_IF_ERROR(backend->Copy(source, n * n, a));
    return backend->SymmetricEigen(n, a, lam, EigenPrecision::kFloat32);
  };
  return w;
}

absl::StatusOr<std::unique_ptr<KernelWorkload>> KernelWorkload::AdamW(
    Backend* backend, int64_t n) {
  std::unique_ptr<KernelWorkload> w(
      new KernelWorkload(backend, absl::StrCat("adamw/fp32/", n),
                         10.0 * static_cast<double>(n), 28.0 * n));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer g, RandomBuffer(*backend, n, 5));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer p, RandomBuffer(*backend, n, 6));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer m, backend->Allocate(n));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer v, backend->Allocate(n));
  const float* pg = g.data();
  float* pp = p.data();
  float* pm = m.data();
  float* pv = v.data();
  w->buffers_.push_back(std::move(g));
  w->buffers_.push_back(std::move(p));
  w->buffers_.push_back(std::move(m));
  w->buffers_.push_back(std::move(v));
  auto step = std::make_shared<int64_t>(0);
  w->run_ = [backend, n, pg, pp, pm, pv, step] {
    return backend->AdamWStep(n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, ++*step, pg,
                              pp, pm, pv);
  };
  return w;
}

absl::StatusOr<WorkloadTiming> TimeWorkload(KernelWorkload& workload,
                                            double min_seconds,
                                            int64_t min_iterations) {
  using Clock = std::chrono::steady_clock;
  Backend& backend = workload.backend();
  CANZONA_RETURN_IF_ERROR(workload.Run());
  CANZONA_RETURN_IF_ERROR(backend.Synchronize());
  std::vector<double> samples;
  const Clock::time_point start = Clock::now();
  while (static_cast<int64_t>(samples.size()) < min_iterations ||
         std::chrono::duration<double>(Clock::now() - start).count() <
             min_seconds) {
    const Clock::time_point t0 = Clock::now();
    CANZONA_RETURN_IF_ERROR(workload.Run());
    CANZONA_RETURN_IF_ERROR(backend.Synchronize());
    samples.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(samples.begin(), samples.end());
  WorkloadTiming timing;
  timing.iterations = static_cast<int64_t>(samples.size());
  timing.min_seconds = samples.front();
  timing.median_seconds = samples[samples.size() / 2];
  return timing;
}

}  // namespace canzona
