#include "server/plan/model_config.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace canzona::plan {
namespace {

absl::Status ReadInt(const nlohmann::json& json, const char* key, bool required,
                     int64_t* out) {
  auto it = json.find(key);
  if (it == json.end() || it->is_null()) {
    if (required) {
      return absl::InvalidArgumentError(
          absl::StrCat("model config: missing '", key, "'"));
    }
    return absl::OkStatus();
  }
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config: '", key, "' must be an integer"));
  }
  *out = it->get<int64_t>();
  if (*out <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config: '", key, "' must be positive"));
  }
  return absl::OkStatus();
}

absl::Status CheckDivides(int64_t value, const char* what, int64_t size,
                          const char* size_name) {
  if (value % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        size_name, " ", size, " does not divide ", what, " ", value));
  }
  return absl::OkStatus();
}

// Appends parameters in trainer order; `stage` is set by the caller.
class ParamListBuilder {
 public:
  ParamListBuilder(OptimizerKind matrix_opt, DType dtype)
      : matrix_opt_(matrix_opt), dtype_(dtype) {}

  // `blocks`: the row counts of a fused matrix's blocks (Megatron's qkv
  // as q, k, v; fc1 as gate, up), each updated as its own matrix.
  void Matrix(std::string name, int64_t rows, int64_t cols, int split,
              int stage, const std::vector<int64_t>& blocks = {}) {
    params_.push_back(
        {std::move(name), {rows, cols}, dtype_, matrix_opt_, split, stage});
    for (int64_t block_rows : blocks) {
      params_.back().block_shapes.push_back({block_rows, cols});
    }
  }
  void AdamW(std::string name, std::vector<int64_t> shape, int split,
             int stage) {
    params_.push_back({std::move(name), std::move(shape), dtype_,
                       OptimizerKind::kAdamW, split, stage});
  }
  std::vector<ParamSpec> Take() { return std::move(params_); }

 private:
  OptimizerKind matrix_opt_;
  DType dtype_;
  std::vector<ParamSpec> params_;
};

}  // namespace

absl::StatusOr<ModelLayout> ParseModelLayout(absl::string_view name) {
  if (name == "megatron") return ModelLayout::kMegatron;
  if (name == "hf") return ModelLayout::kHf;
  return absl::InvalidArgumentError(
      absl::StrCat("layout: unknown layout '", name, "' (megatron, hf)"));
}

const char* ModelLayoutName(ModelLayout layout) {
  return layout == ModelLayout::kMegatron ? "megatron" : "hf";
}

absl::StatusOr<ModelConfig> ParseModelConfig(const nlohmann::json& json) {
  if (!json.is_object()) {
    return absl::InvalidArgumentError("model config: expected a JSON object");
  }
  ModelConfig config;
  if (auto it = json.find("name"); it != json.end() && it->is_string()) {
    config.name = it->get<std::string>();
  }
  if (auto it = json.find("architecture");
      it != json.end() && it->is_string()) {
    config.architecture = it->get<std::string>();
  }
  auto status =
      ReadInt(json, "num_hidden_layers", true, &config.num_hidden_layers);
  if (status.ok()) {
    status = ReadInt(json, "hidden_size", true, &config.hidden_size);
  }
  if (status.ok()) {
    status =
        ReadInt(json, "intermediate_size", true, &config.intermediate_size);
  }
  if (status.ok()) {
    status =
        ReadInt(json, "num_attention_heads", true, &config.num_attention_heads);
  }
  if (status.ok()) {
    config.num_key_value_heads = config.num_attention_heads;
    status = ReadInt(json, "num_key_value_heads", false,
                     &config.num_key_value_heads);
  }
  if (status.ok()) {
    status = ReadInt(json, "vocab_size", true, &config.vocab_size);
  }
  if (status.ok()) {
    status = ReadInt(json, "num_experts", false, &config.num_experts);
  }
  if (status.ok()) {
    status = ReadInt(json, "moe_intermediate_size", false,
                     &config.moe_intermediate_size);
  }
  if (status.ok()) {
    config.head_dim = config.hidden_size / config.num_attention_heads;
    status = ReadInt(json, "head_dim", false, &config.head_dim);
  }
  if (!status.ok()) return status;
  if (config.num_experts > 0 && config.moe_intermediate_size == 0) {
    return absl::InvalidArgumentError(
        "model config: 'moe_intermediate_size' is required with num_experts");
  }
  if (auto it = json.find("tie_word_embeddings"); it != json.end()) {
    if (!it->is_boolean()) {
      return absl::InvalidArgumentError(
          "model config: 'tie_word_embeddings' must be a boolean");
    }
    config.tie_word_embeddings = it->get<bool>();
  }
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& models_dir,
                                            const std::string& name_or_path) {
  if (name_or_path.empty()) {
    return absl::InvalidArgumentError("model: empty model name");
  }
  const bool is_path = absl::EndsWith(name_or_path, ".json") ||
                       name_or_path.find('/') != std::string::npos;
  const std::string path =
      is_path ? name_or_path
              : absl::StrCat(models_dir, "/", name_or_path, ".json");
  std::ifstream in(path);
  if (!in) {
    if (is_path) {
      return absl::NotFoundError(
          absl::StrCat("model: cannot open model file '", path, "'"));
    }
    return absl::NotFoundError(absl::StrCat("model: unknown model '",
                                            name_or_path, "' (no ", path, ")"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  nlohmann::json json =
      nlohmann::json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: '", path, "' is not valid JSON"));
  }
  auto config = ParseModelConfig(json);
  if (!config.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config.status().message(), " (", path, ")"));
  }
  if (config->name.empty()) config->name = name_or_path;
  return config;
}

absl::StatusOr<std::vector<ParamSpec>> BuildModelParameters(
    const ModelConfig& config, ModelLayout layout, OptimizerKind matrix_opt,
    const ParallelLayout& parallel, DType dtype) {
  if (parallel.pp <= 0)
    return absl::InvalidArgumentError("pp must be positive");
  if (parallel.dp <= 0)
    return absl::InvalidArgumentError("dp must be positive");
  if (parallel.tp <= 0)
    return absl::InvalidArgumentError("tp must be positive");
  if (!IsMatrixOptimizer(matrix_opt)) {
    // AdamW everywhere is allowed: nothing is TP-owned, everything is sliced.
  }
  const int64_t tp = parallel.tp;
  const int64_t pp = parallel.pp;
  const int64_t layers = config.num_hidden_layers;
  const int64_t hidden = config.hidden_size;
  const int64_t heads = config.num_attention_heads;
  const int64_t kv = config.num_key_value_heads;
  const int64_t hd = config.head_dim;
  if (layers <= 0 || hidden <= 0 || heads <= 0 || kv <= 0 || hd <= 0 ||
      config.intermediate_size <= 0 || config.vocab_size <= 0) {
    return absl::InvalidArgumentError("model config: sizes must be positive");
  }
  auto status = CheckDivides(layers, "layers", pp, "pp");
  if (status.ok()) status = CheckDivides(heads, "attention heads", tp, "tp");
  if (status.ok() && kv % tp != 0 && tp % kv != 0) {
    // Megatron needs kv % tp == 0; with tp a multiple of kv the KV heads are
    // replicated (tp / kv copies), which keeps the fused shapes splittable.
    status = absl::InvalidArgumentError(
        absl::StrCat("tp ", tp, " does not divide kv heads ", kv,
                     " (nor do they divide tp)"));
  }
  if (status.ok() && heads % kv != 0) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "kv heads ", kv, " do not divide attention heads ", heads));
  }
  if (status.ok() && !config.is_moe()) {
    status =
        CheckDivides(config.intermediate_size, "intermediate size", tp, "tp");
  }
  if (status.ok() && config.is_moe()) {
    status = CheckDivides(config.moe_intermediate_size, "moe intermediate size",
                          tp, "tp");
  }
  if (!status.ok()) return status;

  // kv heads as seen by the TP shards: replicated up to tp when tp > kv.
  const int64_t vocab = (config.vocab_size + tp - 1) / tp * tp;
  const int64_t layers_per_stage = layers / pp;
  const int last_stage = static_cast<int>(pp - 1);
  ParamListBuilder b(matrix_opt, dtype);
  const bool mega = layout == ModelLayout::kMegatron;

  if (mega) {
    b.AdamW("embedding.word_embeddings.weight", {vocab, hidden}, 0, 0);
  } else {
    b.AdamW("model.embed_tokens.weight", {vocab, hidden}, 0, 0);
  }
  for (int64_t l = 0; l < layers; ++l) {
    const int stage = static_cast<int>(l / layers_per_stage);
    if (mega) {
      const std::string p = absl::StrCat("decoder.layers.", l, ".");
      b.AdamW(p + "input_layernorm.weight", {hidden}, -1, stage);
      // Blocks as a Hugging Face layout updates them (q, k, v; gate, up).
      b.Matrix(p + "self_attention.linear_qkv.weight", (heads + 2 * kv) * hd,
               hidden, 0, stage, {heads * hd, kv * hd, kv * hd});
      b.AdamW(p + "self_attention.q_layernorm.weight", {hd}, -1, stage);
      b.AdamW(p + "self_attention.k_layernorm.weight", {hd}, -1, stage);
      b.Matrix(p + "self_attention.linear_proj.weight", hidden, heads * hd, 1,
               stage);
      b.AdamW(p + "pre_mlp_layernorm.weight", {hidden}, -1, stage);
      if (config.is_moe()) {
        const int64_t im = config.moe_intermediate_size;
        b.AdamW(p + "mlp.router.weight", {config.num_experts, hidden}, -1,
                stage);
        for (int64_t e = 0; e < config.num_experts; ++e) {
          const std::string ep =
              absl::StrCat(p, "mlp.experts.local_experts.", e, ".");
          b.Matrix(ep + "linear_fc1.weight", 2 * im, hidden, 0, stage,
                   {im, im});
          b.Matrix(ep + "linear_fc2.weight", hidden, im, 1, stage);
        }
      } else {
        const int64_t im = config.intermediate_size;
        b.Matrix(p + "mlp.linear_fc1.weight", 2 * im, hidden, 0, stage,
                 {im, im});
        b.Matrix(p + "mlp.linear_fc2.weight", hidden, im, 1, stage);
      }
    } else {
      // Hugging Face registration order: self_attn, mlp, then the norms.
      const std::string p = absl::StrCat("model.layers.", l, ".");
      b.Matrix(p + "self_attn.q_proj.weight", heads * hd, hidden, 0, stage);
      b.Matrix(p + "self_attn.k_proj.weight", kv * hd, hidden, 0, stage);
      b.Matrix(p + "self_attn.v_proj.weight", kv * hd, hidden, 0, stage);
      b.Matrix(p + "self_attn.o_proj.weight", hidden, heads * hd, 1, stage);
      b.AdamW(p + "self_attn.q_norm.weight", {hd}, -1, stage);
      b.AdamW(p + "self_attn.k_norm.weight", {hd}, -1, stage);
      if (config.is_moe()) {
        const int64_t im = config.moe_intermediate_size;
        b.AdamW(p + "mlp.gate.weight", {config.num_experts, hidden}, -1, stage);
        for (int64_t e = 0; e < config.num_experts; ++e) {
          const std::string ep = absl::StrCat(p, "mlp.experts.", e, ".");
          b.Matrix(ep + "gate_proj.weight", im, hidden, 0, stage);
          b.Matrix(ep + "up_proj.weight", im, hidden, 0, stage);
          b.Matrix(ep + "down_proj.weight", hidden, im, 1, stage);
        }
      } else {
        const int64_t im = config.intermediate_size;
        b.Matrix(p + "mlp.gate_proj.weight", im, hidden, 0, stage);
        b.Matrix(p + "mlp.up_proj.weight", im, hidden, 0, stage);
        b.Matrix(p + "mlp.down_proj.weight", hidden, im, 1, stage);
      }
      b.AdamW(p + "input_layernorm.weight", {hidden}, -1, stage);
      b.AdamW(p + "post_attention_layernorm.weight", {hidden}, -1, stage);
    }
  }
  if (mega) {
    b.AdamW("decoder.final_layernorm.weight", {hidden}, -1, last_stage);
    if (!config.tie_word_embeddings) {
      b.AdamW("output_layer.weight", {vocab, hidden}, 0, last_stage);
    }
  } else {
    b.AdamW("model.norm.weight", {hidden}, -1, last_stage);
    if (!config.tie_word_embeddings) {
      b.AdamW("lm_head.weight", {vocab, hidden}, 0, last_stage);
    }
  }
  return b.Take();
}

}  // namespace canzona::plan
