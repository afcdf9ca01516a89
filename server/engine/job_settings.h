// JobSettings: what every rank of a job must agree on, as Register stated
// it and ValidateRegisterRequest checked it (layout, strategy, buckets,
// shard groups, optimizer groups). A Job holds one, immutable; the plan is
// built from it and the stages' parameter lists.
//
// Thread-safety: a plain value; immutable once the job exists.
#ifndef CANZONA_SERVER_ENGINE_JOB_SETTINGS_H_
#define CANZONA_SERVER_ENGINE_JOB_SETTINGS_H_

#include <cstdint>
#include <map>
#include <string>

#include "canzona/v1/optimizer_service.pb.h"
#include "server/optim/optimizer_config.h"
#include "server/plan/planner.h"

namespace canzona {

struct JobSettings {
  canzona::v1::WorldLayout layout;
  int world = 1;  // pp x dp x tp
  plan::Strategy strategy = plan::Strategy::kCost;
  std::string strategy_name;
  double alpha = 1.0;
  int64_t bucket_size = 0;
  int shard_group_size = 1;                        // S (= dp when flat)
  std::map<std::string, OptimizerConfig> configs;  // by group name
  // Clip at this global gradient norm (0: no clipping; a Step may
  // override it).
  double max_grad_norm = 0;
  // DP gradient reductions in fp32 whatever the parameters' dtype
  // (Megatron's grad_reduce_in_fp32); else in the parameters' dtype.
  bool grad_reduce_fp32 = false;
  // The settings above as canonical text ("key=value" lines), which the
  // ranks compare line by line so that a disagreement names its field.
  std::string meta;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_JOB_SETTINGS_H_
