// The planning flags that `canzonactl plan` and `canzonactl simulate` share
// (model, layout, sizes, optimizer, strategy, planner knobs) and the
// PlanRequest they describe, so that both commands plan a job exactly the
// same way (and the way the daemons do).
//
// Thread-safety: single-threaded command-line code.
#ifndef CANZONA_CLIENT_CTL_PLAN_REQUEST_H_
#define CANZONA_CLIENT_CTL_PLAN_REQUEST_H_

#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "server/plan/planner.h"

namespace canzona::ctl {

struct PlanFlags {
  std::string model;
  std::string layout = "megatron";
  int pp = 1;
  int dp = 1;
  int tp = 1;
  std::string optimizer = "muon";
  std::string strategy = "cost";
  double alpha = 1.0;
  std::string rates;
  double bucket_size = 4e8;
  double fuse_space = 400.0 * 1024 * 1024;
  std::string dtype = "bf16";
  std::string models_dir;
  int shard_group_size = 0;  // 0: flat
  // Cut the model to this many layers / this vocabulary (0: as configured),
  // as `canzonactl bench step --layers --vocab` does.
  int layers = 0;
  int vocab = 0;
};

// Adds --model --layout --pp --dp --tp --optimizer --strategy --alpha
// --rates --bucket-size --fuse-space --dtype --models-dir --layers --vocab
// --shard-group-size, defaulting to the values already in `flags`.
void AddPlanFlags(CLI::App* cmd, PlanFlags* flags);

// The request for `model` at `layout_name` and pp x dp x tp (the grid
// varies them; the other flags as given). Errors name the flag or field.
absl::StatusOr<plan::PlanRequest> MakePlanRequest(
    const PlanFlags& flags, const std::string& model,
    const std::string& layout_name, int pp, int dp, int tp);

// The same for the flags' own model and sizes.
absl::StatusOr<plan::PlanRequest> MakePlanRequest(const PlanFlags& flags);

}  // namespace canzona::ctl

#endif  // CANZONA_CLIENT_CTL_PLAN_REQUEST_H_
