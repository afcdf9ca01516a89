// AllocationRegistry: the three range rules at the edges of allocations,
// overlapping registrations, removal, and messages that name the method,
// the argument, the range and the allocation.
#include "kernels/allocation_registry.h"

#include <cstdint>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

class AllocationRegistryTest : public ::testing::Test {
 protected:
  // [memory + 16, memory + 32) and [memory + 48, memory + 64) registered.
  void SetUp() override {
    ASSERT_OK(registry_.Add(At(16), 16, "first"));
    ASSERT_OK(registry_.Add(At(48), 16, "second"));
  }
  const char* At(int offset) const { return memory_.data() + offset; }

  std::vector<char> memory_ = std::vector<char>(128);
  AllocationRegistry registry_;
};

TEST_F(AllocationRegistryTest, InsideAcceptsExactlyTheAllocation) {
  EXPECT_OK(registry_.CheckInside("Op", "x", At(16), 16));
  EXPECT_OK(registry_.CheckInside("Op", "x", At(20), 12));
  EXPECT_OK(registry_.CheckInside("Op", "x", At(0), 0));  // empty
  EXPECT_THAT(registry_.CheckInside("Op", "x", At(20), 13),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("Op: x [0x"),
                             HasSubstr("runs 1 bytes past the end"),
                             HasSubstr("+16 bytes) (first)"))));
  // Across two allocations, or in the gap between them.
  EXPECT_THAT(
      registry_.CheckInside("Op", "x", At(16), 48),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past the end")));
  EXPECT_THAT(registry_.CheckInside("Op", "x", At(32), 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lies in no live allocation")));
  EXPECT_THAT(registry_.CheckInside("Op", "x", At(15), 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lies in no live allocation")));
}

TEST_F(AllocationRegistryTest, OutsideRefusesAnyOverlap) {
  EXPECT_OK(registry_.CheckOutside("Op", "host", At(0), 16));
  EXPECT_OK(registry_.CheckOutside("Op", "host", At(32), 16));
  EXPECT_THAT(registry_.CheckOutside("Op", "host", At(31), 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must be memory outside the backend")));
  EXPECT_THAT(registry_.CheckOutside("Op", "host", At(40), 9),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("runs into the allocation"),
                             HasSubstr("(second)"))));
}

TEST_F(AllocationRegistryTest, ContainedTakesEitherButNeverStraddles) {
  EXPECT_OK(registry_.CheckContained("Op", "x", At(16), 16));
  EXPECT_OK(registry_.CheckContained("Op", "x", At(32), 16));
  EXPECT_OK(registry_.CheckContained("Op", "x", At(64), 64));
  EXPECT_THAT(
      registry_.CheckContained("Op", "x", At(24), 9),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past the end")));
  EXPECT_THAT(registry_.CheckContained("Op", "x", At(0), 17),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("runs into the allocation")));
}

TEST_F(AllocationRegistryTest, OverlapsAreRefusedAndRemovalForgets) {
  EXPECT_THAT(registry_.Add(At(24), 8, "inner"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("(inner)"), HasSubstr("overlaps"),
                             HasSubstr("(first)"))));
  EXPECT_THAT(
      registry_.Add(At(40), 16, "across"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlaps")));
  EXPECT_THAT(registry_.Add(At(0), 0, "empty"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_OK(registry_.Add(At(32), 16, "between"));  // touching both
  EXPECT_EQ(registry_.size(), 3);
  ASSERT_TRUE(registry_.Find(At(47)).has_value());
  EXPECT_EQ(registry_.Find(At(47))->label, "between");
  registry_.Remove(At(32));
  EXPECT_FALSE(registry_.Find(At(40)).has_value());
  EXPECT_THAT(registry_.CheckInside("Op", "x", At(40), 4),
              StatusIs(absl::StatusCode::kInvalidArgument));
  registry_.Remove(At(100));  // not an allocation: nothing happens
  EXPECT_EQ(registry_.size(), 2);
}

// Copiers and communicators check from their threads while the owner adds
// and removes.
TEST_F(AllocationRegistryTest, ChecksRunConcurrentlyWithChanges) {
  std::vector<char> more(4096);
  std::thread owner([&] {
    for (int i = 0; i < 2000; ++i) {
      ASSERT_OK(registry_.Add(more.data() + (i % 64) * 64, 64, "churn"));
      registry_.Remove(more.data() + (i % 64) * 64);
    }
  });
  for (int i = 0; i < 2000; ++i) {
    ASSERT_OK(registry_.CheckInside("Op", "x", At(16), 16));
  }
  owner.join();
  EXPECT_EQ(registry_.size(), 2);
}

}  // namespace
}  // namespace canzona
