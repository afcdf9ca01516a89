// The planner's view of one trainer parameter and of the job layout.
//
// Thread-safety: plain value types.
#ifndef CANZONA_SERVER_PLAN_PARAMETER_H_
#define CANZONA_SERVER_PLAN_PARAMETER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "server/plan/cost_model.h"

namespace canzona::plan {

// One parameter as the trainer registers it, in trainer order.
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;  // global shape ([out, in] for linear weights)
  DType dtype = DType::kBFloat16;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  int tp_split_dim = -1;  // -1: replicated over TP; 0 or 1: split dim
  int pp_stage = 0;       // pipeline stage that holds it
  // A fused matrix's blocks (server/optim/matrix_blocks.h), each updated
  // as its own matrix: the cost is theirs. Empty: one matrix.
  std::vector<std::vector<int64_t>> block_shapes;
};

// PP x DP x TP sizes of the job.
struct ParallelLayout {
  int pp = 1;
  int dp = 1;
  int tp = 1;
};

// The parameter's per-step work and state bytes under `model`: its
// blocks' when it has blocks (each updated as its own matrix), the whole
// matrix's otherwise (plus an fp32 master copy for 16-bit parameters
// either way).
ParamWork WorkOf(const CostModel& model, const ParamSpec& p);
double StateBytesOf(const CostModel& model, const ParamSpec& p);

inline int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Elements of the parameter's shard on one of `tp` TP ranks: numel / tp
// when it is split over TP (tp > 1), else numel.
inline int64_t LocalNumel(const ParamSpec& p, int tp) {
  const int64_t n = Numel(p.shape);
  return p.tp_split_dim >= 0 && tp > 1 ? n / tp : n;
}

}  // namespace canzona::plan

#endif  // CANZONA_SERVER_PLAN_PARAMETER_H_
