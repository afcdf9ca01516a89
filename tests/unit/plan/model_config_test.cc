#include "server/plan/model_config.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/plan/models_dir.h"

namespace canzona::plan {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

const ParamSpec* Find(const std::vector<ParamSpec>& params,
                      const std::string& name) {
  for (const auto& p : params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

TEST(ModelConfigTest, Qwen3_8bMegatronShapes) {
  ASSERT_OK_AND_ASSIGN(ModelConfig config,
                       LoadModelConfig(ModelsDir(), "qwen3-8b"));
  EXPECT_EQ(config.num_hidden_layers, 36);
  ASSERT_OK_AND_ASSIGN(auto params,
                       BuildModelParameters(config, ModelLayout::kMegatron,
                                            OptimizerKind::kMuon, {1, 8, 8}));
  EXPECT_EQ(params.size(), 1u + 36 * 8 + 2);
  EXPECT_EQ(params.front().name, "embedding.word_embeddings.weight");
  EXPECT_THAT(params.front().shape, ElementsAre(151936, 4096));
  EXPECT_EQ(params.front().optimizer, OptimizerKind::kAdamW);
  EXPECT_EQ(params.front().tp_split_dim, 0);
  const ParamSpec* qkv =
      Find(params, "decoder.layers.0.self_attention.linear_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_THAT(qkv->shape, ElementsAre((32 + 2 * 8) * 128, 4096));
  EXPECT_EQ(qkv->optimizer, OptimizerKind::kMuon);
  EXPECT_EQ(qkv->tp_split_dim, 0);
  const ParamSpec* fc1 =
      Find(params, "decoder.layers.35.mlp.linear_fc1.weight");
  ASSERT_NE(fc1, nullptr);
  EXPECT_THAT(fc1->shape, ElementsAre(2 * 12288, 4096));
  const ParamSpec* fc2 =
      Find(params, "decoder.layers.35.mlp.linear_fc2.weight");
  ASSERT_NE(fc2, nullptr);
  EXPECT_THAT(fc2->shape, ElementsAre(4096, 12288));
  EXPECT_EQ(fc2->tp_split_dim, 1);
  const ParamSpec* norm =
      Find(params, "decoder.layers.3.input_layernorm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->optimizer, OptimizerKind::kAdamW);
  EXPECT_EQ(norm->tp_split_dim, -1);
  EXPECT_EQ(params.back().name, "output_layer.weight");
}

TEST(ModelConfigTest, Qwen3_8bHfShapesAndStages) {
  ASSERT_OK_AND_ASSIGN(ModelConfig config,
                       LoadModelConfig(ModelsDir(), "qwen3-8b"));
  ASSERT_OK_AND_ASSIGN(auto params,
                       BuildModelParameters(config, ModelLayout::kHf,
                                            OptimizerKind::kSoap, {2, 4, 4}));
  EXPECT_EQ(params.size(), 1u + 36 * 11 + 2);
  const ParamSpec* k = Find(params, "model.layers.0.self_attn.k_proj.weight");
  ASSERT_NE(k, nullptr);
  EXPECT_THAT(k->shape, ElementsAre(8 * 128, 4096));
  const ParamSpec* up = Find(params, "model.layers.17.mlp.up_proj.weight");
  ASSERT_NE(up, nullptr);
  EXPECT_THAT(up->shape, ElementsAre(12288, 4096));
  EXPECT_EQ(up->pp_stage, 0);
  EXPECT_EQ(Find(params, "model.layers.18.mlp.up_proj.weight")->pp_stage, 1);
  EXPECT_EQ(Find(params, "model.embed_tokens.weight")->pp_stage, 0);
  EXPECT_EQ(Find(params, "lm_head.weight")->pp_stage, 1);
  EXPECT_EQ(Find(params, "model.norm.weight")->pp_stage, 1);
  EXPECT_EQ(Find(params, "model.layers.0.self_attn.q_norm.weight")->shape[0],
            128);
}

TEST(ModelConfigTest, MoeExpertsAreSeparateParameters) {
  ASSERT_OK_AND_ASSIGN(ModelConfig config,
                       LoadModelConfig(ModelsDir(), "qwen3-30b-a3b"));
  ASSERT_OK_AND_ASSIGN(auto params,
                       BuildModelParameters(config, ModelLayout::kMegatron,
                                            OptimizerKind::kMuon, {1, 8, 8}));
  const ParamSpec* router = Find(params, "decoder.layers.0.mlp.router.weight");
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->optimizer, OptimizerKind::kAdamW);
  const ParamSpec* e127 =
      Find(params,
           "decoder.layers.47.mlp.experts.local_experts.127.linear_fc1.weight");
  ASSERT_NE(e127, nullptr);
  EXPECT_THAT(e127->shape, ElementsAre(2 * 768, 2048));
  EXPECT_EQ(params.size(), 1u + 48 * (7 + 256) + 2);
}

TEST(ModelConfigTest, BadInputNamesTheField) {
  ASSERT_OK_AND_ASSIGN(ModelConfig config,
                       LoadModelConfig(ModelsDir(), "qwen3-8b"));
  EXPECT_THAT(BuildModelParameters(config, ModelLayout::kMegatron,
                                   OptimizerKind::kMuon, {1, 8, 3}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("attention heads")));
  EXPECT_THAT(
      BuildModelParameters(config, ModelLayout::kMegatron, OptimizerKind::kMuon,
                           {5, 8, 8}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layers")));
  EXPECT_THAT(BuildModelParameters(config, ModelLayout::kMegatron,
                                   OptimizerKind::kMuon, {1, 0, 8}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dp")));
  ASSERT_OK_AND_ASSIGN(ModelConfig odd, ParseModelConfig(nlohmann::json{
                                            {"num_hidden_layers", 2},
                                            {"hidden_size", 96},
                                            {"intermediate_size", 64},
                                            {"num_attention_heads", 12},
                                            {"num_key_value_heads", 3},
                                            {"vocab_size", 100}}));
  EXPECT_THAT(
      BuildModelParameters(odd, ModelLayout::kHf, OptimizerKind::kMuon,
                           {1, 2, 2}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv heads")));
  EXPECT_THAT(LoadModelConfig(ModelsDir(), "qwen9-1t"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("qwen9-1t")));
  EXPECT_THAT(
      ParseModelLayout("deepspeed"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layout")));
  EXPECT_THAT(ParseModelConfig(nlohmann::json{{"hidden_size", 0}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("num_hidden_layers")));
}

}  // namespace
}  // namespace canzona::plan
