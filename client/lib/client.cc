#include "client/lib/client.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "canzona/v1/optimizer_service.grpc.pb.h"

namespace canzona {
namespace {

absl::Status FromGrpc(const grpc::Status& status, const std::string& target) {
  if (status.ok()) return absl::OkStatus();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return absl::UnavailableError(absl::StrCat(
        "cannot reach canzonad at ", target, ": ", status.error_message()));
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

void SetDeadline(grpc::ClientContext& context, absl::Duration timeout) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace

canzona::v1::BufferRef SharedTensor::buffer_ref() const {
  canzona::v1::BufferRef ref;
  canzona::v1::ShmBufferRef* shm = ref.mutable_shm();
  shm->set_name(memory_.name());
  shm->set_offset(0);
  shm->set_bytes(memory_.size());
  return ref;
}

class Client::Impl {
 public:
  explicit Impl(std::shared_ptr<grpc::Channel> channel)
      : stub(canzona::v1::OptimizerService::NewStub(channel)) {}
  std::unique_ptr<canzona::v1::OptimizerService::Stub> stub;
};

Client::Client(std::string target, Options options, std::unique_ptr<Impl> impl)
    : target_(std::move(target)),
      options_(std::move(options)),
      impl_(std::move(impl)) {}

Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    const std::string& target, Options options) {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat(
        "cannot reach canzonad at ", target, " (is the daemon running?)"));
  }
  return std::unique_ptr<Client>(new Client(
      target, std::move(options), std::make_unique<Impl>(std::move(channel))));
}

absl::StatusOr<SharedTensor> Client::AllocateTensor(
    const std::string& job_id, int64_t global_rank,
    std::vector<int64_t> shape) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape: dimensions must be > 0, got ", d));
    }
    numel *= d;
  }
  absl::StatusOr<SharedMemory> memory =
      SharedMemory::Create(ShmName(job_id, global_rank, next_seq_++),
                           static_cast<uint64_t>(numel) * sizeof(float));
  if (!memory.ok()) return memory.status();
  return SharedTensor(*std::move(memory), std::move(shape));
}

absl::StatusOr<canzona::v1::RegisterResponse> Client::Register(
    canzona::v1::RegisterRequest request) {
  if (request.job_token().empty()) request.set_job_token(options_.job_token);
  grpc::ClientContext context;
  SetDeadline(context, options_.register_timeout);
  canzona::v1::RegisterResponse response;
  grpc::Status status = impl_->stub->Register(&context, request, &response);
  if (!status.ok()) return FromGrpc(status, target_);
  return response;
}

absl::StatusOr<canzona::v1::StepResponse> Client::Step(
    const canzona::v1::StepRequest& request) {
  grpc::ClientContext context;
  SetDeadline(context, options_.step_timeout);
  canzona::v1::StepResponse response;
  grpc::Status status = impl_->stub->Step(&context, request, &response);
  if (!status.ok()) return FromGrpc(status, target_);
  return response;
}

absl::StatusOr<canzona::v1::GetPlanResponse> Client::GetPlan(
    const std::string& job_id) {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(30));
  canzona::v1::GetPlanRequest request;
  request.set_job_id(job_id);
  canzona::v1::GetPlanResponse response;
  grpc::Status status = impl_->stub->GetPlan(&context, request, &response);
  if (!status.ok()) return FromGrpc(status, target_);
  return response;
}

absl::Status Client::Deregister(const std::string& job_id,
                                const canzona::v1::RankCoordinates& rank) {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(30));
  canzona::v1::DeregisterRequest request;
  request.set_job_id(job_id);
  request.set_job_token(options_.job_token);
  *request.mutable_rank() = rank;
  canzona::v1::DeregisterResponse response;
  return FromGrpc(impl_->stub->Deregister(&context, request, &response),
                  target_);
}

absl::StatusOr<canzona::v1::GetStatusResponse> Client::GetStatus() {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(30));
  canzona::v1::GetStatusResponse response;
  grpc::Status status = impl_->stub->GetStatus(
      &context, canzona::v1::GetStatusRequest(), &response);
  if (!status.ok()) return FromGrpc(status, target_);
  return response;
}

}  // namespace canzona
