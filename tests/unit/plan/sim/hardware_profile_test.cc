#include "server/plan/sim/hardware_profile.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona::plan::sim {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

nlohmann::json Good() {
  return nlohmann::json::parse(R"({
    "name": "test", "comm": "nccl", "ranks_per_node": 8,
    "compute_units_per_node": 8, "collective_launch_us": 10,
    "memory_gbps": 2000,
    "intra_node": {"latency_us": 2, "bandwidth_gbps": 300},
    "inter_node": {"latency_us": 8, "bandwidth_gbps": 40,
                   "aggregate_gbps": 300},
    "rates": {"gemm_gflops": 1, "ns_gflops": 2, "eigh_gflops": 3,
              "adamw_gbps": 4},
    "sources": ["a datasheet"]})");
}

TEST(HardwareProfileTest, ParsesEveryField) {
  auto p = ParseHardwareProfile(Good());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->name, "test");
  EXPECT_EQ(p->comm, CommPlane::kNccl);
  EXPECT_EQ(p->ranks_per_node, 8);
  EXPECT_DOUBLE_EQ(p->inter_node.bandwidth_gbps, 40);
  EXPECT_DOUBLE_EQ(p->inter_node.aggregate_gbps, 300);
  EXPECT_DOUBLE_EQ(p->intra_node.aggregate_gbps, 0);
  EXPECT_DOUBLE_EQ(p->rates.ns_gflops, 2);
  EXPECT_EQ(p->notes["sources"][0], "a datasheet");
  // Round trip.
  auto again = ParseHardwareProfile(HardwareProfileToJson(*p));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_DOUBLE_EQ(again->inter_node.aggregate_gbps, 300);
}

TEST(HardwareProfileTest, MissingFieldIsNamed) {
  nlohmann::json j = Good();
  j["intra_node"].erase("bandwidth_gbps");
  EXPECT_THAT(ParseHardwareProfile(j).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("intra_node.bandwidth_gbps is missing")));
  j = Good();
  j.erase("memory_gbps");
  EXPECT_THAT(ParseHardwareProfile(j).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("memory_gbps is missing")));
}

TEST(HardwareProfileTest, NonPositiveNumbersAreNamed) {
  nlohmann::json j = Good();
  j["rates"]["ns_gflops"] = 0;
  EXPECT_THAT(ParseHardwareProfile(j).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'ns_gflops' must be positive")));
  j = Good();
  j["inter_node"]["latency_us"] = -1;
  EXPECT_THAT(ParseHardwareProfile(j).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("inter_node.latency_us must be positive")));
  j = Good();
  j["intra_node"]["pair_gbps"] = 0;
  EXPECT_THAT(ParseHardwareProfile(j).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("intra_node.pair_gbps must be positive")));
  j = Good();
  j["compute_units_per_node"] = 0;
  EXPECT_THAT(ParseHardwareProfile(j).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("compute_units_per_node")));
  j = Good();
  j["comm"] = "mpi";
  EXPECT_THAT(ParseHardwareProfile(j).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("comm")));
}

TEST(HardwareProfileTest, OneNodeNeedsNoInterNodeTier) {
  nlohmann::json j = Good();
  j["ranks_per_node"] = 0;
  j.erase("inter_node");
  auto p = ParseHardwareProfile(j);
  ASSERT_TRUE(p.ok()) << p.status();
  // With several nodes it is required.
  j["ranks_per_node"] = 4;
  EXPECT_THAT(ParseHardwareProfile(j).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("inter_node is missing")));
}

TEST(HardwareProfileTest, ShippedProfilesParse) {
  for (const char* name : {"h100-node", "h200-node"}) {
    auto p = LoadHardwareProfile(CANZONA_PROFILES_SOURCE_DIR, name);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->name, name);
    EXPECT_EQ(p->ranks_per_node, 8);
    EXPECT_TRUE(p->notes.contains("sources"));
    EXPECT_TRUE(p->notes.contains("assumptions"));
  }
  // H200: the same compute, faster memory.
  auto h100 = LoadHardwareProfile(CANZONA_PROFILES_SOURCE_DIR, "h100-node");
  auto h200 = LoadHardwareProfile(CANZONA_PROFILES_SOURCE_DIR, "h200-node");
  ASSERT_TRUE(h100.ok() && h200.ok());
  EXPECT_DOUBLE_EQ(h100->rates.ns_gflops, h200->rates.ns_gflops);
  EXPECT_GT(h200->memory_gbps, h100->memory_gbps);
}

TEST(HardwareProfileTest, UnknownProfileIsNotFound) {
  EXPECT_THAT(
      LoadHardwareProfile(CANZONA_PROFILES_SOURCE_DIR, "no-such").status(),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("no-such")));
}

}  // namespace
}  // namespace canzona::plan::sim
