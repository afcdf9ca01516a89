// The registry alone: admission conflicts, lookups, removal and records,
// closing.
#include "server/engine/job_registry.h"

#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/engine/parts_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

class JobRegistryTest : public ::testing::Test {
 protected:
  JobRegistry::Options Options(int max_jobs = 8) {
    JobRegistry::Options o;
    o.control = &kv_;
    o.max_jobs = max_jobs;
    return o;
  }
  // Admits rank `global` of `config` (its buffers really mapped).
  absl::StatusOr<std::shared_ptr<Job>> Admit(
      JobRegistry& registry, const JobConfig& config, int global,
      v1::RegisterRequest* sent = nullptr) {
    auto trainer = std::make_unique<TrainerRank>(config, global);
    CANZONA_RETURN_IF_ERROR(trainer->Init());
    v1::RegisterRequest request = trainer->MakeRegister();
    if (sent != nullptr) request = *sent;
    CANZONA_ASSIGN_OR_RETURN(RankSpec spec,
                             ValidateRegisterRequest(request, {}));
    CANZONA_ASSIGN_OR_RETURN(
        std::unique_ptr<TrainerBuffers> buffers,
        TrainerBuffers::Map(request, spec.fragment_numel, {}));
    auto rank = std::make_shared<LocalRank>(
        spec.coords, spec.global, TrainerProcess(), std::move(buffers));
    return registry.Admit(request, spec, rank);
  }

  InMemoryKvStore kv_;
  std::map<std::string, std::unique_ptr<TrainerRank>> trainers_;
};

TEST_F(JobRegistryTest, AdmissionConflictsAreRefused) {
  JobRegistry registry(Options(/*max_jobs=*/1));
  const JobConfig config = MakeJobConfig("reg", /*dp=*/2, /*tp=*/1, "cost");
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Job> job, Admit(registry, config, 0));
  EXPECT_EQ(job->id, config.job_id);
  EXPECT_THAT(Admit(registry, config, 0),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("is already registered")));

  ASSERT_OK_AND_ASSIGN(v1::RegisterRequest other, RequestOf(config, 1));
  v1::RegisterRequest wrong_token = other;
  wrong_token.set_job_token("nope");
  EXPECT_THAT(Admit(registry, config, 1, &wrong_token),
              StatusIs(absl::StatusCode::kUnauthenticated));
  v1::RegisterRequest other_alpha = other;
  other_alpha.set_alpha(0.5);
  EXPECT_THAT(Admit(registry, config, 1, &other_alpha),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("settings[2]: 'alpha=0.5'")));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Job> same, Admit(registry, config, 1));
  EXPECT_EQ(same, job);

  EXPECT_THAT(Admit(registry, MakeJobConfig("reg2", 1, 1, "cost"), 0),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("at most 1 jobs")));
}

TEST_F(JobRegistryTest, LookupsSayWhyNot) {
  JobRegistry registry(Options());
  const JobConfig config = MakeJobConfig("reg", 2, 1, "cost");
  EXPECT_THAT(registry.FindJob(config.job_id),
              StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(Admit(registry, config, 0).status());
  v1::RankCoordinates coords;
  EXPECT_THAT(
      registry.FindReadyRank(config.job_id, coords),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not ready")));
  coords.set_dp_rank(5);
  EXPECT_THAT(registry.FindReadyRank(config.job_id, coords),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outside the layout")));
}

TEST_F(JobRegistryTest, RemovingTheLastRankKeepsAFailedJobsRecord) {
  JobRegistry registry(Options());
  const JobConfig config = MakeJobConfig("reg", 2, 1, "cost");
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Job> job, Admit(registry, config, 0));
  EXPECT_TRUE(registry.RemoveLocalRank(job, 0, "the trainer of rank 0 died"));
  EXPECT_FALSE(registry.RemoveLocalRank(job, 0, "again"));
  EXPECT_TRUE(job->failed());
  EXPECT_THAT(registry.FindJob(config.job_id),
              StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Job> record,
                       registry.FindJobOrRecord(config.job_id));
  EXPECT_EQ(record, job);
  ASSERT_EQ(registry.Jobs().size(), 1u);

  // A job whose ranks all deregistered leaves no record.
  const JobConfig done = MakeJobConfig("reg", 1, 1, "cost");
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Job> finished, Admit(registry, done, 0));
  EXPECT_TRUE(registry.RemoveLocalRank(finished, 0, "rank 0 deregistered",
                                       /*graceful=*/true));
  EXPECT_THAT(registry.FindJobOrRecord(done.job_id),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(JobRegistryTest, ClosingRefusesWhatComesLater) {
  JobRegistry registry(Options());
  const JobConfig config = MakeJobConfig("reg", 2, 1, "cost");
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Job> job, Admit(registry, config, 0));
  registry.Close();
  EXPECT_TRUE(registry.closed());
  EXPECT_TRUE(job->failed());
  EXPECT_THAT(Admit(registry, config, 1),
              StatusIs(absl::StatusCode::kUnavailable));
  registry.Close();  // idempotent
}

}  // namespace
}  // namespace canzona::engine_test
