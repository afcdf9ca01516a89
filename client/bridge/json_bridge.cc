#include "client/bridge/json_bridge.h"

#include <map>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;

// One OptimizerService method: the request's JSON in, the response's out.
using Handler =
    std::function<absl::StatusOr<std::string>(Client&, const std::string&)>;

absl::Status ParseRequest(const std::string& json,
                          google::protobuf::Message* request) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status =
      google::protobuf::util::JsonStringToMessage(json, request, options);
  if (status.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("request: ", std::string(status.message())));
}

std::string PrintResponse(const google::protobuf::Message& response) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(response, &out, options);
  return out;
}

// `call(client, request)` returns absl::StatusOr<Response>.
template <typename Request, typename Call>
Handler Method(Call call) {
  return [call](Client& client,
                const std::string& json) -> absl::StatusOr<std::string> {
    Request request;
    CANZONA_RETURN_IF_ERROR(ParseRequest(json, &request));
    CANZONA_ASSIGN_OR_RETURN(auto response, call(client, request));
    return PrintResponse(response);
  };
}

// The methods whose Client call returns only a status answer their empty
// response message.
template <typename Response>
absl::StatusOr<Response> Empty(const absl::Status& status) {
  if (!status.ok()) return status;
  return Response();
}

const std::map<std::string, Handler>& Methods() {
  static const auto* methods = new std::map<std::string, Handler>{
      {"Register",
       Method<v1::RegisterRequest>([](Client& c, const v1::RegisterRequest& r) {
         return c.Register(r);
       })},
      {"Step", Method<v1::StepRequest>([](Client& c, const v1::StepRequest& r) {
         return c.Step(r);
       })},
      {"GetPlan",
       Method<v1::GetPlanRequest>([](Client& c, const v1::GetPlanRequest& r) {
         return c.GetPlan(r.job_id());
       })},
      {"Deregister", Method<v1::DeregisterRequest>(
                         [](Client& c, const v1::DeregisterRequest& r) {
                           return Empty<v1::DeregisterResponse>(
                               c.Deregister(r.job_id(), r.rank()));
                         })},
      {"GetStatus",
       Method<v1::GetStatusRequest>([](Client& c, const v1::GetStatusRequest&) {
         return c.GetStatus();
       })},
      {"SaveCheckpoint", Method<v1::SaveCheckpointRequest>(
                             [](Client& c, const v1::SaveCheckpointRequest& r) {
                               return c.SaveCheckpoint(r.job_id(), r.rank(),
                                                       r.dir(), r.at_step());
                             })},
      {"LoadCheckpoint", Method<v1::LoadCheckpointRequest>(
                             [](Client& c, const v1::LoadCheckpointRequest& r) {
                               return c.LoadCheckpoint(r.job_id(), r.rank(),
                                                       r.dir(),
                                                       r.allow_missing());
                             })},
      {"ExportState", Method<v1::ExportStateRequest>(
                          [](Client& c, const v1::ExportStateRequest& r) {
                            return c.ExportStatePart(r);
                          })},
      {"ImportState", Method<v1::ImportStateRequest>(
                          [](Client& c, const v1::ImportStateRequest& r) {
                            return c.ImportState(r);
                          })},
      {"GradReady",
       Method<v1::GradReadyRequest>(
           [](Client& c, const v1::GradReadyRequest& r) {
             return Empty<v1::GradReadyResponse>(c.GradReady(
                 r.job_id(), r.rank(), r.step(),
                 std::vector<int>(r.buckets().begin(), r.buckets().end())));
           })},
      {"WaitParams", Method<v1::WaitParamsRequest>(
                         [](Client& c, const v1::WaitParamsRequest& r) {
                           return c.WaitParams(r.job_id(), r.rank(), r.step(),
                                               r.bucket());
                         })},
  };
  return *methods;
}

template <typename Json>
std::string Dump(const Json& j) {
  // Invalid UTF-8 (from a status message) is replaced, not thrown on.
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string ErrorLine(const nlohmann::json& id, const absl::Status& status) {
  // Ordered: "id" first, as in response lines.
  return Dump(nlohmann::ordered_json{
      {"id", id},
      {"error",
       {{"code", absl::StatusCodeToString(status.code())},
        {"message", std::string(status.message())}}}});
}

std::string ResponseLine(int64_t id, const std::string& response_json) {
  return absl::StrCat("{\"id\":", id, ",\"response\":", response_json, "}");
}

}  // namespace

JsonBridge::JsonBridge(Client& client, LineWriter write)
    : client_(client), write_(std::move(write)) {}

JsonBridge::~JsonBridge() {
  std::vector<std::thread> workers;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &JsonBridge::Idle));
    stopping_ = true;
    workers.swap(workers_);
  }
  for (std::thread& worker : workers) worker.join();
}

std::string JsonBridge::HelloLine(const absl::Status& connected,
                                  const std::string& target) {
  if (!connected.ok()) return ErrorLine(0, connected);
  return ResponseLine(0, Dump(nlohmann::json{{"target", target}}));
}

void JsonBridge::Submit(std::string_view line) {
  const nlohmann::json envelope =
      nlohmann::json::parse(line.begin(), line.end(), nullptr,
                            /*allow_exceptions=*/false);
  auto reject = [&](const nlohmann::json& id, const std::string& why) {
    Write(ErrorLine(id, absl::InvalidArgumentError(why)));
  };
  if (!envelope.is_object()) {
    return reject(nullptr, "line: not a JSON object");
  }
  const auto id = envelope.find("id");
  if (id == envelope.end() || !id->is_number_integer()) {
    return reject(nullptr, "id: missing or not an integer");
  }
  const auto method = envelope.find("method");
  if (method == envelope.end() || !method->is_string()) {
    return reject(*id, "method: missing or not a string");
  }
  const std::string name = method->get<std::string>();
  if (Methods().count(name) == 0) {
    std::vector<std::string> known;
    for (const auto& [known_name, unused] : Methods()) {
      known.push_back(known_name);
    }
    return reject(*id,
                  absl::StrCat("method: unknown method \"", name, "\" (one of ",
                               absl::StrJoin(known, ", "), ")"));
  }
  const auto request = envelope.find("request");
  if (request != envelope.end() && !request->is_object()) {
    return reject(*id, "request: not a JSON object");
  }
  Request job{id->get<int64_t>(), name,
              request == envelope.end() ? "{}" : Dump(*request)};
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(job));
  ++in_flight_;
  if (static_cast<int>(queue_.size()) > available_) {
    ++available_;
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

void JsonBridge::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(this, &JsonBridge::Idle));
}

void JsonBridge::WorkerLoop() {
  while (true) {
    Request request;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &JsonBridge::HasWork));
      if (queue_.empty()) return;  // stopping
      request = std::move(queue_.front());
      queue_.pop_front();
      --available_;
    }
    Answer(request);
    absl::MutexLock lock(&mu_);
    ++available_;
    --in_flight_;
  }
}

void JsonBridge::Answer(const Request& request) {
  const absl::StatusOr<std::string> response =
      Methods().at(request.method)(client_, request.json);
  Write(response.ok() ? ResponseLine(request.id, *response)
                      : ErrorLine(request.id, response.status()));
}

void JsonBridge::Write(std::string_view line) {
  absl::MutexLock lock(&write_mu_);
  write_(line);
}

}  // namespace canzona
