// The single-process reference the engine tests compare against
// (engine_test_util.h): deterministic parameters and gradients from a
// parameter's name, the DP average as the daemon forms it, and the
// optimizer applied whole (or per fragment, the negative control).
#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {

namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t NameHash(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  return h;
}

OptimizerKind GroupKind(const std::string& group) {
  return *ParseOptimizerKind(group);
}

// A fused parameter's values from its separate parameters' `values`.
std::vector<float> Fuse(
    const ModelParam& p,
    const std::function<std::vector<float>(const ModelParam&)>& values) {
  std::vector<float> out;
  const int64_t cols = p.shape[1];
  for (const RowsOf& rows : p.fused) {
    const std::vector<float> v = values(ModelParam{rows.name, rows.shape});
    out.insert(out.end(), v.begin() + rows.first * cols,
               v.begin() + (rows.first + rows.count) * cols);
  }
  return out;
}

}  // namespace

Params Unfuse(const std::vector<ModelParam>& fused_params,
              const Params& fused) {
  Params out;
  for (const ModelParam& p : fused_params) {
    const std::vector<float>& v = fused.at(p.name);
    if (p.fused.empty()) {
      out[p.name] = v;
      continue;
    }
    const int64_t cols = p.shape[1];
    int64_t at = 0;
    for (const RowsOf& rows : p.fused) {
      std::vector<float>& part = out[rows.name];
      part.resize(Numel(rows.shape));
      std::copy(v.begin() + at * cols, v.begin() + (at + rows.count) * cols,
                part.begin() + rows.first * cols);
      at += rows.count;
    }
  }
  return out;
}

std::vector<float> Fused(const ModelParam& p, const Params& separate) {
  if (p.fused.empty()) return separate.at(p.name);
  return Fuse(p, [&](const ModelParam& q) { return separate.at(q.name); });
}

std::vector<float> InitialParam(const JobConfig& config, const ModelParam& p) {
  if (!p.fused.empty()) {
    return Fuse(p,
                [&](const ModelParam& q) { return InitialParam(config, q); });
  }
  std::vector<float> v(Numel(p.shape));
  const uint64_t base = SplitMix(config.seed ^ NameHash(p.name));
  for (size_t e = 0; e < v.size(); ++e) {
    const uint64_t r = SplitMix(base + e);
    v[e] = (static_cast<float>(r % 2001) - 1000.0f) / 10000.0f;  // [-0.1, 0.1]
    if (p.shape.size() == 1) v[e] += 1.0f;  // norms start near 1
  }
  return v;
}

std::vector<float> FullGrad(const JobConfig& config, const ModelParam& p,
                            int step, int dp_rank) {
  if (!p.fused.empty()) {
    return Fuse(p, [&](const ModelParam& q) {
      return FullGrad(config, q, step, dp_rank);
    });
  }
  if (config.layout_free_grads) {
    // g_d = G + (2d + 1 - dp) H: the DP sum is dp G exactly.
    JobConfig plain = config;
    plain.layout_free_grads = false;
    plain.exact = true;
    std::vector<float> v = FullGrad(plain, p, step, 0);
    const std::vector<float> h = FullGrad(plain, p, step, 1);
    const float k = static_cast<float>(2 * dp_rank + 1 - config.dp);
    for (size_t e = 0; e < v.size(); ++e) v[e] += k * h[e];
    return v;
  }
  std::vector<float> v(Numel(p.shape));
  const uint64_t base = SplitMix(SplitMix(config.seed * 7919 + step) ^
                                 NameHash(p.name) ^ (uint64_t(dp_rank) << 48));
  for (size_t e = 0; e < v.size(); ++e) {
    const uint64_t r = SplitMix(base + e);
    if (config.exact) {
      // Integers in [-64, 64] times 2^-12: every DP sum is exact.
      v[e] =
          std::ldexp(static_cast<float>(static_cast<int>(r % 129) - 64), -12);
    } else {
      v[e] = static_cast<float>(
          (static_cast<double>(r >> 11) / 9007199254740992.0 - 0.5) * 0.02);
    }
  }
  return v;
}

std::vector<float> Rounded(DType dtype, std::vector<float> values) {
  if (dtype == DType::kFloat32) return values;
  std::vector<uint16_t> bits(values.size());
  RoundFromFloat(values.data(), static_cast<int64_t>(values.size()), dtype,
                 bits.data());
  WidenToFloat(dtype, bits.data(), static_cast<int64_t>(values.size()),
               values.data());
  return values;
}

std::vector<std::vector<float>> AveragedGrads(const JobConfig& config,
                                              int step) {
  // DP sums run in the trainer's dtype unless grad_reduce_fp32: summed in
  // fp32 in rank order and rounded once.
  const bool reduce_rounds = config.dp > 1 && !config.grad_reduce_fp32;
  const float factor = static_cast<float>(1.0 / config.dp);
  std::vector<std::vector<float>> avg;
  for (const ModelParam& p : config.params) {
    std::vector<float> sum =
        Rounded(config.dtype, FullGrad(config, p, step, 0));
    for (int d = 1; d < config.dp; ++d) {
      std::vector<float> g =
          Rounded(config.dtype, FullGrad(config, p, step, d));
      for (size_t e = 0; e < sum.size(); ++e) sum[e] += g[e];
    }
    if (reduce_rounds) sum = Rounded(config.dtype, std::move(sum));
    for (float& x : sum) x *= factor;
    avg.push_back(std::move(sum));
  }
  return avg;
}

double ReferenceGradNorm(const JobConfig& config, int step) {
  double sumsq = 0;
  for (const auto& g : AveragedGrads(config, step)) {
    for (float x : g) sumsq += static_cast<double>(x) * x;
  }
  return std::sqrt(sumsq);
}

absl::StatusOr<Params> Reference(const JobConfig& config, int steps,
                                 const std::set<int>& skip_steps,
                                 const std::string& fragment_param,
                                 bool round_each_step, int first_step) {
  CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                           CreateBackend(BackendKind::kCpu));
  const size_t count = config.params.size();
  std::vector<std::vector<float>> params(count);
  std::vector<std::vector<std::unique_ptr<UpdateRule>>> rules(count);
  for (size_t k = 0; k < count; ++k) {
    const ModelParam& p = config.params[k];
    CANZONA_ASSIGN_OR_RETURN(
        OptimizerConfig oc,
        MakeOptimizerConfig(GroupKind(p.group), GroupSettings(p.group)));
    params[k] = Rounded(config.dtype, InitialParam(config, p));
    const bool fragmented = p.name == fragment_param && p.split >= 0;
    std::vector<int64_t> shape =
        fragmented ? LocalShape(p, config.tp) : p.shape;
    BlockSpec blocks = fragmented ? BlockSpec{} : p.blocks;
    if (oc.kind != OptimizerKind::kAdamW) {
      CANZONA_ASSIGN_OR_RETURN(SteppedMatrix stepped, MatrixOfParameter(shape));
      shape = stepped.shape;
      if (!stepped.blocks.empty()) blocks = stepped.blocks;
    }
    for (int j = 0; j < (fragmented ? config.tp : 1); ++j) {
      CANZONA_ASSIGN_OR_RETURN(
          auto rule,
          UpdateRule::CreateBlocked(oc, shape, blocks, p.name, backend.get()));
      rules[k].push_back(std::move(rule));
    }
  }
  for (int s = first_step; s <= steps; ++s) {
    if (skip_steps.count(s)) continue;
    std::vector<std::vector<float>> avg = AveragedGrads(config, s);
    double sumsq = 0;
    for (const auto& g : avg) {
      for (float x : g) sumsq += static_cast<double>(x) * x;
    }
    const auto step_clip = config.step_max_grad_norm.find(s);
    const double max_norm = step_clip != config.step_max_grad_norm.end()
                                ? step_clip->second
                                : config.max_grad_norm;
    if (max_norm > 0) {
      const double clip = std::min(1.0, max_norm / (std::sqrt(sumsq) + 1e-6));
      if (clip < 1) {
        for (auto& g : avg) {
          for (float& x : g) x *= static_cast<float>(clip);
        }
      }
    }
    // This step's scheduled settings, by group.
    std::map<std::string, OptimizerConfig> scheduled;
    if (auto it = config.step_settings.find(s);
        it != config.step_settings.end()) {
      for (const auto& [group, values] : it->second) {
        CANZONA_ASSIGN_OR_RETURN(
            OptimizerConfig registered,
            MakeOptimizerConfig(GroupKind(group), GroupSettings(group)));
        CANZONA_ASSIGN_OR_RETURN(scheduled[group],
                                 ScheduleSettings(registered, values));
      }
    }
    for (size_t k = 0; k < count; ++k) {
      const ModelParam& p = config.params[k];
      std::vector<float>& param = params[k];
      StepOptions options;
      if (auto it = scheduled.find(p.group); it != scheduled.end()) {
        options.settings = &it->second;
      }
      if (rules[k].size() == 1) {
        CANZONA_RETURN_IF_ERROR(
            rules[k][0]->Step(param.data(), avg[k].data(), options));
        if (round_each_step) param = Rounded(config.dtype, std::move(param));
        continue;
      }
      for (int j = 0; j < config.tp; ++j) {
        std::vector<float> pf = Fragment(p, config.tp, j, param);
        std::vector<float> gf = Fragment(p, config.tp, j, avg[k]);
        CANZONA_RETURN_IF_ERROR(
            rules[k][j]->Step(pf.data(), gf.data(), options));
        PutFragment(p, config.tp, j, pf, &param);
      }
    }
  }
  Params out;
  for (size_t k = 0; k < count; ++k) {
    out[config.params[k].name] = std::move(params[k]);
  }
  return out;
}

}  // namespace canzona::engine_test
