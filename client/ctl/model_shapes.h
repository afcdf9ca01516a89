// The distinct matrix-optimizer shapes of a model config, for kernel
// benchmarks (canzonactl bench kernels, tests/bench), plus where model
// configs are looked up.
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

// `flag` when set, else $CANZONA_MODELS_DIR, else $CANZONA_SHARED_DIR/models,
// else the source tree's
// ../shared/models (compiled in as CANZONA_DEFAULT_MODELS_DIR).
std::string ResolveModelsDir(const std::string& flag);

// The whole (unsplit) 2-D hidden weights that a matrix optimizer updates,
// Hugging Face layout, one entry per distinct shape, largest first.
absl::StatusOr<std::vector<MatrixShape>> DistinctMatrixShapes(
    const std::string& model, const std::string& models_dir_flag);

}  // namespace canzona

#endif  // CANZONA_CLIENT_CTL_MODEL_SHAPES_H_
