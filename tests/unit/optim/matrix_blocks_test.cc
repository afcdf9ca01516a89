// Block layouts of fused matrices (matrix_blocks.h): where each block's
// rows or columns lie, Megatron's TP shards, the canonical text, and bad
// specs (including ones sized to overflow) refused naming the field.
#include "server/optim/matrix_blocks.h"

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/optim/update_rule.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(MatrixBlocksTest, MergedRepeatsStackEveryGroupsPiece) {
  // qkv of 2 query groups: [q 4, k 2, v 2] x 2 over 16 rows.
  const BlockSpec spec{.sizes = {4, 2, 2}, .repeat = 2, .merge_repeats = true};
  ASSERT_OK_AND_ASSIGN(std::vector<MatrixBlock> blocks,
                       LayOutBlocks(spec, {16, 3}, "qkv"));
  ASSERT_EQ(blocks.size(), 3u);
  EXPECT_THAT(blocks[0].shape, ElementsAre(8, 3));
  EXPECT_THAT(blocks[0].segments, ElementsAre(Segment{0, 4}, Segment{8, 4}));
  EXPECT_THAT(blocks[2].segments, ElementsAre(Segment{6, 2}, Segment{14, 2}));
  EXPECT_EQ(blocks[1].name, "qkv/1");
  // Without merging: six blocks in row order.
  BlockSpec per_group = spec;
  per_group.merge_repeats = false;
  ASSERT_OK_AND_ASSIGN(blocks, LayOutBlocks(per_group, {16, 3}, "qkv"));
  ASSERT_EQ(blocks.size(), 6u);
  EXPECT_THAT(blocks[4].segments, ElementsAre(Segment{12, 2}));
  // Columns (per head of an output projection).
  const BlockSpec heads{.dim = 1, .sizes = {3}, .repeat = 4};
  ASSERT_OK_AND_ASSIGN(blocks, LayOutBlocks(heads, {5, 12}, "o"));
  EXPECT_THAT(blocks[3].shape, ElementsAre(5, 3));
  EXPECT_THAT(blocks[3].segments, ElementsAre(Segment{9, 3}));
}

TEST(MatrixBlocksTest, TpShardsAreMegatrons) {
  // Repeating pattern: whole query groups per rank.
  const BlockSpec qkv{.sizes = {4, 2, 2}, .repeat = 4, .merge_repeats = true};
  ASSERT_OK_AND_ASSIGN(std::vector<Segment> s,
                       FragmentSegments(qkv, {32, 3}, 0, 2, 1));
  EXPECT_THAT(s, ElementsAre(Segment{16, 16}));
  EXPECT_THAT(FragmentSegments(qkv, {32, 3}, 0, 8, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks.repeat: 4 repeats (query groups) "
                                 "cannot be divided among tp = 8")));
  // fc1: [gate_t; up_t].
  const BlockSpec fc1{.sizes = {6, 6}};
  ASSERT_OK_AND_ASSIGN(s, FragmentSegments(fc1, {12, 3}, 0, 3, 2));
  EXPECT_THAT(s, ElementsAre(Segment{4, 2}, Segment{10, 2}));
  EXPECT_THAT(FragmentSegments(fc1, {12, 3}, 0, 4, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("block of 6 is not divisible by tp = 4")));
  // TP on the other dimension: a plain contiguous split.
  ASSERT_OK_AND_ASSIGN(s, FragmentSegments(fc1, {12, 4}, 1, 2, 1));
  EXPECT_THAT(s, ElementsAre(Segment{2, 2}));
}

TEST(MatrixBlocksTest, CanonicalTextRoundTrips) {
  const BlockSpec spec{.dim = 0,
                       .sizes = {16, 8, 8},
                       .repeat = 4,
                       .merge_repeats = true,
                       .names = {"q", "k", "v"}};
  const std::string text = EncodeBlockSpec(spec);
  EXPECT_EQ(text, "d=0;s=16,8,8;r=4;m=1;n=q,k,v");
  ASSERT_OK_AND_ASSIGN(BlockSpec back, ParseBlockSpec(text));
  EXPECT_EQ(back, spec);
  EXPECT_EQ(EncodeBlockSpec(BlockSpec{}), "");
  EXPECT_THAT(ParseBlockSpec("d=0;x=1"),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(MatrixBlocksTest, BadSpecsNameTheField) {
  struct Case {
    BlockSpec spec;
    std::vector<int64_t> shape;
    std::string message;
  };
  constexpr int64_t kHuge = int64_t{1} << 40;
  const std::vector<Case> cases = {
      {{.sizes = {4, 4}}, {9, 2}, "blocks.sizes: [4, 4] x repeat 1 covers 8"},
      {{.sizes = {0}}, {4, 2}, "blocks.sizes: size 0 outside [1, 4]"},
      {{.sizes = {}}, {4, 2}, "blocks.sizes: empty"},
      {{.dim = 2, .sizes = {4}}, {4, 2}, "blocks.dim: 2 must be 0 or 1"},
      {{.sizes = {2}, .repeat = 0}, {4, 2}, "blocks.repeat: 0 outside"},
      {{.sizes = {4}}, {4}, "blocks: the parameter is 1-D"},
      {{.sizes = {2}, .repeat = 2, .names = {"a"}},
       {4, 2},
       "blocks.names: 1 names for 2 blocks"},
      {{.sizes = {2}, .repeat = 2, .names = {"a", "a"}},
       {4, 2},
       "blocks.names: duplicate 'a'"},
      {{.sizes = {2}, .repeat = 2, .names = {"a", "b|c"}},
       {4, 2},
       "must be non-empty without '|'"},
      // Sized to overflow or to lay out billions of blocks.
      {{.sizes = {1}, .repeat = kHuge}, {kHuge, 2}, "make more than 65536"},
      {{.sizes = {kHuge / 2},
        .repeat = int64_t{1} << 30,
        .merge_repeats = true},
       {kHuge, 2},
       "covers more than the dimension"},
      {{.sizes = {kHuge, kHuge}}, {kHuge, 2}, "covers more than the dimension"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(
        LayOutBlocks(c.spec, c.shape, "w"),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.message;
  }
}

// A blocked rule steps each block as a separate rule of the block's shape
// would (bitwise, on fresh random data), and its state splits into theirs.
TEST(BlockedRuleTest, EqualsOneRulePerBlock) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu, CreateCpuBackend());
  for (const char* kind : {"muon", "shampoo", "soap"}) {
    SCOPED_TRACE(kind);
    ASSERT_OK_AND_ASSIGN(OptimizerKind k, ParseOptimizerKind(kind));
    ASSERT_OK_AND_ASSIGN(OptimizerConfig config, MakeOptimizerConfig(k, {}));
    // [q 4, k 2, v 2] x 2 groups over 16 rows, merged: q is 8 x 6 rows
    // from two places, k and v 4 x 6 (batched together under Muon).
    const BlockSpec spec{
        .sizes = {4, 2, 2}, .repeat = 2, .merge_repeats = true};
    ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<UpdateRule> blocked,
        UpdateRule::CreateBlocked(config, {16, 6}, spec, "qkv", cpu.get()));
    ASSERT_OK_AND_ASSIGN(std::vector<MatrixBlock> blocks,
                         LayOutBlocks(spec, {16, 6}, "qkv"));
    std::vector<std::unique_ptr<UpdateRule>> alone;
    for (const MatrixBlock& b : blocks) {
      ASSERT_OK_AND_ASSIGN(alone.emplace_back(),
                           UpdateRule::Create(config, b.shape, cpu.get()));
    }
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 0.1f);
    std::vector<float> param(96), grad(96);
    for (float& x : param) x = normal(rng);
    // The blocks' own rows, in block order.
    const auto cut = [&](const std::vector<float>& whole, size_t k) {
      std::vector<float> out;
      for (const Segment& s : blocks[k].segments) {
        out.insert(out.end(), whole.begin() + s.start * 6,
                   whole.begin() + (s.start + s.length) * 6);
      }
      return out;
    };
    std::vector<std::vector<float>> parts;
    for (size_t k = 0; k < blocks.size(); ++k) parts.push_back(cut(param, k));
    for (int step = 0; step < 3; ++step) {
      for (float& x : grad) x = normal(rng);
      ASSERT_OK(blocked->Step(param.data(), grad.data()));
      for (size_t k = 0; k < blocks.size(); ++k) {
        std::vector<float> g = cut(grad, k);
        ASSERT_OK(alone[k]->Step(parts[k].data(), g.data()));
      }
    }
    for (size_t k = 0; k < blocks.size(); ++k) {
      EXPECT_EQ(cut(param, k), parts[k]) << "block " << k;
    }
    ASSERT_OK_AND_ASSIGN(OptimizerState state, blocked->SaveState());
    const std::vector<OptimizerState> split = SplitBlockStates(state, 3);
    for (size_t k = 0; k < blocks.size(); ++k) {
      ASSERT_OK_AND_ASSIGN(OptimizerState own, alone[k]->SaveState());
      EXPECT_TRUE(split[k] == own) << "block " << k;
    }
    EXPECT_TRUE(JoinBlockStates(k, split) == state);
    ASSERT_OK(blocked->LoadState(state));
    // A tensor of no block: refused, nothing changed.
    OptimizerState bad = state;
    bad.tensors.push_back({"block9/extra", {1}, {0.0f}});
    EXPECT_THAT(blocked->LoadState(bad),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("name no block")));
    ASSERT_OK_AND_ASSIGN(OptimizerState after, blocked->SaveState());
    EXPECT_TRUE(after == state);
  }
  ASSERT_OK_AND_ASSIGN(OptimizerConfig adamw,
                       MakeOptimizerConfig(OptimizerKind::kAdamW, {}));
  EXPECT_THAT(UpdateRule::CreateBlocked(adamw, {4, 2}, {.sizes = {2, 2}}, "w",
                                        cpu.get()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("blocks need a matrix optimizer")));
}

}  // namespace
}  // namespace canzona
