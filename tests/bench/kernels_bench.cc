// Newton-Schulz throughput on Qwen3 matrix shapes next to the same backend's
// plain GEMM rate, on cpu and (when present) cuda. The NS/GEMM ratio is what
// to read: it is the fraction of the machine's GEMM rate NS achieves.
//
//   canzona_kernels_bench [--model=qwen3-0.6b] [--shapes=RxC,...]
//                         [--max-shapes=N] [benchmark flags]
//
// Same workloads as `canzonactl bench kernels` (kernels/workload.h).
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "benchmark/benchmark.h"
#include "client/ctl/model_shapes.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/workload.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"

namespace canzona {
namespace {

// Backends live for the whole run: workloads point into their memory.
std::vector<std::unique_ptr<Backend>>& Backends() {
  static auto* backends = new std::vector<std::unique_ptr<Backend>>();
  return *backends;
}

void RunWorkload(benchmark::State& state, KernelWorkload* workload) {
  for (auto _ : state) {
    absl::Status status = workload->Run();
    if (status.ok()) status = workload->backend().Synchronize();
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      return;
    }
  }
  state.counters["Gflop"] = benchmark::Counter(
      workload->flops() / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void Register(Backend* backend, NsPrecision precision, int64_t rows,
              int64_t cols) {
  auto muon = MakeOptimizerConfig(OptimizerKind::kMuon, {});
  auto spec = NewtonSchulzSpecFor(muon->muon, backend->kind());
  if (!spec.ok()) return;
  spec->precision = precision;
  // The standard iteration under its usual name (figures stay comparable);
  // the Gram iteration beside it, prefixed gram/.
  spec->algorithm = NsAlgorithm::kStandard;
  const std::string device(BackendKindName(backend->kind()));
  NewtonSchulzSpec gram_spec = *spec;
  gram_spec.algorithm = NsAlgorithm::kGram;
  auto gram = KernelWorkload::NewtonSchulz(backend, gram_spec, 1, rows, cols);
  if (gram.ok()) {
    KernelWorkload* gram_ptr = gram->release();
    benchmark::RegisterBenchmark(
        absl::StrCat(device, "/gram/", gram_ptr->name()).c_str(),
        [gram_ptr](benchmark::State& st) { RunWorkload(st, gram_ptr); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  auto ns = KernelWorkload::NewtonSchulz(backend, *spec, 1, rows, cols);
  const int64_t s = std::min(rows, cols), l = std::max(rows, cols);
  auto gemm = KernelWorkload::Gemm(backend, s, l, s);
  if (!ns.ok() || !gemm.ok()) return;
  KernelWorkload* ns_ptr = ns->release();
  KernelWorkload* gemm_ptr = gemm->release();
  benchmark::RegisterBenchmark(
      absl::StrCat(device, "/", ns_ptr->name()).c_str(),
      [ns_ptr](benchmark::State& st) { RunWorkload(st, ns_ptr); })
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark(
      absl::StrCat(device, "/", gemm_ptr->name()).c_str(),
      [gemm_ptr](benchmark::State& st) { RunWorkload(st, gemm_ptr); })
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
}

}  // namespace
}  // namespace canzona

int main(int argc, char** argv) {
  using namespace canzona;
  std::string model = "qwen3-0.6b";
  std::string shapes_flag;
  int max_shapes = 0;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--model=", 8) == 0) {
      model = argv[i] + 8;
    } else if (std::strncmp(argv[i], "--shapes=", 9) == 0) {
      shapes_flag = argv[i] + 9;
    } else if (std::strncmp(argv[i], "--max-shapes=", 13) == 0) {
      max_shapes = std::atoi(argv[i] + 13);
    } else {
      rest.push_back(argv[i]);
    }
  }
  std::vector<MatrixShape> shapes;
  if (!shapes_flag.empty()) {
    for (absl::string_view item : absl::StrSplit(shapes_flag, ',')) {
      std::vector<absl::string_view> rc = absl::StrSplit(item, 'x');
      MatrixShape shape;
      if (rc.size() != 2 || !absl::SimpleAtoi(rc[0], &shape.rows) ||
          !absl::SimpleAtoi(rc[1], &shape.cols) || shape.rows < 1 ||
          shape.cols < 1) {
        std::fprintf(stderr, "--shapes: bad shape \"%s\" (expected RxC)\n",
                     std::string(item).c_str());
        return 2;
      }
      shapes.push_back(shape);
    }
  } else {
    auto loaded = DistinctMatrixShapes(model, "");
    if (!loaded.ok()) {
      std::fprintf(stderr, "--model: %s\n",
                   std::string(loaded.status().message()).c_str());
      return 2;
    }
    shapes = *std::move(loaded);
  }
  if (max_shapes > 0 && static_cast<int>(shapes.size()) > max_shapes) {
    shapes.resize(static_cast<size_t>(max_shapes));
  }
  if (auto cpu = CreateBackend(BackendKind::kCpu); cpu.ok()) {
    Backends().push_back(*std::move(cpu));
  }
  if (auto cuda = CreateBackend(BackendKind::kCuda); cuda.ok()) {
    Backends().push_back(*std::move(cuda));
  }
  for (auto& backend : Backends()) {
    for (const MatrixShape& shape : shapes) {
      Register(backend.get(), NsPrecision::kFloat32, shape.rows, shape.cols);
      if (backend->kind() == BackendKind::kCuda) {
        Register(backend.get(), NsPrecision::kBfloat16, shape.rows, shape.cols);
      }
    }
  }
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
