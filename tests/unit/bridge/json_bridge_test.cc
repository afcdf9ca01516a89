// JsonBridge end to end over a real gRPC channel: the C++ client connected
// to a fake OptimizerService on 127.0.0.1:0, lines in, lines out. Checks
// the JSON mapping both ways (int64 as strings, bytes as base64, defaults
// printed), error lines with the daemon's code and message, rejection of
// malformed lines naming the field (and serving on), concurrent requests
// answered in completion order by id, and the bearer token reaching the
// daemon.
#include "client/bridge/json_bridge.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;
using ::testing::HasSubstr;
using Json = nlohmann::json;

std::string AllByteValues() {
  std::string bytes;
  for (int b = 0; b < 256; ++b) bytes.push_back(static_cast<char>(b));
  return bytes;
}

// Answers from the request so a test can tell the fields arrived.
class FakeService final : public v1::OptimizerService::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* r,
                        v1::RegisterResponse* out) override {
    if (r->layout().dp() <= 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "layout.dp: must be > 0");
    }
    out->set_plan_digest(r->job_id() + "-digest");
    out->set_state_bytes(int64_t{1} << 40);  // an int64: a JSON string
    return grpc::Status::OK;
  }
  grpc::Status Step(grpc::ServerContext*, const v1::StepRequest* r,
                    v1::StepResponse* out) override {
    out->set_grad_norm(static_cast<double>(r->step()));
    const auto lr = r->lr().find("muon");
    out->set_update_rms(lr == r->lr().end() ? -1.0 : lr->second);
    out->mutable_seconds()->set_total(0.25);
    return grpc::Status::OK;
  }
  grpc::Status GetStatus(grpc::ServerContext* context,
                         const v1::GetStatusRequest*,
                         v1::GetStatusResponse* out) override {
    const auto& metadata = context->client_metadata();
    const auto auth = metadata.find("authorization");
    out->set_version(auth == metadata.end() ? "no token"
                                            : std::string(auth->second.data(),
                                                          auth->second.size()));
    return grpc::Status::OK;
  }
  grpc::Status WaitParams(grpc::ServerContext*, const v1::WaitParamsRequest*,
                          v1::WaitParamsResponse* out) override {
    release_.WaitForNotificationWithTimeout(absl::Seconds(30));
    out->set_waited_seconds(1.5);
    return grpc::Status::OK;
  }
  grpc::Status ExportState(grpc::ServerContext*, const v1::ExportStateRequest*,
                           v1::ExportStateResponse* out) override {
    out->set_state(AllByteValues());
    out->set_step(7);
    return grpc::Status::OK;
  }
  grpc::Status ImportState(grpc::ServerContext*,
                           const v1::ImportStateRequest* r,
                           v1::ImportStateResponse* out) override {
    if (r->state() != AllByteValues()) {
      return grpc::Status(grpc::StatusCode::DATA_LOSS, "state: bytes differ");
    }
    out->set_records(static_cast<int32_t>(r->state().size()));
    out->set_step(r->step());
    return grpc::Status::OK;
  }

  void Release() {
    if (!release_.HasBeenNotified()) release_.Notify();
  }

 private:
  absl::Notification release_;
};

// The bridge's output, collected line by line.
class Lines {
 public:
  void Add(std::string_view line) {
    absl::MutexLock lock(&mu_);
    lines_.emplace_back(line);
  }
  // Waits for the n-th line (0-based) and returns it parsed.
  Json Get(size_t n) {
    absl::MutexLock lock(&mu_);
    want_ = n + 1;
    EXPECT_TRUE(mu_.AwaitWithTimeout(absl::Condition(this, &Lines::Enough),
                                     absl::Seconds(20)))
        << "no line " << n;
    if (lines_.size() <= n) return Json();
    return Json::parse(lines_[n]);
  }
  size_t size() {
    absl::MutexLock lock(&mu_);
    return lines_.size();
  }

 private:
  bool Enough() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return lines_.size() >= want_;
  }

  absl::Mutex mu_;
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
  size_t want_ ABSL_GUARDED_BY(mu_) = 0;
};

class JsonBridgeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    Client::Options options;
    options.job_token = "secret";
    ASSERT_OK_AND_ASSIGN(
        client_, Client::Connect(absl::StrCat("127.0.0.1:", port), options));
    bridge_ = std::make_unique<JsonBridge>(
        *client_, [this](std::string_view line) { lines_.Add(line); });
  }
  void TearDown() override {
    service_.Release();
    bridge_.reset();  // answers what is in flight, joins its workers
    server_->Shutdown();
  }

  FakeService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
  Lines lines_;
  std::unique_ptr<JsonBridge> bridge_;
};

TEST_F(JsonBridgeTest, StepRoundTripsInTheJsonMapping) {
  bridge_->Submit(
      R"({"id": 12, "method": "Step", "request": {"job_id": "j",
          "rank": {"dp_rank": 1}, "step": "5", "lr": {"muon": 0.02}}})");
  const Json line = lines_.Get(0);
  EXPECT_EQ(line["id"], 12);
  ASSERT_TRUE(line.contains("response")) << line;
  const Json& r = line["response"];
  EXPECT_EQ(r["grad_norm"], 5.0);    // the int64 "5" arrived as 5
  EXPECT_EQ(r["update_rms"], 0.02);  // and the map entry
  EXPECT_EQ(r["seconds"]["total"], 0.25);
  // Defaults are printed, so readers need not know them.
  EXPECT_EQ(r["skipped_nonfinite"], false);
  EXPECT_EQ(r["seconds"]["reduce_scatter"], 0.0);
}

TEST_F(JsonBridgeTest, DaemonErrorsKeepTheirCodeAndMessage) {
  bridge_->Submit(R"({"id": 3, "method": "Register", "request": {
      "job_id": "j", "layout": {"dp": 0}}})");
  bridge_->Submit(R"({"id": 4, "method": "Register", "request": {
      "job_id": "j", "layout": {"pp": 1, "dp": 1, "tp": 1}}})");
  Json error = lines_.Get(0);
  Json ok = lines_.Get(1);
  if (error["id"] == 4) std::swap(error, ok);
  EXPECT_EQ(error["id"], 3);
  EXPECT_EQ(error["error"]["code"], "INVALID_ARGUMENT");
  EXPECT_EQ(error["error"]["message"], "layout.dp: must be > 0");
  EXPECT_EQ(ok["response"]["plan_digest"], "j-digest");
  EXPECT_EQ(ok["response"]["state_bytes"], "1099511627776");  // int64: string
}

TEST_F(JsonBridgeTest, MalformedLinesNameTheFieldAndTheBridgeServesOn) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "line: not a JSON object"},
      {"[1, 2]", "line: not a JSON object"},
      {R"({"method": "Step"})", "id: missing or not an integer"},
      {R"({"id": "7", "method": "Step"})", "id: missing or not an integer"},
      {R"({"id": 8})", "method: missing or not a string"},
      {R"({"id": 9, "method": "Launch"})", "method: unknown method \"Launch\""},
      {R"({"id": 10, "method": "Step", "request": [1]})",
       "request: not a JSON object"},
      {R"({"id": 11, "method": "Step", "request": {"stepp": 1}})", "stepp"},
      {R"({"id": 12, "method": "Step", "request": {"step": "x"}})", "step"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    bridge_->Submit(cases[i].first);
    const Json line = lines_.Get(i);
    ASSERT_TRUE(line.contains("error")) << cases[i].first << " -> " << line;
    EXPECT_EQ(line["error"]["code"], "INVALID_ARGUMENT") << cases[i].first;
    EXPECT_THAT(line["error"]["message"].get<std::string>(),
                HasSubstr(cases[i].second))
        << cases[i].first;
    if (i >= 4) EXPECT_EQ(line["id"], 4 + i) << cases[i].first;
    if (i < 4) EXPECT_TRUE(line["id"].is_null()) << cases[i].first;
  }
  EXPECT_THAT(lines_.Get(5)["error"]["message"].get<std::string>(),
              HasSubstr("one of Deregister, ExportState, GetPlan"));
  bridge_->Submit(R"({"id": 99, "method": "GetStatus"})");
  EXPECT_EQ(lines_.Get(cases.size())["id"], 99);
}

TEST_F(JsonBridgeTest, RequestsRunConcurrentlyAndAnswersCarryTheirIds) {
  bridge_->Submit(R"({"id": 1, "method": "WaitParams", "request": {}})");
  bridge_->Submit(R"({"id": 2, "method": "GetStatus", "request": {}})");
  // GetStatus is answered while WaitParams still blocks in the daemon.
  EXPECT_EQ(lines_.Get(0)["id"], 2);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(lines_.size(), 1u);
  service_.Release();
  const Json waited = lines_.Get(1);
  EXPECT_EQ(waited["id"], 1);
  EXPECT_EQ(waited["response"]["waited_seconds"], 1.5);

  // Many at once: each answered exactly once, every line whole.
  constexpr int kRequests = 64;
  for (int i = 0; i < kRequests; ++i) {
    bridge_->Submit(absl::StrCat(R"({"id": )", 100 + i,
                                 R"(, "method": "Step", "request": {"step": )",
                                 i, "}}"));
  }
  bridge_->Drain();
  std::vector<int> seen(kRequests, 0);
  for (int i = 0; i < kRequests; ++i) {
    const Json line = lines_.Get(2 + i);
    const int k = line["id"].get<int>() - 100;
    ASSERT_TRUE(k >= 0 && k < kRequests) << line;
    ++seen[k];
    EXPECT_EQ(line["response"]["grad_norm"], static_cast<double>(k));
  }
  EXPECT_EQ(seen, std::vector<int>(kRequests, 1));
}

TEST_F(JsonBridgeTest, BytesTravelAsBase64BothWays) {
  bridge_->Submit(R"({"id": 1, "method": "ExportState", "request": {}})");
  const Json exported = lines_.Get(0);
  const std::string state = exported["response"]["state"];
  EXPECT_EQ(state.substr(0, 8), "AAECAwQF");  // 0x00 0x01 ... in base64
  EXPECT_EQ(exported["response"]["step"], "7");
  bridge_->Submit(absl::StrCat(
      R"({"id": 2, "method": "ImportState", "request": {"state": ")", state,
      R"(", "step": 7}})"));
  const Json imported = lines_.Get(1);
  ASSERT_TRUE(imported.contains("response")) << imported;
  EXPECT_EQ(imported["response"]["records"], 256);
}

TEST_F(JsonBridgeTest, TheJobTokenReachesTheDaemon) {
  bridge_->Submit(R"({"id": 5, "method": "GetStatus"})");
  EXPECT_EQ(lines_.Get(0)["response"]["version"], "Bearer secret");
}

TEST(JsonBridgeHelloTest, SaysWhetherTheDaemonAnswered) {
  const Json ok =
      Json::parse(JsonBridge::HelloLine(absl::OkStatus(), "unix:/s"));
  EXPECT_EQ(ok["id"], 0);
  EXPECT_EQ(ok["response"]["target"], "unix:/s");
  const Json failed = Json::parse(JsonBridge::HelloLine(
      absl::UnavailableError("cannot reach canzonad at unix:/s"), "unix:/s"));
  EXPECT_EQ(failed["id"], 0);
  EXPECT_EQ(failed["error"]["code"], "UNAVAILABLE");
  EXPECT_EQ(failed["error"]["message"], "cannot reach canzonad at unix:/s");
}

}  // namespace
}  // namespace canzona
