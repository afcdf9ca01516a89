#include "client/ctl/plan_request.h"

#include <cmath>
#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/ctl/model_shapes.h"
#include "kernels/base/status_macros.h"
#include "server/plan/cost_model.h"
#include "server/plan/model_config.h"

namespace canzona::ctl {
namespace {

absl::StatusOr<int64_t> WholeCount(double value, const char* flag) {
  if (!(value >= 1) || value != std::floor(value) || value > 9e18) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " must be a positive whole number"));
  }
  return static_cast<int64_t>(value);
}

}  // namespace

void AddPlanFlags(CLI::App* cmd, PlanFlags* flags) {
  cmd->add_option("--model", flags->model,
                  "model name in the models directory, or a .json path");
  cmd->add_option("--layout", flags->layout, "megatron or hf")
      ->capture_default_str();
  cmd->add_option("--pp", flags->pp, "pipeline stages")->capture_default_str();
  cmd->add_option("--dp", flags->dp, "data-parallel size")
      ->capture_default_str();
  cmd->add_option("--tp", flags->tp, "tensor-parallel size")
      ->capture_default_str();
  cmd->add_option("--optimizer", flags->optimizer,
                  "matrix optimizer: muon, shampoo, soap (adamw: all AdamW)")
      ->capture_default_str();
  cmd->add_option("--strategy", flags->strategy,
                  "sc, layerwise, start_anchored, alpha, cost")
      ->capture_default_str();
  cmd->add_option("--alpha", flags->alpha,
                  "alpha strategy: 0 comm .. 1 compute")
      ->capture_default_str();
  cmd->add_option("--rates", flags->rates,
                  "calibrated rates JSON (canzonactl bench kernels)");
  cmd->add_option("--bucket-size", flags->bucket_size,
                  "DDP bucket size in elements")
      ->capture_default_str();
  cmd->add_option("--fuse-space", flags->fuse_space,
                  "micro-group fuse space, elements per host slot")
      ->capture_default_str();
  cmd->add_option("--dtype", flags->dtype, "parameter dtype: bf16, fp16, fp32")
      ->capture_default_str();
  cmd->add_option("--models-dir", flags->models_dir, kModelsDirHelp);
  cmd->add_option("--layers", flags->layers,
                  "keep this many layers of the model (0: all)");
  cmd->add_option("--vocab", flags->vocab,
                  "cut the vocabulary to this size (0: the model's)");
  cmd->add_option("--shard-group-size", flags->shard_group_size,
                  "hierarchical sharding: DP ranks per shard group (divides "
                  "--dp; 0 = flat)")
      ->capture_default_str();
}

absl::StatusOr<plan::PlanRequest> MakePlanRequest(
    const PlanFlags& flags, const std::string& model,
    const std::string& layout_name, int pp, int dp, int tp) {
  auto invalid = [](const char* message) {
    return absl::InvalidArgumentError(message);
  };
  if (pp <= 0) return invalid("--pp must be positive");
  if (dp <= 0) return invalid("--dp must be positive");
  if (tp <= 0) return invalid("--tp must be positive");
  if (flags.layers < 0) return invalid("--layers must be >= 0");
  if (flags.vocab < 0) return invalid("--vocab must be >= 0");
  CANZONA_ASSIGN_OR_RETURN(const plan::ModelLayout layout,
                           plan::ParseModelLayout(layout_name));
  CANZONA_ASSIGN_OR_RETURN(const plan::OptimizerKind matrix,
                           plan::ParseOptimizerKind(flags.optimizer));
  CANZONA_ASSIGN_OR_RETURN(const plan::DType dtype,
                           plan::ParseDType(flags.dtype));
  CANZONA_ASSIGN_OR_RETURN(
      plan::ModelConfig config,
      plan::LoadModelConfig(ResolveModelsDir(flags.models_dir), model));
  if (flags.layers > 0) config.num_hidden_layers = flags.layers;
  if (flags.vocab > 0) config.vocab_size = flags.vocab;
  plan::PlanRequest req;
  req.layout = {pp, dp, tp};
  CANZONA_ASSIGN_OR_RETURN(
      req.parameters,
      plan::BuildModelParameters(config, layout, matrix, req.layout, dtype));
  CANZONA_ASSIGN_OR_RETURN(req.bucket_size,
                           WholeCount(flags.bucket_size, "--bucket-size"));
  CANZONA_ASSIGN_OR_RETURN(req.fuse_space,
                           WholeCount(flags.fuse_space, "--fuse-space"));
  if (!(flags.alpha >= 0 && flags.alpha <= 1)) {
    return invalid("--alpha must be in [0, 1]");
  }
  req.alpha = flags.alpha;
  std::optional<plan::Rates> rates;
  if (!flags.rates.empty()) {
    CANZONA_ASSIGN_OR_RETURN(rates, plan::LoadRatesFile(flags.rates));
  }
  req.cost_model = plan::CostModel(plan::CostModelOptions{}, rates);
  if (flags.shard_group_size < 0) {
    return invalid("--shard-group-size must be >= 0");
  }
  req.shard_group_size = flags.shard_group_size;
  CANZONA_ASSIGN_OR_RETURN(req.strategy, plan::ParseStrategy(flags.strategy));
  return req;
}

absl::StatusOr<plan::PlanRequest> MakePlanRequest(const PlanFlags& flags) {
  if (flags.model.empty()) {
    return absl::InvalidArgumentError(
        "--model is required (a name or a .json path)");
  }
  return MakePlanRequest(flags, flags.model, flags.layout, flags.pp, flags.dp,
                         flags.tp);
}

}  // namespace canzona::ctl
