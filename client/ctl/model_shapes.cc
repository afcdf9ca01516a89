#include "client/ctl/model_shapes.h"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "server/plan/model_config.h"

namespace canzona {

std::string ResolveModelsDir(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("CANZONA_MODELS_DIR"); env && *env) {
    return env;
  }
  if (const char* env = std::getenv("CANZONA_SHARED_DIR"); env && *env) {
    return absl::StrCat(env, "/models");
  }
#ifdef CANZONA_DEFAULT_MODELS_DIR
  return CANZONA_DEFAULT_MODELS_DIR;
#else
  return "models";
#endif
}

absl::StatusOr<std::vector<MatrixShape>> DistinctMatrixShapes(
    const std::string& model, const std::string& models_dir_flag) {
  CANZONA_ASSIGN_OR_RETURN(
      plan::ModelConfig config,
      plan::LoadModelConfig(ResolveModelsDir(models_dir_flag), model));
  CANZONA_ASSIGN_OR_RETURN(
      std::vector<plan::ParamSpec> params,
      plan::BuildModelParameters(config, plan::ModelLayout::kHf,
                                 plan::OptimizerKind::kMuon,
                                 plan::ParallelLayout{}));
  std::set<std::pair<int64_t, int64_t>> seen;
  std::vector<MatrixShape> shapes;
  for (const plan::ParamSpec& p : params) {
    if (p.optimizer != plan::OptimizerKind::kMuon || p.shape.size() != 2)
      continue;
    if (seen.insert({p.shape[0], p.shape[1]}).second) {
      shapes.push_back({p.shape[0], p.shape[1]});
    }
  }
  std::stable_sort(shapes.begin(), shapes.end(),
                   [](const MatrixShape& a, const MatrixShape& b) {
                     return a.rows * a.cols > b.rows * b.cols;
                   });
  return shapes;
}

}  // namespace canzona
