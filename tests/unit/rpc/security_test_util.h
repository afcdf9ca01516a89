// Helpers shared by the security tests (tests/unit/rpc and
// tests/integration): a tiny job whose buffers the client allocates, and
// raw gRPC calls with chosen metadata to any method by name.
//
//   ASSERT_OK_AND_ASSIGN(TinyJob job, MakeTinyJob(*client, "j1", 1, 0));
//   ASSERT_OK(client->Register(job.request).status());
//   grpc::Status s = RawCall(channel, "/canzona.v1.OptimizerService/Step",
//                            {{"authorization", "Bearer t"}});
//
// Thread-safety: plain functions; a TinyJob belongs to one thread.
#ifndef CANZONA_TESTS_UNIT_RPC_SECURITY_TEST_UTIL_H_
#define CANZONA_TESTS_UNIT_RPC_SECURITY_TEST_UTIL_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "client/lib/client.h"

namespace canzona::security_test {

// A DP-only AdamW job of `params` vectors of `numel` floats; one rank's
// request with buffers allocated through `client` (kept in `tensors`).
struct TinyJob {
  std::vector<SharedTensor> tensors;
  canzona::v1::RegisterRequest request;
};

inline absl::StatusOr<TinyJob> MakeTinyJob(Client& client,
                                           const std::string& job_id, int dp,
                                           int dp_rank, int params = 1,
                                           int64_t numel = 16) {
  TinyJob job;
  canzona::v1::RegisterRequest& r = job.request;
  r.set_job_id(job_id);
  r.mutable_layout()->set_pp(1);
  r.mutable_layout()->set_dp(dp);
  r.mutable_layout()->set_tp(1);
  r.mutable_rank()->set_dp_rank(dp_rank);
  canzona::v1::OptimizerGroup* group = r.add_groups();
  group->set_name("adamw");
  group->set_optimizer("adamw");
  for (int i = 0; i < params; ++i) {
    canzona::v1::Parameter* p = r.add_parameters();
    p->set_name(absl::StrCat("p", i));
    p->add_shape(numel);
    p->set_dtype(canzona::v1::DTYPE_FLOAT32);
    p->set_tp_split_dim(-1);
    p->set_group("adamw");
    for (bool grad : {false, true}) {
      absl::StatusOr<SharedTensor> tensor =
          client.AllocateTensor(job_id, dp_rank, {numel});
      if (!tensor.ok()) return tensor.status();
      for (float& x : tensor->span()) x = grad ? 0.5f : 1.0f;
      *(grad ? p->mutable_grad() : p->mutable_param()) = tensor->buffer_ref();
      job.tensors.push_back(*std::move(tensor));
    }
  }
  return job;
}

inline canzona::v1::StepRequest TinyStep(
    const canzona::v1::RegisterRequest& request, int64_t step) {
  canzona::v1::StepRequest s;
  s.set_job_id(request.job_id());
  *s.mutable_rank() = request.rank();
  s.set_step(step);
  return s;
}

// One unary call of `method` ("/package.Service/Method") with an empty
// request message and `metadata`; the call's status.
inline grpc::Status RawCall(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
    const std::vector<std::pair<std::string, std::string>>& metadata,
    std::chrono::seconds timeout = std::chrono::seconds(10)) {
  grpc::GenericStub stub(channel);
  grpc::ByteBuffer request;  // the empty message
  grpc::Slice empty;
  request = grpc::ByteBuffer(&empty, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  for (const auto& [key, value] : metadata) context.AddMetadata(key, value);
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status status) { done.set_value(status); });
  return done.get_future().get();
}

}  // namespace canzona::security_test

#endif  // CANZONA_TESTS_UNIT_RPC_SECURITY_TEST_UTIL_H_
