// Steps through the step doorbell against the same steps over gRPC, through
// the daemon's real unix socket (SO_PEERCRED), service and engine: the same
// parameters bit for bit, the same checks, and bad attachments or requests
// answered with a status naming the field while the daemon keeps serving.
#include "proto/shared_memory/step_doorbell.h"

#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "canzona/v1/optimizer_service.grpc.pb.h"
#include "client/lib/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "server/control/kv_store.h"
#include "server/engine/engine_impl.h"
#include "server/rpc/optimizer_service.h"
#include "server/rpc/step_doorbells.h"
#include "server/rpc/unix_socket_listener.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/rpc/security_test_util.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int kParams = 3;
constexpr int64_t kNumel = 64;
constexpr int kSteps = 5;

class StepDoorbellServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions options;
    options.control = &kv_;
    options.daemon_id = "step-doorbell-test";
    options.backend = "cpu";
    ASSERT_OK_AND_ASSIGN(engine_, CreateEngine(options));
    static int count = 0;
    dir_ = absl::StrCat(::testing::TempDir(), "/doorbell_", ::getpid(), "_",
                        ++count);
    ::mkdir(dir_.c_str(), 0755);
    UnixSocketListener::Options listen;
    listen.path = dir_ + "/d.sock";
    ASSERT_OK_AND_ASSIGN(listener_, UnixSocketListener::Create(listen));
    doorbells_ = std::make_unique<StepDoorbells>(engine_.get());
    service_ = std::make_unique<OptimizerServiceImpl>(
        engine_.get(), nullptr, &listener_->peers(), doorbells_.get());
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    listener_->Start(server_.get());
  }
  void TearDown() override {
    engine_->Shutdown();
    doorbells_->StopAll();
    listener_->Stop();
    server_->Shutdown();
  }

  std::unique_ptr<Client> Connect() {
    Client::Options options;
    options.register_timeout = absl::Seconds(30);
    options.step_timeout = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect("unix:" + listener_->path(), options);
    EXPECT_OK(client.status());
    return client.ok() ? *std::move(client) : nullptr;
  }

  // What AttachStepDoorbell carries for `bell` and the job's rank, and a
  // caller on the unix socket as SO_PEERCRED reports it.
  static v1::AttachStepDoorbellRequest AttachRequest(
      const StepDoorbell& bell, const v1::RegisterRequest& job) {
    v1::AttachStepDoorbellRequest request;
    request.set_job_id(job.job_id());
    *request.mutable_rank() = job.rank();
    request.set_shm_name(bell.name());
    return request;
  }
  static PeerInfo LocalPeer(pid_t pid) {
    PeerInfo peer;
    peer.uid = ::geteuid();
    peer.pid = pid;
    return peer;
  }

  // A registered one-rank job of one kNumel-element parameter.
  absl::StatusOr<security_test::TinyJob> RegisterTinyJob(
      Client& client, const std::string& job_id) {
    CANZONA_ASSIGN_OR_RETURN(
        security_test::TinyJob job,
        security_test::MakeTinyJob(client, job_id, 1, 0, 1, kNumel));
    CANZONA_RETURN_IF_ERROR(client.Register(job.request).status());
    return job;
  }

  // Runs a DP2 AdamW job of random parameters and, per step, random
  // gradients (the same seeds for every job); rank r steps through its
  // doorbell when doorbell[r]. With `overlap`, one bucket per parameter,
  // reported with GradReady, an async Step and WaitParams (which go
  // through the doorbell too). The parameters after kSteps, rank by rank.
  std::vector<std::vector<float>> RunJob(const std::string& job_id,
                                         const bool doorbell[2],
                                         bool overlap = false) {
    std::vector<std::vector<float>> result(2);
    auto rank = [&](int r) {
      std::unique_ptr<Client> client = Connect();
      ASSERT_NE(client, nullptr);
      ASSERT_OK_AND_ASSIGN(
          security_test::TinyJob job,
          security_test::MakeTinyJob(*client, job_id, 2, r, kParams, kNumel));
      std::mt19937 params(17);  // DP replicas hold the same parameters
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (int i = 0; i < kParams; ++i) {
        for (float& x : job.tensors[2 * i].span()) x = normal(params);
      }
      if (overlap) job.request.set_bucket_size(kNumel);
      ASSERT_OK_AND_ASSIGN(v1::RegisterResponse registered,
                           client->Register(job.request));
      if (overlap) ASSERT_EQ(registered.buckets_size(), kParams);
      if (doorbell[r]) {
        ASSERT_OK(client->AttachStepDoorbell(job_id, job.request.rank()));
      }
      for (int k = 1; k <= kSteps; ++k) {
        std::mt19937 grads(1000 * r + k);
        for (int i = 0; i < kParams; ++i) {
          for (float& x : job.tensors[2 * i + 1].span()) x = normal(grads);
        }
        v1::StepRequest step = security_test::TinyStep(job.request, k);
        if (!overlap) {
          ASSERT_OK(client->Step(step));
          continue;
        }
        for (int b = 0; b < registered.buckets_size(); ++b) {
          ASSERT_OK(client->GradReady(job_id, job.request.rank(), k, {b}));
        }
        step.set_async_params(true);
        ASSERT_OK(client->Step(step));
        for (int b = registered.buckets_size() - 1; b >= 0; --b) {
          ASSERT_OK(client->WaitParams(job_id, job.request.rank(), k, b));
        }
      }
      for (int i = 0; i < kParams; ++i) {
        absl::Span<const float> p = job.tensors[2 * i].span();
        result[r].insert(result[r].end(), p.begin(), p.end());
      }
      ASSERT_OK(client->Deregister(job_id, job.request.rank()));
    };
    std::thread second(rank, 1);
    rank(0);
    second.join();
    return result;
  }

  InMemoryKvStore kv_;
  std::unique_ptr<Engine> engine_;
  std::string dir_;
  std::unique_ptr<UnixSocketListener> listener_;
  std::unique_ptr<StepDoorbells> doorbells_;
  std::unique_ptr<OptimizerServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(StepDoorbellServiceTest, DoorbellStepsEqualGrpcStepsBitwise) {
  const bool grpc_only[2] = {false, false};
  const bool mixed[2] = {true, false};
  const bool doorbells[2] = {true, true};
  const std::string pid = absl::StrCat(::getpid());
  const auto reference = RunJob("grpc" + pid, grpc_only);
  ASSERT_EQ(reference[0].size(), kParams * kNumel);
  // The steps moved the parameters (AdamW on random gradients).
  std::mt19937 params(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  EXPECT_NE(reference[0][0], normal(params));
  for (const bool* mode : {mixed, doorbells}) {
    const auto got = RunJob(absl::StrCat("bell", mode[1], pid), mode);
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(got[r].size(), reference[r].size());
      EXPECT_EQ(std::memcmp(got[r].data(), reference[r].data(),
                            got[r].size() * sizeof(float)),
                0)
          << "rank " << r << " differs (doorbell on rank 1: " << mode[1] << ")";
    }
  }
  // Deregister detached every doorbell.
  EXPECT_EQ(doorbells_->size(), 0);
}

TEST_F(StepDoorbellServiceTest, OverlapCallsThroughTheDoorbellEqualGrpc) {
  const bool grpc_only[2] = {false, false};
  const bool doorbells[2] = {true, true};
  const std::string pid = absl::StrCat(::getpid());
  const auto plain = RunJob("plain" + pid, grpc_only);
  const auto reference = RunJob("ovgrpc" + pid, grpc_only, /*overlap=*/true);
  const auto got = RunJob("ovbell" + pid, doorbells, /*overlap=*/true);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(got[r].size(), reference[r].size());
    // Overlap changes when, not what: all three end bitwise equal.
    EXPECT_EQ(std::memcmp(reference[r].data(), plain[r].data(),
                          got[r].size() * sizeof(float)),
              0)
        << "rank " << r << ": overlap over gRPC differs from plain steps";
    EXPECT_EQ(std::memcmp(got[r].data(), reference[r].data(),
                          got[r].size() * sizeof(float)),
              0)
        << "rank " << r << ": overlap through the doorbell differs";
  }
}

TEST_F(StepDoorbellServiceTest, EveryStepCallRidesTheDoorbellAndIsChecked) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string job_id = absl::StrCat("methods", ::getpid());
  ASSERT_OK_AND_ASSIGN(security_test::TinyJob job,
                       RegisterTinyJob(*client, job_id));
  // A doorbell rung by hand, so nothing can fall back to gRPC.
  ASSERT_OK_AND_ASSIGN(StepDoorbell bell,
                       StepDoorbell::Create(ShmName(job_id, 0, 424242)));
  ASSERT_OK(doorbells_->Attach(AttachRequest(bell, job.request),
                               LocalPeer(::getpid())));
  using Method = StepDoorbell::Method;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::mt19937 random(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : job.tensors[1].span()) x = normal(random);
  const std::vector<float> before(job.tensors[0].span().begin(),
                                  job.tensors[0].span().end());

  v1::GradReadyRequest ready;
  ready.set_job_id(job_id);
  *ready.mutable_rank() = job.request.rank();
  ready.set_step(1);
  ready.add_buckets(0);
  ASSERT_OK_AND_ASSIGN(
      std::string ready_reply,
      bell.Call(Method::kGradReady, ready.SerializeAsString(), deadline));
  EXPECT_TRUE(v1::GradReadyResponse().ParseFromString(ready_reply));
  // A bucket the rank does not have: the engine's own refusal.
  v1::GradReadyRequest bad_bucket = ready;
  bad_bucket.set_buckets(0, 7);
  EXPECT_THAT(
      bell.Call(Method::kGradReady, bad_bucket.SerializeAsString(), deadline),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bucket")));

  v1::StepRequest step = security_test::TinyStep(job.request, 1);
  step.set_async_params(true);
  ASSERT_OK_AND_ASSIGN(
      std::string step_reply,
      bell.Call(Method::kStep, step.SerializeAsString(), deadline));
  v1::StepResponse stepped;
  ASSERT_TRUE(stepped.ParseFromString(step_reply));
  EXPECT_GT(stepped.grad_norm(), 0.0);

  v1::WaitParamsRequest wait;
  wait.set_job_id(job_id);
  *wait.mutable_rank() = job.request.rank();
  wait.set_step(1);
  wait.set_bucket(-1);
  ASSERT_OK_AND_ASSIGN(
      std::string wait_reply,
      bell.Call(Method::kWaitParams, wait.SerializeAsString(), deadline));
  v1::WaitParamsResponse waited;
  EXPECT_TRUE(waited.ParseFromString(wait_reply));
  EXPECT_GE(waited.waited_seconds(), 0.0);
  // The update is in place once WaitParams answered.
  for (size_t i = 0; i < before.size(); ++i) {
    ASSERT_NE(job.tensors[0].span()[i], before[i]) << "element " << i;
  }

  // Another rank's call, bytes of another message, an unknown method.
  v1::WaitParamsRequest other = wait;
  other.mutable_rank()->set_dp_rank(1);
  EXPECT_THAT(
      bell.Call(Method::kWaitParams, other.SerializeAsString(), deadline),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id/rank")));
  EXPECT_THAT(bell.Call(Method::kGradReady, "\xff\xff", deadline),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not a canzona.v1.GradReadyRequest")));
  EXPECT_THAT(
      bell.Call(static_cast<Method>(9), step.SerializeAsString(), deadline),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("unknown method 9")));
  // And the doorbell still serves: step 2.
  step.set_step(2);
  step.set_async_params(false);
  ASSERT_OK(
      bell.Call(Method::kStep, step.SerializeAsString(), deadline).status());
  ASSERT_OK(client->Deregister(job_id, job.request.rank()));
}

TEST_F(StepDoorbellServiceTest, BadAttachmentsAndRequestsAreRefusedCleanly) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string job_id = absl::StrCat("badbell", ::getpid());
  ASSERT_OK_AND_ASSIGN(
      security_test::TinyJob job,
      security_test::MakeTinyJob(*client, job_id, 1, 0, 1, kNumel));
  v1::RankCoordinates other;
  other.set_dp_rank(1);
  // No such job yet, then no such rank.
  EXPECT_THAT(client->AttachStepDoorbell(job_id, job.request.rank()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("job_id")));
  ASSERT_OK(client->Register(job.request).status());
  EXPECT_THAT(client->AttachStepDoorbell(job_id, other),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("rank")));

  // Raw attachments: a bad name, a missing object, a tensor buffer.
  auto channel = grpc::CreateChannel("unix:" + listener_->path(),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::OptimizerService::NewStub(channel);
  auto attach = [&](const std::string& name) {
    v1::AttachStepDoorbellRequest request;
    request.set_job_id(job_id);
    *request.mutable_rank() = job.request.rank();
    request.set_shm_name(name);
    grpc::ClientContext context;
    v1::AttachStepDoorbellResponse response;
    return stub->AttachStepDoorbell(&context, request, &response);
  };
  grpc::Status s = attach("/etc/passwd");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("shm_name"));
  s = attach(ShmName(job_id, 0, 999999));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("shm_name"));
  s = attach(job.request.parameters(0).param().shm().name());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("not a step doorbell"));
  EXPECT_EQ(doorbells_->size(), 0);
  // Off the unix socket (no SO_PEERCRED uid): refused.
  v1::AttachStepDoorbellRequest tcp;
  tcp.set_job_id(job_id);
  EXPECT_THAT(doorbells_->Attach(tcp, PeerInfo{}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("unix socket")));

  // A doorbell of our own, to send what a client never would.
  ASSERT_OK_AND_ASSIGN(StepDoorbell bell,
                       StepDoorbell::Create(ShmName(job_id, 0, 424242)));
  ASSERT_TRUE(attach(bell.name()).ok());
  EXPECT_EQ(doorbells_->size(), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  EXPECT_THAT(bell.Call("\xff\xff garbage", deadline),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not a canzona.v1.StepRequest")));
  v1::StepRequest wrong_rank = security_test::TinyStep(job.request, 1);
  *wrong_rank.mutable_rank() = other;
  EXPECT_THAT(
      bell.Call(wrong_rank.SerializeAsString(), deadline),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id/rank")));
  // The engine's own checks, as over gRPC.
  EXPECT_THAT(
      bell.Call(security_test::TinyStep(job.request, 3).SerializeAsString(),
                deadline),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("step out of order")));
  v1::StepRequest bad_scale = security_test::TinyStep(job.request, 1);
  bad_scale.set_grad_scale(-1);
  EXPECT_THAT(
      bell.Call(bad_scale.SerializeAsString(), deadline),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("grad_scale")));
  // Nothing was stepped: the parameter is untouched, and step 1 runs now,
  // through the doorbell and then over gRPC.
  EXPECT_EQ(job.tensors[0].data()[0], 1.0f);
  ASSERT_OK_AND_ASSIGN(
      std::string reply,
      bell.Call(security_test::TinyStep(job.request, 1).SerializeAsString(),
                deadline));
  v1::StepResponse response;
  ASSERT_TRUE(response.ParseFromString(reply));
  EXPECT_GT(response.grad_norm(), 0);
  EXPECT_NE(job.tensors[0].data()[0], 1.0f);
  ASSERT_OK(client->Step(security_test::TinyStep(job.request, 2)).status());

  // Deregister detaches it.
  ASSERT_OK(client->Deregister(job_id, job.request.rank()));
  EXPECT_EQ(doorbells_->size(), 0);
}

TEST_F(StepDoorbellServiceTest, AfterDeregisterStepsGoOverGrpcAgain) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string job_id = absl::StrCat("againbell", ::getpid());
  ASSERT_OK_AND_ASSIGN(security_test::TinyJob job,
                       RegisterTinyJob(*client, job_id));
  ASSERT_OK(client->AttachStepDoorbell(job_id, job.request.rank()));
  ASSERT_OK(client->Step(security_test::TinyStep(job.request, 1)).status());
  ASSERT_OK(client->Deregister(job_id, job.request.rank()));
  EXPECT_EQ(doorbells_->size(), 0);
  // The daemon detached the doorbell, so the client no longer uses it (it
  // would never answer): the next Step goes over gRPC and the engine says
  // the job is gone.
  EXPECT_THAT(client->Step(security_test::TinyStep(job.request, 2)),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(StepDoorbellServiceTest, TheLimitCountsOnlyTheDoorbellsThatStay) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  std::vector<security_test::TinyJob> jobs;
  for (const char* name : {"capa", "capb"}) {
    ASSERT_OK_AND_ASSIGN(
        security_test::TinyJob job,
        security_test::MakeTinyJob(*client, absl::StrCat(name, ::getpid()), 1,
                                   0, 1, kNumel));
    ASSERT_OK(client->Register(job.request).status());
    jobs.push_back(std::move(job));
  }
  StepDoorbells one(engine_.get(), /*max_doorbells=*/1);
  std::vector<StepDoorbell> bells;
  auto attach = [&](const security_test::TinyJob& job) {
    absl::StatusOr<StepDoorbell> bell = StepDoorbell::Create(
        ShmName(job.request.job_id(), 0, 454545 + bells.size()));
    EXPECT_OK(bell.status());
    bells.push_back(*std::move(bell));
    return one.Attach(AttachRequest(bells.back(), job.request),
                      LocalPeer(::getpid()));
  };
  ASSERT_OK(attach(jobs[0]));
  EXPECT_THAT(attach(jobs[1]), StatusIs(absl::StatusCode::kResourceExhausted,
                                        HasSubstr("at most 1 step doorbells")));
  EXPECT_EQ(one.size(), 1);
  // Replacing the rank's own doorbell is not one more.
  ASSERT_OK(attach(jobs[0]));
  EXPECT_EQ(one.size(), 1);
  one.StopAll();
  for (const security_test::TinyJob& job : jobs) {
    ASSERT_OK(client->Deregister(job.request.job_id(), job.request.rank()));
  }
}

TEST_F(StepDoorbellServiceTest, ADoorbellOfAnExitedTrainerStopsByItself) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string job_id = absl::StrCat("gonebell", ::getpid());
  ASSERT_OK_AND_ASSIGN(security_test::TinyJob job,
                       RegisterTinyJob(*client, job_id));
  // A pid that has exited (and been reaped).
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  ASSERT_OK_AND_ASSIGN(StepDoorbell bell,
                       StepDoorbell::Create(ShmName(job_id, 0, 434343)));
  ASSERT_OK(
      doorbells_->Attach(AttachRequest(bell, job.request), LocalPeer(child)));
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (doorbells_->size() > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(doorbells_->size(), 0);
  ASSERT_OK(client->Deregister(job_id, job.request.rank()));
}

}  // namespace
}  // namespace canzona
