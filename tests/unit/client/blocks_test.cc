// The client's block helpers give the specs the daemon lays out as
// Megatron's q, k, v / gate, up / per-head blocks.
#include "client/lib/blocks.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/optim/matrix_blocks.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

BlockSpec SpecOf(const v1::Blocks& b) {
  BlockSpec spec;
  spec.dim = b.dim();
  spec.sizes.assign(b.sizes().begin(), b.sizes().end());
  spec.repeat = b.repeat();
  spec.merge_repeats = b.merge_repeats();
  spec.names.assign(b.names().begin(), b.names().end());
  return spec;
}

std::vector<std::vector<int64_t>> Shapes(const std::vector<MatrixBlock>& bs) {
  std::vector<std::vector<int64_t>> out;
  for (const MatrixBlock& b : bs) out.push_back(b.shape);
  return out;
}

TEST(ClientBlocksTest, QkvIsQKAndVOfEveryGroup) {
  // 32 heads, 8 query groups of 128: q 4096 rows, k and v 1024 each.
  ASSERT_OK_AND_ASSIGN(v1::Blocks qkv,
                       MegatronQkvBlocks(32, 8, 128, {"q", "k", "v"}));
  ASSERT_OK_AND_ASSIGN(std::vector<MatrixBlock> blocks,
                       LayOutBlocks(SpecOf(qkv), {6144, 4096}, "qkv"));
  EXPECT_THAT(Shapes(blocks),
              ElementsAre(ElementsAre(4096, 4096), ElementsAre(1024, 4096),
                          ElementsAre(1024, 4096)));
  EXPECT_EQ(blocks[1].name, "k");
  // k of group 1 starts after group 0's q (512 rows), k and v.
  EXPECT_EQ(blocks[1].segments[1].start, 768 + 512);
  ASSERT_OK_AND_ASSIGN(v1::Blocks per_group,
                       MegatronQkvBlocks(32, 8, 128, {}, /*per_group=*/true));
  ASSERT_OK_AND_ASSIGN(blocks,
                       LayOutBlocks(SpecOf(per_group), {6144, 4096}, "qkv"));
  EXPECT_EQ(blocks.size(), 24u);
  EXPECT_EQ(blocks[3].name, "qkv/3");
}

TEST(ClientBlocksTest, Fc1AndHeads) {
  ASSERT_OK_AND_ASSIGN(v1::Blocks fc1, MegatronFc1Blocks(11008));
  ASSERT_OK_AND_ASSIGN(std::vector<MatrixBlock> blocks,
                       LayOutBlocks(SpecOf(fc1), {22016, 4096}, "fc1"));
  EXPECT_THAT(Shapes(blocks),
              ElementsAre(ElementsAre(11008, 4096), ElementsAre(11008, 4096)));
  // TP 4: rank 1 holds the second quarter of gate, then of up.
  ASSERT_OK_AND_ASSIGN(std::vector<Segment> runs,
                       FragmentSegments(SpecOf(fc1), {22016, 4096}, 0, 4, 1));
  EXPECT_THAT(runs,
              ElementsAre(Segment{2752, 2752}, Segment{11008 + 2752, 2752}));
  ASSERT_OK_AND_ASSIGN(v1::Blocks heads, HeadBlocks(32, 128, /*dim=*/1));
  ASSERT_OK_AND_ASSIGN(blocks, LayOutBlocks(SpecOf(heads), {4096, 4096}, "o"));
  EXPECT_EQ(blocks.size(), 32u);
  EXPECT_THAT(blocks[0].shape, ElementsAre(4096, 128));
}

TEST(ClientBlocksTest, BadArgumentsNameTheProblem) {
  EXPECT_THAT(MegatronQkvBlocks(32, 5, 128),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("num_query_groups 5 does not divide")));
  EXPECT_THAT(MegatronFc1Blocks(64, {"gate"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("1 names for 2 blocks")));
  EXPECT_THAT(HeadBlocks(0, 128), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("num_heads 0")));
}

}  // namespace
}  // namespace canzona
