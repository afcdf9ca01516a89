#include "client/ctl/kernel_rates.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "client/ctl/model_shapes.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "kernels/workload.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"

namespace canzona::ctl {
namespace {

absl::StatusOr<NsPrecision> ResolvePrecision(const std::string& name,
                                             const Backend& backend) {
  if (name == "fp32") return NsPrecision::kFloat32;
  if (name == "bf16") return NsPrecision::kBfloat16;
  if (name == "auto") {
    return backend.kind() == BackendKind::kCuda ? NsPrecision::kBfloat16
                                                : NsPrecision::kFloat32;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--precision: unknown value \"", name, "\" (expected auto, fp32, bf16)"));
}

}  // namespace

absl::StatusOr<KernelRates> MeasureKernelRates(
    const KernelBenchOptions& options) {
  CANZONA_ASSIGN_OR_RETURN(
      std::vector<MatrixShape> shapes,
      DistinctMatrixShapes(options.model, options.models_dir));
  if (options.max_shapes > 0 &&
      static_cast<int>(shapes.size()) > options.max_shapes) {
    shapes.resize(static_cast<size_t>(options.max_shapes));
  }
  CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                           CreateBackendByName(options.backend));
  CANZONA_ASSIGN_OR_RETURN(NsPrecision precision,
                           ResolvePrecision(options.precision, *backend));
  // The spec Muon's default (simple coefficients) resolves to.
  CANZONA_ASSIGN_OR_RETURN(OptimizerConfig muon,
                           MakeOptimizerConfig(OptimizerKind::kMuon, {}));
  muon.muon.ns_steps = options.ns_steps;
  CANZONA_ASSIGN_OR_RETURN(NewtonSchulzSpec spec,
                           NewtonSchulzSpecFor(muon.muon, backend->kind()));
  spec.precision = precision;
  // The rates are the standard iteration's (whatever auto would pick).
  spec.algorithm = NsAlgorithm::kStandard;
  NewtonSchulzSpec gram_spec = spec;
  gram_spec.algorithm = NsAlgorithm::kGram;
  NewtonSchulzSpec auto_spec = spec;
  auto_spec.algorithm = NsAlgorithm::kAuto;
  NewtonSchulzSpec full_spec = spec;
  full_spec.symmetric_products = false;

  KernelRates out;
  out.bf16 = precision == NsPrecision::kBfloat16;
  auto seconds = [&](const WorkloadTiming& t) {
    return options.fastest ? t.min_seconds : t.median_seconds;
  };
  for (const MatrixShape& shape : shapes) {
    CANZONA_ASSIGN_OR_RETURN(
        auto ns, KernelWorkload::NewtonSchulz(backend.get(), spec, 1,
                                              shape.rows, shape.cols));
    CANZONA_ASSIGN_OR_RETURN(WorkloadTiming ns_time,
                             TimeWorkload(*ns, options.min_time));
    // The GEMM NS spends most of its time in: (s x s) times (s x l).
    const int64_t s = std::min(shape.rows, shape.cols);
    const int64_t l = std::max(shape.rows, shape.cols);
    CANZONA_ASSIGN_OR_RETURN(auto gemm,
                             KernelWorkload::Gemm(backend.get(), s, l, s));
    CANZONA_ASSIGN_OR_RETURN(WorkloadTiming gemm_time,
                             TimeWorkload(*gemm, options.min_time));
    ShapeRate rate;
    rate.rows = shape.rows;
    rate.cols = shape.cols;
    rate.ns_seconds = seconds(ns_time);
    rate.ns_gflops = ns->flops() / seconds(ns_time) / 1e9;
    rate.gemm_gflops = gemm->flops() / seconds(gemm_time) / 1e9;
    if (options.compare_algorithms) {
      // One matrix of this shape under another spec, timed alike.
      auto time_spec =
          [&](const NewtonSchulzSpec& other) -> absl::StatusOr<double> {
        CANZONA_ASSIGN_OR_RETURN(
            auto ns, KernelWorkload::NewtonSchulz(backend.get(), other, 1,
                                                  shape.rows, shape.cols));
        CANZONA_ASSIGN_OR_RETURN(WorkloadTiming time,
                                 TimeWorkload(*ns, options.min_time));
        return seconds(time);
      };
      CANZONA_ASSIGN_OR_RETURN(rate.gram_seconds, time_spec(gram_spec));
      CANZONA_ASSIGN_OR_RETURN(rate.full_products_seconds,
                               time_spec(full_spec));
      rate.auto_algorithm = NsAlgorithmName(ResolvedNsAlgorithm(
          auto_spec, backend->kind(), shape.rows, shape.cols));
    }
    if (options.batch > 0) {
      // One batched call against `batch` calls of one matrix each (the
      // single workload times one matrix).
      for (const NewtonSchulzSpec* s : {&spec, &gram_spec}) {
        CANZONA_ASSIGN_OR_RETURN(
            auto single, KernelWorkload::NewtonSchulz(backend.get(), *s, 1,
                                                      shape.rows, shape.cols));
        CANZONA_ASSIGN_OR_RETURN(WorkloadTiming single_time,
                                 TimeWorkload(*single, options.min_time));
        CANZONA_ASSIGN_OR_RETURN(
            auto batched,
            KernelWorkload::NewtonSchulz(backend.get(), *s, options.batch,
                                         shape.rows, shape.cols));
        CANZONA_ASSIGN_OR_RETURN(WorkloadTiming batched_time,
                                 TimeWorkload(*batched, options.min_time));
        const bool is_gram = s->algorithm == NsAlgorithm::kGram;
        (is_gram ? rate.gram_single_seconds : rate.standard_single_seconds) =
            options.batch * seconds(single_time);
        (is_gram ? rate.gram_batched_seconds : rate.standard_batched_seconds) =
            seconds(batched_time);
      }
    }
    out.shapes.push_back(rate);
  }
  // Eigensolver and AdamW rates for the planner's cost model.
  out.eig_n =
      std::min<int64_t>(1024, std::max<int64_t>(256, shapes.front().rows / 4));
  CANZONA_ASSIGN_OR_RETURN(
      auto eig, KernelWorkload::SymmetricEigen(backend.get(), out.eig_n));
  CANZONA_ASSIGN_OR_RETURN(WorkloadTiming eig_time,
                           TimeWorkload(*eig, options.min_time));
  CANZONA_ASSIGN_OR_RETURN(auto adamw,
                           KernelWorkload::AdamW(backend.get(), 1 << 24));
  CANZONA_ASSIGN_OR_RETURN(WorkloadTiming adamw_time,
                           TimeWorkload(*adamw, options.min_time));

  double ns_flops = 0, ns_seconds = 0, gemm_best = 0;
  for (const ShapeRate& r : out.shapes) {
    ns_flops += r.ns_gflops * r.ns_seconds;
    ns_seconds += r.ns_seconds;
    gemm_best = std::max(gemm_best, r.gemm_gflops);
  }
  plan::Rates& measured = out.rates;
  measured.backend = std::string(BackendKindName(backend->kind()));
  measured.device = backend->description();
  measured.gemm_gflops = gemm_best;
  measured.ns_gflops = ns_flops / ns_seconds;
  measured.eigh_gflops = eig->flops() / seconds(eig_time) / 1e9;
  measured.adamw_gbps = adamw->bytes() / seconds(adamw_time) / 1e9;
  return out;
}

}  // namespace canzona::ctl
