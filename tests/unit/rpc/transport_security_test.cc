// The TCP listeners' bearer-token check: the comparison, the metadata
// parsing, and the ControlPlane on a real gRPC server whose port carries
// the check: every method UNAUTHENTICATED without the token or with a wrong
// one (nothing stored), OK with it; the health check exempt.
#include "server/rpc/transport_security.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "canzona/v1/control_plane.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/control/kv_store.h"
#include "server/rpc/control_plane_service.h"
#include "server/rpc/grpc_kv_store.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/rpc/security_test_util.h"

namespace canzona {
namespace {

using ::canzona::testing::IsOk;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

TEST(TransportSecurityTest, ConstantTimeEquals) {
  EXPECT_TRUE(ConstantTimeEquals("secret", "secret"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals("secreT", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secret!", "secret"));  // longer
  EXPECT_FALSE(ConstantTimeEquals("secre", "secret"));    // prefix
  EXPECT_FALSE(ConstantTimeEquals("", "secret"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("secret\0", 7), "secret"));
}

TEST(TransportSecurityTest, CheckBearerToken) {
  const auto unauthenticated =
      StatusIs(absl::StatusCode::kUnauthenticated,
               ::testing::Eq("missing or wrong bearer token"));
  EXPECT_OK(CheckBearerToken({"Bearer s3cret"}, "s3cret"));
  EXPECT_OK(CheckBearerToken({"bearer s3cret"}, "s3cret"));  // scheme case
  EXPECT_OK(CheckBearerToken({"Basic x", "Bearer s3cret"}, "s3cret"));
  EXPECT_THAT(CheckBearerToken({}, "s3cret"), unauthenticated);
  EXPECT_THAT(CheckBearerToken({"Bearer wrong"}, "s3cret"), unauthenticated);
  EXPECT_THAT(CheckBearerToken({"Bearer s3cre"}, "s3cret"), unauthenticated);
  EXPECT_THAT(CheckBearerToken({"s3cret"}, "s3cret"), unauthenticated);
  EXPECT_THAT(CheckBearerToken({"Bearer"}, "s3cret"), unauthenticated);
  EXPECT_THAT(CheckBearerToken({"Bearer  s3cret"}, "s3cret"), unauthenticated);
  // No token configured: everything passes.
  EXPECT_OK(CheckBearerToken({}, ""));
}

TEST(TransportSecurityTest, OnlyTheHealthCheckIsExempt) {
  EXPECT_TRUE(IsExemptFromToken("/grpc.health.v1.Health/Check"));
  EXPECT_TRUE(IsExemptFromToken("/grpc.health.v1.Health/Watch"));
  EXPECT_FALSE(IsExemptFromToken("/canzona.v1.ControlPlane/Set"));
  EXPECT_FALSE(IsExemptFromToken("/canzona.v1.OptimizerService/GetStatus"));
  EXPECT_FALSE(IsExemptFromToken(""));
}

TEST(TransportSecurityTest, ReadPemFileNamesTheFlag) {
  EXPECT_THAT(ReadPemFile("--tls-cert", "/nonexistent/cert.pem"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--tls-cert: cannot read /nonexistent")));
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/notpem_", ::getpid());
  { std::ofstream(path) << "hello\n"; }
  EXPECT_THAT(ReadPemFile("--tls-ca", path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("holds no PEM block")));
}

constexpr char kToken[] = "tok-3f9a";

// The ControlPlane on 127.0.0.1:0 with the bearer-token check on its port.
class TokenPortTest : public ::testing::Test {
 protected:
  void SetUp() override {
    service_ = std::make_unique<ControlPlaneService>(&store_);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    TcpSecurity security;
    security.bearer_token = kToken;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", TcpServerCredentials(security),
                             &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port, 0);
    target_ = absl::StrCat("127.0.0.1:", port);
    channel_ = grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    service_->CancelPendingWaits();
    server_->Shutdown();
  }

  InMemoryKvStore store_;
  std::unique_ptr<ControlPlaneService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(TokenPortTest, EveryControlPlaneMethodNeedsTheToken) {
  const google::protobuf::ServiceDescriptor* service =
      canzona::v1::SetRequest::descriptor()->file()->FindServiceByName(
          "ControlPlane");
  ASSERT_GE(service->method_count(), 5);
  const std::vector<std::vector<std::pair<std::string, std::string>>> bad = {
      {},
      {{"authorization", "Bearer wrong"}},
      {{"authorization", absl::StrCat("Basic ", kToken)}},
      {{"authorization", absl::StrCat("Bearer ", kToken, "x")}},
  };
  for (int m = 0; m < service->method_count(); ++m) {
    const std::string method = absl::StrCat("/", service->full_name(), "/",
                                            service->method(m)->name());
    for (const auto& metadata : bad) {
      grpc::Status status = security_test::RawCall(channel_, method, metadata);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << method << " " << (metadata.empty() ? "" : metadata[0].second);
      EXPECT_EQ(status.error_message(), "missing or wrong bearer token");
    }
    // With the token the call reaches the service (an empty request is
    // then the service's own INVALID_ARGUMENT, not an auth failure).
    grpc::Status status = security_test::RawCall(
        channel_, method, {{"authorization", absl::StrCat("Bearer ", kToken)}});
    EXPECT_NE(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << method << ": " << status.error_message();
  }
}

TEST_F(TokenPortTest, GrpcKvStoreWithTheTokenWorksWithoutItIsRejected) {
  ASSERT_OK_AND_ASSIGN(
      auto good,
      GrpcKvStore::Connect(target_, grpc::InsecureChannelCredentials(),
                           absl::Seconds(10), kToken));
  ASSERT_OK(good->Set("k", "v"));
  ASSERT_OK_AND_ASSIGN(std::string v, good->Get("k", absl::Seconds(1)));
  EXPECT_EQ(v, "v");
  ASSERT_OK_AND_ASSIGN(int64_t n, good->Add("n", 2));
  EXPECT_EQ(n, 2);
  std::vector<std::string> keys = {"k"};
  EXPECT_OK(good->Wait(keys, absl::Seconds(1)));
  EXPECT_OK(good->DeletePrefix("k"));

  ASSERT_OK_AND_ASSIGN(
      auto bad,
      GrpcKvStore::Connect(target_, grpc::InsecureChannelCredentials(),
                           absl::Seconds(10), "wrong"));
  const auto unauthenticated =
      StatusIs(absl::StatusCode::kUnauthenticated,
               HasSubstr("missing or wrong bearer token"));
  EXPECT_THAT(bad->Set("x", "y"), unauthenticated);
  EXPECT_THAT(bad->Get("n", absl::Seconds(1)), unauthenticated);
  EXPECT_THAT(bad->Add("n", 5), unauthenticated);
  EXPECT_THAT(bad->Wait(keys, absl::Seconds(1)), unauthenticated);
  EXPECT_THAT(bad->DeletePrefix("n"), unauthenticated);
  // State unchanged by the rejected calls.
  ASSERT_OK_AND_ASSIGN(n, good->Add("n", 0));
  EXPECT_EQ(n, 2);
  EXPECT_THAT(store_.Get("x", absl::ZeroDuration()), ::testing::Not(IsOk()));
}

TEST_F(TokenPortTest, HealthCheckNeedsNoToken) {
  grpc::Status status =
      security_test::RawCall(channel_, "/grpc.health.v1.Health/Check", {});
  EXPECT_TRUE(status.ok()) << status.error_message();
}

}  // namespace
}  // namespace canzona
