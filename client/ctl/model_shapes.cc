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

const char kProfilesDirHelp[] =
    "directory of hardware profiles (default: $CANZONA_PROFILES_DIR, else the "
    "installed share/canzona/profiles beside this binary, else the source "
    "tree's server/plan/sim/profiles)";

namespace {

// flag, else $env, else <dir of /proc/self/exe>/<installed> when it
// exists, else the source tree's copy.
std::string ResolveDataDir(const std::string& flag, const char* env,
                           const char* installed_reldir,
                           const char* source_dir) {
  if (!flag.empty()) return flag;
  if (const char* value = std::getenv(env); value && *value) return value;
  std::error_code error;
  const std::filesystem::path exe =
      std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    const std::filesystem::path installed =
        (exe.parent_path() / installed_reldir).lexically_normal();
    if (std::filesystem::is_directory(installed, error)) {
      return installed.string();
    }
  }
  return source_dir;
}

}  // namespace

std::string ResolveModelsDir(const std::string& flag) {
  return ResolveDataDir(flag, "CANZONA_MODELS_DIR",
                        CANZONA_MODELS_INSTALL_RELDIR,
                        CANZONA_MODELS_SOURCE_DIR);
}

std::string ResolveProfilesDir(const std::string& flag) {
  return ResolveDataDir(flag, "CANZONA_PROFILES_DIR",
                        CANZONA_PROFILES_INSTALL_RELDIR,
                        CANZONA_PROFILES_SOURCE_DIR);
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
