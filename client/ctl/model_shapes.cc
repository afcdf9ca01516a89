#include "client/ctl/model_shapes.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <system_error>
#include <utility>

#include "kernels/base/status_macros.h"
#include "server/plan/model_config.h"

namespace canzona {

const char kModelsDirHelp[] =
    "directory of model configs (default: $CANZONA_MODELS_DIR, else the "
    "installed share/canzona/models beside this binary, else the source "
    "tree's server/plan/models)";

std::string ResolveModelsDir(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("CANZONA_MODELS_DIR"); env && *env) {
    return env;
  }
  std::error_code error;
  const std::filesystem::path exe =
      std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    const std::filesystem::path installed =
        (exe.parent_path() / CANZONA_MODELS_INSTALL_RELDIR).lexically_normal();
    if (std::filesystem::is_directory(installed, error)) {
      return installed.string();
    }
  }
  return CANZONA_MODELS_SOURCE_DIR;
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
