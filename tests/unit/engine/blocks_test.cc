// Fused matrices with blocks (Parameter.blocks): a Megatron layout (fused
// linear_qkv per query group, linear_fc1 [gate; up]) with blocks trains
// bitwise like the Hugging Face layout (separate q, k, v, gate, up) of the
// same model, for Muon, Shampoo and SOAP, at DP1 x TP1, DP2 x TP2 and
// DP1 x TP4; without blocks it does not. Per-head blocks equal per-head
// parameters. Bad block specs are refused before anything registers.
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kSteps = 4;
// The per-head model: 8 heads of 8 over hidden 64.
constexpr int64_t kHidden = 64, kHeadDim = 8, kHeads = 8;
// hidden 64; 8 query heads and 4 query groups (kv heads) of 8; ffn 64.
absl::StatusOr<Params> Train(Cluster& cluster, const std::string& stem, int dp,
                             int tp, std::vector<ModelParam> params) {
  JobConfig config = MakeJobConfig(stem, dp, tp, "cost", std::move(params));
  JobRun run(config);
  if (absl::Status s = run.Init(); !s.ok()) return s;
  if (absl::Status s = run.RunAll(cluster, kSteps); !s.ok()) return s;
  Params out = run.GatherParams();
  if (absl::Status s = run.Deregister(cluster); !s.ok()) return s;
  return out;
}

// The first parameter of `a` that differs bitwise from `b` ("" if none).
std::string FirstDifference(const Params& a, const Params& b) {
  for (const auto& [name, values] : a) {
    auto it = b.find(name);
    if (it == b.end()) return name + " (missing)";
    if (values != it->second) return name;
  }
  return "";
}

class FusedEqualsSeparateTest
    : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(FusedEqualsSeparateTest, BitwiseAfterUnfusing) {
  const auto& [optimizer, dp, tp] = GetParam();
  Cluster cluster;
  const FusedLayouts layouts = FusedAndSeparate(optimizer);
  ASSERT_OK_AND_ASSIGN(Params hf, Train(cluster, "hf", dp, tp, layouts.hf));
  ASSERT_OK_AND_ASSIGN(Params fused,
                       Train(cluster, "mg", dp, tp, layouts.megatron));
  const Params unfused = Unfuse(layouts.megatron, fused);
  EXPECT_EQ(unfused.size(), hf.size());
  EXPECT_EQ(FirstDifference(hf, unfused), "");
  // Training moved them: the comparison is not of initial values.
  Params start;
  const JobConfig initial = MakeJobConfig("init", dp, tp, "cost", layouts.hf);
  for (const ModelParam& m : layouts.hf) {
    start[m.name] = InitialParam(initial, m);
  }
  EXPECT_NE(FirstDifference(hf, start), "");
}

INSTANTIATE_TEST_SUITE_P(
    Rules, FusedEqualsSeparateTest,
    ::testing::Combine(::testing::Values("muon", "shampoo", "soap"),
                       ::testing::Values(1), ::testing::Values(1)),
    [](const auto& info) { return std::get<0>(info.param) + "_dp1_tp1"; });
INSTANTIATE_TEST_SUITE_P(Layouts, FusedEqualsSeparateTest,
                         ::testing::Values(std::make_tuple("muon", 2, 2),
                                           std::make_tuple("shampoo", 2, 2),
                                           std::make_tuple("soap", 2, 2),
                                           std::make_tuple("muon", 1, 4),
                                           std::make_tuple("shampoo", 1, 4),
                                           std::make_tuple("soap", 1, 4)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "_dp",
                                               std::get<1>(info.param), "_tp",
                                               std::get<2>(info.param));
                         });

TEST(BlocksTest, FusedWithoutBlocksIsADifferentOptimizer) {
  Cluster cluster;
  const FusedLayouts layouts = FusedAndSeparate("muon", /*blocks=*/false);
  ASSERT_OK_AND_ASSIGN(Params hf, Train(cluster, "hf", 1, 2, layouts.hf));
  ASSERT_OK_AND_ASSIGN(Params fused,
                       Train(cluster, "mg", 1, 2, layouts.megatron));
  const Params unfused = Unfuse(layouts.megatron, fused);
  const std::string differs = FirstDifference(hf, unfused);
  EXPECT_THAT(differs, AllOf(HasSubstr("layers.0."), HasSubstr("_proj")));
}

TEST(BlocksTest, PerHeadBlocksEqualPerHeadParameters) {
  Cluster cluster;
  for (int tp : {1, 2}) {
    std::vector<ModelParam> heads, blocked;
    const std::string q = "q_proj.weight";
    ModelParam fused{q, {kHeads * kHeadDim, kHidden}, 0, "muon"};
    fused.blocks = {.dim = 0, .sizes = {kHeadDim}, .repeat = kHeads};
    for (int64_t h = 0; h < kHeads; ++h) {
      const std::string name = absl::StrCat("q_head", h, ".weight");
      heads.push_back({name, {kHeadDim, kHidden}, 0, "muon"});
      fused.fused.push_back({name, {kHeadDim, kHidden}, 0, kHeadDim});
    }
    blocked.push_back(fused);
    ASSERT_OK_AND_ASSIGN(Params separate,
                         Train(cluster, "heads", 1, tp, heads));
    ASSERT_OK_AND_ASSIGN(Params together,
                         Train(cluster, "blocks", 1, tp, blocked));
    EXPECT_EQ(FirstDifference(separate, Unfuse(blocked, together)), "")
        << "tp " << tp;
  }
}

TEST(BlocksTest, BadBlocksAreRefusedBeforeAnythingRegisters) {
  Cluster cluster;
  struct Case {
    std::string what;
    int tp;
    std::function<void(ModelParam&)> mutate;
    std::string field;
  };
  const std::vector<Case> cases = {
      {"sum", 1,
       [](ModelParam& p) {
         p.blocks.sizes = {16, 8, 7};
       },
       "parameters[2] 'layers.0.self_attention.linear_qkv.weight'.blocks."
       "sizes: [16, 8, 7] x repeat 4 covers 124 of dimension 0 (128)"},
      {"query group cut", 8, [](ModelParam& p) {},
       "'layers.0.self_attention.linear_qkv.weight'.blocks.repeat: 4 "
       "repeats (query groups) cannot be divided among tp = 8"},
      {"adamw", 1, [](ModelParam& p) { p.group = "adamw"; },
       "'layers.0.self_attention.linear_qkv.weight'.blocks: group 'adamw' "
       "uses adamw"},
      {"names", 1, [](ModelParam& p) { p.blocks.names.pop_back(); },
       ".blocks.names: 2 names for 3 blocks"},
      {"name taken", 1,
       [](ModelParam& p) { p.blocks.names[0] = "embedding.weight"; },
       ".blocks.names: 'embedding.weight' is already the name of a "
       "parameter or block"},
  };
  for (const Case& c : cases) {
    std::vector<ModelParam> params = FusedAndSeparate("muon").megatron;
    ASSERT_EQ(params[2].name, "layers.0.self_attention.linear_qkv.weight");
    c.mutate(params[2]);
    JobConfig config = MakeJobConfig("bad", 1, c.tp, "cost", params);
    TrainerRank rank(config, 0);
    ASSERT_OK(rank.Init());
    Result<v1::RegisterResponse> registered;
    cluster.engines[0]->Register(rank.MakeRegister(), PeerInfo{},
                                 registered.callback());
    EXPECT_THAT(registered.Get(), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr(c.field)))
        << c.what;
    // Nothing registered: the daemon knows no job.
    EXPECT_EQ(cluster.engines[0]->GetStatus().jobs_size(), 0) << c.what;
  }
}

}  // namespace
}  // namespace canzona::engine_test
