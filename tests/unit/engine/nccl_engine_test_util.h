// What the NCCL-plane engine tests share (nccl_engine_test.cc,
// nccl_engine_waits_test.cc, nccl_engine_copies_test.cc): the fake's data
// mode and a fixture with one job on two engines over it.
#ifndef CANZONA_TESTS_UNIT_ENGINE_NCCL_ENGINE_TEST_UTIL_H_
#define CANZONA_TESTS_UNIT_ENGINE_NCCL_ENGINE_TEST_UTIL_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {

// FakeNcclApi moving the data (collectives summed in rank order).
inline testing::FakeNcclApi::Options DataMode() {
  testing::FakeNcclApi::Options o;
  o.simulate_data = true;
  return o;
}

// One job on two engines whose data plane is NCCL over a data-mode fake.
// The test's thread owns everything.
class NcclJobTest : public ::testing::Test {
 protected:
  void SetUp() override { SetCpuBlasThreads(1); }
  // Creates the job's buffers and registers all its ranks.
  absl::Status Register(const JobConfig& config) {
    run_ = std::make_unique<JobRun>(config);
    CANZONA_RETURN_IF_ERROR(run_->Init());
    return run_->RegisterAll(cluster_);
  }

  testing::FakeNcclApi nccl_{DataMode()};
  Cluster cluster_{absl::Seconds(20), absl::Seconds(20), "cpu", nullptr,
                   &nccl_};
  std::unique_ptr<JobRun> run_;
};

}  // namespace canzona::engine_test

#endif  // CANZONA_TESTS_UNIT_ENGINE_NCCL_ENGINE_TEST_UTIL_H_
