#include "server/plan/sim/trainer_iteration.h"

#include "gtest/gtest.h"

namespace canzona::plan::sim {
namespace {

TEST(TrainerIterationTest, PlainRunsEverythingInSequence) {
  SimOptions options;
  options.backward_s = 2;
  options.forward_s = 1;
  const SimOverlap o =
      SimulateIteration({{0.5, 0.5}, {0.3, 0.3}, 1.0, 2.6}, options);
  EXPECT_DOUBLE_EQ(o.plain_iteration_s, 2 + 2.6 + 1);
  EXPECT_DOUBLE_EQ(o.dp_comm_s, 1.6);
  EXPECT_DOUBLE_EQ(o.plain_exposed_s, 1.6);
  EXPECT_DOUBLE_EQ(o.update_span_s, 1.0);
  EXPECT_DOUBLE_EQ(o.overlap_iteration_s, 0);  // not asked for
}

TEST(TrainerIterationTest, OverlapHidesWhatFitsUnderTheTrainer) {
  SimOptions options;
  options.backward_s = 2;
  options.forward_s = 1;
  options.overlap = true;
  // Bucket 0 ready at 1, reduced by 1.5; bucket 1 ready at 2, reduced by
  // 2.5: 0.5 exposed. Update 1 -> step ends at 3.5. Gathers end at 3.8 and
  // 4.1; forward halves (0.5 each) start at 3.8 (0.3 waited) and 4.3.
  const SimOverlap o =
      SimulateIteration({{0.5, 0.5}, {0.3, 0.3}, 1.0, 2.6}, options);
  EXPECT_DOUBLE_EQ(o.overlap_wait_params_s, 0.3);
  EXPECT_DOUBLE_EQ(o.overlap_exposed_s, 0.5 + 0.3);
  EXPECT_DOUBLE_EQ(o.overlap_iteration_s, 4.8);
  EXPECT_LT(o.overlap_iteration_s, o.plain_iteration_s);
}

TEST(TrainerIterationTest, CommunicationLongerThanTheTrainerStaysExposed) {
  SimOptions options;
  options.backward_s = 0.1;
  options.forward_s = 0.1;
  options.overlap = true;
  // One bucket of 2 s each way: almost all of it is waited for.
  const SimOverlap o = SimulateIteration({{2}, {2}, 0.5, 4.5}, options);
  EXPECT_DOUBLE_EQ(o.overlap_exposed_s, 2 + 2);
  EXPECT_DOUBLE_EQ(o.overlap_iteration_s, 0.1 + 2 + 0.5 + 2 + 0.1);
}

}  // namespace
}  // namespace canzona::plan::sim
