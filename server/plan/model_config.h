// Model configurations (server/plan/models/*.json, Hugging Face config fields)
// and the parameter lists they imply under a given layout.
//
//   CANZONA_ASSIGN_OR_RETURN(ModelConfig config,
//                            LoadModelConfig(dir, "qwen3-32b"));
//   CANZONA_ASSIGN_OR_RETURN(
//       std::vector<ParamSpec> params,
//       BuildModelParameters(config, ModelLayout::kMegatron,
//                            OptimizerKind::kMuon, {.pp = 1, .dp = 32, .tp = 8}));
//
// Routing: 2-D hidden weights go to the matrix optimizer; embeddings,
// lm_head, the MoE router and every 1-D tensor to AdamW. Column-parallel
// weights (qkv / q,k,v, fc1 / gate,up, experts' fc1) split dim 0 under TP,
// row-parallel weights (proj / o_proj, fc2 / down_proj) split dim 1, the
// embedding and lm_head are vocab-parallel (dim 0; the vocabulary is padded
// up to a multiple of TP as Megatron pads it). PP stages split the layers
// evenly; the first stage also holds the embedding, the last the final norm
// and lm_head. Each MoE expert's matrices are separate parameters.
//
// Thread-safety: free functions over values.
#ifndef CANZONA_SERVER_PLAN_MODEL_CONFIG_H_
#define CANZONA_SERVER_PLAN_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "server/plan/cost_model.h"
#include "server/plan/parameter.h"

namespace canzona::plan {

struct ModelConfig {
  std::string name;
  std::string architecture;
  int64_t num_hidden_layers = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t moe_intermediate_size = 0;  // 0 for dense models
  int64_t num_experts = 0;            // 0 for dense models
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;

  bool is_moe() const { return num_experts > 0; }
};

enum class ModelLayout {
  kMegatron,  // fused linear_qkv and linear_fc1, Megatron names
  kHf,        // separate q/k/v and gate/up, Hugging Face names
};

absl::StatusOr<ModelLayout> ParseModelLayout(absl::string_view name);
const char* ModelLayoutName(ModelLayout layout);

absl::StatusOr<ModelConfig> ParseModelConfig(const nlohmann::json& json);
// `name_or_path` is a path when it ends in ".json" or contains '/',
// otherwise `<models_dir>/<name>.json`.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& models_dir,
                                            const std::string& name_or_path);

// Checks that the layout fits the model (heads, kv heads, intermediate
// sizes divisible by TP; layers by PP; no zero sizes) and builds the
// parameter list in trainer order.
absl::StatusOr<std::vector<ParamSpec>> BuildModelParameters(
    const ModelConfig& config, ModelLayout layout, OptimizerKind matrix_opt,
    const ParallelLayout& parallel, DType dtype = DType::kBFloat16);

}  // namespace canzona::plan

#endif  // CANZONA_SERVER_PLAN_MODEL_CONFIG_H_
