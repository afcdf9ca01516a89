// Where model configs and hardware profiles are found, and the distinct
// matrix-optimizer shapes of a model config for kernel benchmarks (canzonactl
// bench kernels, tests/bench).
//
// Thread-safety: stateless functions.
#ifndef CANZONA_CLIENT_CTL_MODEL_SHAPES_H_
#define CANZONA_CLIENT_CTL_MODEL_SHAPES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace canzona {

struct MatrixShape {
  int64_t rows = 0;
  int64_t cols = 0;
};

// The directory `--model NAME` is looked up in, first match wins:
//   1. `flag` (--models-dir) when set;
//   2. $CANZONA_MODELS_DIR when set;
//   3. the installed configs beside this executable,
//      <dir of /proc/self/exe>/../share/canzona/models (the relative path is
//      compiled in from the install layout), when that directory exists:
//      an installed canzonactl needs no environment, wherever the prefix
//      was moved;
//   4. the source tree's server/plan/models (compiled in), for binaries run
//      from a build tree.
std::string ResolveModelsDir(const std::string& flag);

// --models-dir's help text, the same for every subcommand.
extern const char kModelsDirHelp[];

// The directory `--profile NAME` (the step simulator's hardware profiles,
// server/plan/sim/hardware_profile.h) is looked up in, the same way:
// `flag` (--profiles-dir), $CANZONA_PROFILES_DIR, the installed
// <bin>/../share/canzona/profiles, the source tree's
// server/plan/sim/profiles.
std::string ResolveProfilesDir(const std::string& flag);
extern const char kProfilesDirHelp[];

// The whole (unsplit) 2-D hidden weights that a matrix optimizer updates,
// Hugging Face layout, one entry per distinct shape, largest first.
absl::StatusOr<std::vector<MatrixShape>> DistinctMatrixShapes(
    const std::string& model, const std::string& models_dir_flag);

}  // namespace canzona

#endif  // CANZONA_CLIENT_CTL_MODEL_SHAPES_H_
