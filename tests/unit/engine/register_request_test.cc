// ValidateRegisterRequest alone: what a valid request yields, and a status
// naming the field for each kind of bad input.
#include "server/engine/register_request.h"

#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/parts_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

v1::RegisterRequest Request(int global = 3) {
  absl::StatusOr<v1::RegisterRequest> request =
      RequestOf(MakeJobConfig("req", /*dp=*/2, /*tp=*/2, "cost"), global);
  EXPECT_OK(request.status());
  return request.ok() ? *request : v1::RegisterRequest();
}

TEST(RegisterRequestTest, ValidRequestYieldsTheRankAndItsStage) {
  const v1::RegisterRequest request = Request(/*global=*/3);
  ASSERT_OK_AND_ASSIGN(RankSpec spec,
                       ValidateRegisterRequest(request, RegisterLimits{}));
  EXPECT_EQ(spec.global, 3);
  EXPECT_EQ(spec.coords.dp_rank(), 1);
  EXPECT_EQ(spec.coords.tp_rank(), 1);
  EXPECT_EQ(spec.settings.world, 4);
  EXPECT_EQ(spec.settings.strategy_name, "cost");
  EXPECT_EQ(spec.settings.configs.size(), 4u);
  EXPECT_THAT(spec.settings.meta, HasSubstr("layout=1,2,2\nstrategy=cost"));
  EXPECT_THAT(spec.settings.meta, HasSubstr("\ngroup muon muon "));
  const std::vector<std::string> lines = absl::StrSplit(spec.plist, '\n');
  ASSERT_EQ(lines.size(), static_cast<size_t>(request.parameters_size()));
  ASSERT_EQ(spec.fragment_numel.size(), lines.size());
  for (int j = 0; j < request.parameters_size(); ++j) {
    const v1::Parameter& p = request.parameters(j);
    int64_t numel = 1;
    for (int64_t d : p.shape()) numel *= d;
    EXPECT_EQ(spec.fragment_numel[j], p.tp_split_dim() >= 0 ? numel / 2 : numel)
        << p.name();
    EXPECT_EQ(lines[j].substr(0, lines[j].find('|')), p.name());
  }
}

struct BadCase {
  std::string name;
  std::function<void(v1::RegisterRequest&)> mutate;
  absl::StatusCode code;
  std::string field;
};

TEST(RegisterRequestTest, BadInputNamesTheField) {
  using absl::StatusCode;
  const std::vector<BadCase> cases = {
      {"job_id", [](auto& r) { r.set_job_id("no spaces"); },
       StatusCode::kInvalidArgument, "job_id"},
      {"dp", [](auto& r) { r.mutable_layout()->set_dp(0); },
       StatusCode::kInvalidArgument, "layout.dp"},
      {"tp_rank", [](auto& r) { r.mutable_rank()->set_tp_rank(2); },
       StatusCode::kInvalidArgument, "rank.tp_rank"},
      {"strategy", [](auto& r) { r.set_strategy("best"); },
       StatusCode::kInvalidArgument, "strategy"},
      {"alpha", [](auto& r) { r.set_alpha(2); }, StatusCode::kInvalidArgument,
       "alpha"},
      {"bucket", [](auto& r) { r.set_bucket_size(-1); },
       StatusCode::kInvalidArgument, "bucket_size"},
      {"shard", [](auto& r) { r.set_shard_group_size(3); },
       StatusCode::kInvalidArgument, "shard_group_size"},
      {"no groups", [](auto& r) { r.clear_groups(); },
       StatusCode::kInvalidArgument, "groups"},
      {"dup group", [](auto& r) { *r.add_groups() = r.groups(0); },
       StatusCode::kInvalidArgument, "duplicate name"},
      {"optimizer", [](auto& r) { r.mutable_groups(0)->set_optimizer("sgd"); },
       StatusCode::kInvalidArgument, "groups[0] 'muon'.optimizer"},
      {"no params", [](auto& r) { r.clear_parameters(); },
       StatusCode::kInvalidArgument, "parameters: empty"},
      {"dtype",
       [](auto& r) {
         r.mutable_parameters(1)->set_dtype(v1::DTYPE_UNSPECIFIED);
       },
       StatusCode::kInvalidArgument, "parameters[1]"},
      {"shape", [](auto& r) { r.mutable_parameters(2)->set_shape(0, 0); },
       StatusCode::kInvalidArgument, "parameters[2]"},
      {"split", [](auto& r) { r.mutable_parameters(2)->set_tp_split_dim(2); },
       StatusCode::kInvalidArgument, ".tp_split_dim"},
      {"split divides",
       [](auto& r) { r.mutable_parameters(2)->set_shape(0, 127); },
       StatusCode::kInvalidArgument, "does not divide"},
      {"group", [](auto& r) { r.mutable_parameters(0)->set_group("nope"); },
       StatusCode::kInvalidArgument, ".group: unknown group 'nope'"},
      {"matrix", [](auto& r) { r.mutable_parameters(1)->set_group("muon"); },
       StatusCode::kInvalidArgument, "muon needs a matrix (2-D, 3-D stacked"},
      {"3-D split over TP",
       [](auto& r) {
         v1::Parameter* p = r.mutable_parameters(2);
         p->mutable_shape()->Set(1, 32);
         p->add_shape(2);
       },
       StatusCode::kInvalidArgument,
       ".tp_split_dim: 0, but a 3-D parameter's matrices (stacked experts) "
       "are not split"},
      {"6-D in a matrix group",
       [](auto& r) {
         v1::Parameter* p = r.mutable_parameters(2);
         p->mutable_shape()->Set(1, 1);
         for (int64_t d : {2, 2, 2, 8}) p->add_shape(d);
       },
       StatusCode::kInvalidArgument, "got a 6-D shape (use adamw)"},
      {"blocks of a 4-D",
       [](auto& r) {
         v1::Parameter* p = r.mutable_parameters(2);
         p->mutable_blocks()->set_dim(0);
         p->mutable_blocks()->add_sizes(64);
         p->mutable_shape()->Set(1, 16);
         p->add_shape(2);
         p->add_shape(2);
       },
       StatusCode::kInvalidArgument,
       "parameters[2] "
       "'decoder.layers.0.self_attention.linear_qkv.weight'.blocks: a 4-D "
       "parameter"},
      {"dup param",
       [](auto& r) {
         r.mutable_parameters(3)->set_name(r.parameters(1).name());
       },
       StatusCode::kInvalidArgument, "parameters[3]"},
  };
  for (const BadCase& c : cases) {
    v1::RegisterRequest request = Request();
    c.mutate(request);
    EXPECT_THAT(ValidateRegisterRequest(request, RegisterLimits{}),
                StatusIs(c.code, HasSubstr(c.field)))
        << c.name;
  }
}

// A matrix optimizer steps an N-D parameter (a convolution's filters) as the
// matrix (shape[0], product of the rest): that is the shape the plan gets.
// An element-wise one keeps its shape.
TEST(RegisterRequestTest, FiltersInAMatrixGroupRegisterAsTheirMatrix) {
  v1::RegisterRequest request = Request();
  v1::Parameter* filters = request.mutable_parameters(2);  // muon, split 0
  ASSERT_EQ(request.parameters(2).group(), "muon");
  filters->clear_shape();
  for (int64_t d : {128, 16, 2, 2}) filters->add_shape(d);
  v1::Parameter* embedding = request.mutable_parameters(0);  // adamw
  ASSERT_EQ(request.parameters(0).group(), "adamw");
  embedding->clear_shape();
  for (int64_t d : {128, 16, 2, 2}) embedding->add_shape(d);
  ASSERT_OK_AND_ASSIGN(RankSpec spec,
                       ValidateRegisterRequest(request, RegisterLimits{}));
  const std::vector<std::string> lines = absl::StrSplit(spec.plist, '\n');
  EXPECT_EQ(lines[2], absl::StrCat(filters->name(), "|128,64|0|muon"));
  EXPECT_EQ(lines[0], absl::StrCat(embedding->name(), "|128,16,2,2|0|adamw"));
  EXPECT_EQ(spec.fragment_numel[2], 128 * 64 / 2);
  // Stacked experts (E, rows, cols): the E blocks (rows, cols) of the
  // matrix (E * rows, cols).
  filters->clear_shape();
  for (int64_t d : {4, 32, 64}) filters->add_shape(d);
  filters->set_tp_split_dim(-1);
  ASSERT_OK_AND_ASSIGN(spec,
                       ValidateRegisterRequest(request, RegisterLimits{}));
  const std::vector<std::string> stacked = absl::StrSplit(spec.plist, '\n');
  EXPECT_EQ(
      stacked[2],
      absl::StrCat(filters->name(), "|128,64|-1|muon|blocks=d=0;s=32;r=4;m=0"));
  filters->clear_shape();
  for (int64_t d : {128, 16, 2, 2}) filters->add_shape(d);
  filters->set_tp_split_dim(0);
  // Split along dimension 1 of (out, in, kh, kw): in must divide by tp.
  filters->set_tp_split_dim(1);
  filters->set_shape(1, 15);
  EXPECT_THAT(ValidateRegisterRequest(request, RegisterLimits{}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tp 2 does not divide dimension 1 (15)")));
}

TEST(RegisterRequestTest, LimitsAndTokens) {
  RegisterLimits limits;
  limits.required_token = "other";
  EXPECT_THAT(ValidateRegisterRequest(Request(), limits),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("token")));
  limits.required_token = "secret";
  EXPECT_OK(ValidateRegisterRequest(Request(), limits));
  limits.max_parameters = 3;
  EXPECT_THAT(
      ValidateRegisterRequest(Request(), limits),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit of 3")));
}

TEST(RegisterRequestTest, RankPlacement) {
  v1::WorldLayout layout;
  layout.set_pp(2);
  layout.set_dp(3);
  layout.set_tp(4);
  v1::RankCoordinates r;
  r.set_pp_rank(1);
  r.set_dp_rank(2);
  r.set_tp_rank(3);
  EXPECT_EQ(GlobalRank(layout, r), (1 * 3 + 2) * 4 + 3);
  EXPECT_OK(CheckRankInLayout(layout, r));
  r.set_dp_rank(3);
  EXPECT_THAT(
      CheckRankInLayout(layout, r),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("rank (pp 1, dp 3, tp 3) outside the layout")));
  EXPECT_TRUE(ValidJobId("job_1-a"));
  EXPECT_FALSE(ValidJobId(""));
  EXPECT_FALSE(ValidJobId(std::string(65, 'a')));
  EXPECT_FALSE(ValidJobId("a/b"));
}

}  // namespace
}  // namespace canzona::engine_test
