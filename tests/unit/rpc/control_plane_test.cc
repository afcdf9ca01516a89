// The ControlPlane service end to end: a real gRPC server on 127.0.0.1:0 and
// the GrpcKvStore client.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/control/kv_store.h"
#include "server/rpc/control_plane_service.h"
#include "server/rpc/grpc_kv_store.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

class ControlPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ControlPlaneService::Limits limits;
    limits.max_value_bytes = 1024;
    service_ = std::make_unique<ControlPlaneService>(&store_, limits);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    target_ = absl::StrCat("127.0.0.1:", port);
    ASSERT_OK_AND_ASSIGN(client_, GrpcKvStore::Connect(target_));
  }
  void TearDown() override {
    service_->CancelPendingWaits();
    server_->Shutdown();
  }

  InMemoryKvStore store_;
  std::unique_ptr<ControlPlaneService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
  std::unique_ptr<GrpcKvStore> client_;
};

TEST_F(ControlPlaneTest, SetGetAddDeleteRoundTrip) {
  ASSERT_OK(client_->Set("job/a/digest/0", std::string("\0\1\2", 3)));
  ASSERT_OK_AND_ASSIGN(std::string value,
                       client_->Get("job/a/digest/0", absl::ZeroDuration()));
  EXPECT_EQ(value, std::string("\0\1\2", 3));  // bytes, not text
  ASSERT_OK_AND_ASSIGN(int64_t n, client_->Add("job/a/count", 3));
  EXPECT_EQ(n, 3);
  ASSERT_OK_AND_ASSIGN(n, client_->Add("job/a/count", -1));
  EXPECT_EQ(n, 2);
  ASSERT_OK(client_->DeletePrefix("job/a/"));
  EXPECT_THAT(
      client_->Get("job/a/count", absl::ZeroDuration()),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("job/a/count")));
}

TEST_F(ControlPlaneTest, GetAndWaitBlockUntilAnotherClientSets) {
  ASSERT_OK_AND_ASSIGN(auto other, GrpcKvStore::Connect(target_));
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_OK(other->Set("k1", "v1"));
    EXPECT_OK(other->Set("k2", "v2"));
  });
  ASSERT_OK_AND_ASSIGN(std::string v, client_->Get("k1", absl::Seconds(20)));
  EXPECT_EQ(v, "v1");
  std::vector<std::string> keys = {"k1", "k2"};
  EXPECT_OK(client_->Wait(keys, absl::Seconds(20)));
  setter.join();
}

TEST_F(ControlPlaneTest, TimeoutIsDeadlineExceededNamingTheKey) {
  const absl::Time start = absl::Now();
  EXPECT_THAT(client_->Get("nobody/sets/this", absl::Milliseconds(200)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("nobody/sets/this")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  std::vector<std::string> keys = {"w1"};
  EXPECT_THAT(client_->Wait(keys, absl::Milliseconds(100)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("w1")));
}

// More waiting Gets than gRPC has threads: if a handler blocked its thread,
// the Set below could never be served.
TEST_F(ControlPlaneTest, ManyWaitersDoNotHoldServerThreads) {
  constexpr int kWaiters = 64;
  std::vector<std::thread> waiters;
  std::atomic<int> released{0};
  for (int i = 0; i < kWaiters; ++i) {
    waiters.emplace_back([&] {
      absl::StatusOr<std::string> v = client_->Get("go", absl::Seconds(30));
      if (v.ok() && *v == "now") ++released;
    });
  }
  absl::SleepFor(absl::Milliseconds(200));
  ASSERT_OK(client_->Set("go", "now"));
  for (auto& t : waiters) t.join();
  EXPECT_EQ(released.load(), kWaiters);
}

TEST_F(ControlPlaneTest, BadRequestsNameTheFieldAndChangeNothing) {
  EXPECT_THAT(client_->Set("", "v"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
  EXPECT_THAT(
      client_->Set("big", std::string(2048, 'x')),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("value")));
  EXPECT_THAT(client_->Set(std::string(4096, 'k'), "v"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("key")));
  EXPECT_THAT(
      client_->DeletePrefix(""),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prefix")));
  ASSERT_OK(client_->Set("text", "abc"));
  EXPECT_THAT(client_->Add("text", 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("text")));
  // Nothing above was stored or changed.
  EXPECT_THAT(client_->Get("big", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("big")));
  ASSERT_OK_AND_ASSIGN(std::string text,
                       client_->Get("text", absl::ZeroDuration()));
  EXPECT_EQ(text, "abc");
  // And the service keeps serving.
  EXPECT_OK(client_->Set("after", "ok"));
}

TEST_F(ControlPlaneTest, ShutdownCancelsPendingWaitsPromptly) {
  absl::Status status;
  std::thread waiter(
      [&] { status = client_->Get("never", absl::Seconds(60)).status(); });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time start = absl::Now();
  service_->CancelPendingWaits();
  waiter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_THAT(status,
              StatusIs(absl::StatusCode::kCancelled, HasSubstr("never")));
}

TEST(GrpcKvStoreTest, UnreachableCoordinatorIsUnavailable) {
  EXPECT_THAT(
      GrpcKvStore::Connect("127.0.0.1:1", grpc::InsecureChannelCredentials(),
                           absl::Milliseconds(300)),
      StatusIs(absl::StatusCode::kUnavailable, HasSubstr("127.0.0.1:1")));
}

}  // namespace
}  // namespace canzona
