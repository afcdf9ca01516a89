// JobPlan: the job's plan (server/plan) and the parameter metadata every
// rank derives from it, built from the stages' canonical parameter lists
// and the job settings. Every daemon builds the same JobPlan from the same
// inputs (the ranks then compare the plan digests).
//
// The canonical parameter line ("name|d0,d1|tp_split_dim|group", then
// "|bf16" for 16-bit parameters and "|blocks=..." for blocked ones) is how a
// rank states its stage's parameters on the control plane; CanonicalParam
// writes it and ParseParamLine reads it back.
//
//   CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<const JobPlan> jp,
//                            BuildJobPlan(settings, stage_plists));
//
// Thread-safety: pure functions; a JobPlan is immutable once built and
// shared read-only by the job's ranks.
#ifndef CANZONA_SERVER_ENGINE_JOB_PLAN_H_
#define CANZONA_SERVER_ENGINE_JOB_PLAN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "kernels/base/dtype.h"
#include "server/engine/job_settings.h"
#include "server/optim/matrix_blocks.h"
#include "server/optim/optimizer_config.h"
#include "server/plan/planner.h"

namespace canzona {

// One parameter of the job (all stages), in plan order.
struct ParamMeta {
  std::string name;
  std::vector<int64_t> shape;  // global
  int split = -1;              // TP split dimension, -1: replicated
  std::string group;
  int stage = 0;
  int64_t numel = 0;
  int64_t fragment_numel = 0;  // of one TP fragment
  std::vector<int64_t> local_shape;
  // The trainer's element type; the daemon keeps fp32 master weights of
  // what it owns when it is not kFloat32.
  DType dtype = DType::kFloat32;
  // The fused matrix's blocks (empty: one matrix), and each TP rank's
  // fragment as a block of the whole (shape local_shape, its runs along the
  // split dimension) when it is not one contiguous run (fc1 [gate_t;
  // up_t]); empty otherwise.
  BlockSpec blocks;
  std::vector<MatrixBlock> fragments;
};

struct JobPlan {
  plan::Plan plan;
  std::vector<ParamMeta> params;
  std::vector<int> stage_first;  // first param index of each stage
  int64_t total_numel = 0;
};

// `stage_plists[s]`: the canonical parameter list of stage s. INTERNAL for
// a malformed line (the ranks' own output), INVALID_ARGUMENT "planner: ..."
// when the planner rejects the job.
absl::StatusOr<std::shared_ptr<const JobPlan>> BuildJobPlan(
    const JobSettings& settings, const std::vector<std::string>& stage_plists);

std::string CanonicalParam(const canzona::v1::Parameter& p);
// The line of `p` with `shape` and `blocks` in place of its own: what a
// matrix optimizer steps of an N-D parameter (MatrixOfParameter).
std::string CanonicalParam(const canzona::v1::Parameter& p,
                           absl::Span<const int64_t> shape,
                           const BlockSpec& blocks);
// The parameter's block spec as the proto gives it (repeat 0 read as 1).
BlockSpec BlockSpecOf(const canzona::v1::Parameter& p);
// The element type of a validated parameter (DTYPE_FLOAT32, _BFLOAT16 or
// _FLOAT16).
DType DTypeOf(canzona::v1::DType dtype);
absl::StatusOr<ParamMeta> ParseParamLine(absl::string_view line, int stage,
                                         int tp);

// Whether the optimizer updates whole matrices (Muon, Shampoo, SOAP), which
// TP fragments must be rebuilt for.
bool IsMatrix(OptimizerKind kind);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_JOB_PLAN_H_
