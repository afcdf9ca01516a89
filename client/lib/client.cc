#include "client/lib/client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "canzona/v1/optimizer_service.grpc.pb.h"
#include "proto/names/rank_names.h"
#include "proto/shared_memory/step_doorbell.h"

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

bool IsUnixTarget(const std::string& target) {
  return absl::StartsWith(target, "unix:") ||
         absl::StartsWith(target, "unix-abstract:");
}

// Options::tls_ca as PEM text: the text itself, or the file it names.
absl::StatusOr<std::string> CaPem(const std::string& tls_ca) {
  if (absl::StrContains(tls_ca, "-----BEGIN ")) return tls_ca;
  std::ifstream in(tls_ca);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in || !absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls_ca: cannot read a PEM certificate from '", tls_ca, "'"));
  }
  return text.str();
}

// A rank's doorbell: one call in it at a time.
struct DoorbellSlot {
  explicit DoorbellSlot(StepDoorbell bell) : bell(std::move(bell)) {}
  absl::Mutex mu;
  StepDoorbell bell ABSL_GUARDED_BY(mu);
};

}  // namespace

std::string DefaultTarget() {
  if (const char* runtime = std::getenv("XDG_RUNTIME_DIR");
      runtime != nullptr && *runtime != '\0') {
    return absl::StrCat("unix:", runtime, "/canzona/canzonad.sock");
  }
  return absl::StrCat("unix:/tmp/canzona-", ::getuid(), "/canzonad.sock");
}

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
  using Stub = canzona::v1::OptimizerService::Stub;

  Impl(std::string target, std::string job_token,
       std::shared_ptr<grpc::Channel> channel)
      : target(std::move(target)),
        authorization(job_token.empty() ? std::string()
                                        : absl::StrCat("Bearer ", job_token)),
        stub(canzona::v1::OptimizerService::NewStub(channel)) {}

  // One unary call with a deadline; every RPC goes through here.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(
      grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                   Response*),
      const Request& request, absl::Duration timeout) {
    grpc::ClientContext context;
    SetDeadline(context, timeout);
    if (!authorization.empty()) {
      context.AddMetadata("authorization", authorization);
    }
    Response response;
    grpc::Status status = (stub.get()->*method)(&context, request, &response);
    if (!status.ok()) return FromGrpc(status, target);
    return response;
  }

  // A step call (Step, GradReady, WaitParams): through the rank's doorbell
  // when one is attached, else over gRPC; the same answer either way.
  template <typename Request, typename Response>
  absl::StatusOr<Response> StepCall(
      StepDoorbell::Method doorbell_method,
      grpc::Status (Stub::*grpc_method)(grpc::ClientContext*, const Request&,
                                        Response*),
      const Request& request, absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu) {
    std::shared_ptr<DoorbellSlot> slot;
    {
      absl::MutexLock lock(&mu);
      auto it = doorbells.find(RankKey(request.job_id(), request.rank()));
      if (it != doorbells.end()) slot = it->second;
    }
    if (slot == nullptr) return Call(grpc_method, request, timeout);
    std::string bytes;
    if (!request.SerializeToString(&bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Request::descriptor()->name(), ": cannot serialize"));
    }
    absl::StatusOr<std::string> reply;
    {
      absl::MutexLock lock(&slot->mu);
      reply = slot->bell.Call(doorbell_method, bytes, absl::Now() + timeout);
    }
    if (!reply.ok()) return reply.status();
    Response response;
    if (!response.ParseFromString(*reply)) {
      return absl::InternalError(
          absl::StrCat("step doorbell: the daemon's answer is not a ",
                       Response::descriptor()->name()));
    }
    return response;
  }

  const std::string target;
  // "Bearer <job token>", sent with every call; empty: none.
  const std::string authorization;
  absl::Mutex mu;
  // By RankKey.
  std::map<std::string, std::shared_ptr<DoorbellSlot>> doorbells
      ABSL_GUARDED_BY(mu);
  std::unique_ptr<Stub> stub;
};

Client::Client(std::string target, Options options, std::unique_ptr<Impl> impl)
    : target_(std::move(target)),
      options_(std::move(options)),
      impl_(std::move(impl)) {}

Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    const std::string& target, Options options) {
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  const bool tls = !options.tls_ca.empty() && !IsUnixTarget(target);
  if (tls) {
    absl::StatusOr<std::string> ca = CaPem(options.tls_ca);
    if (!ca.ok()) return ca.status();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = *std::move(ca);
    credentials = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  // Responses come from the trainer's own daemon (plans, exported state):
  // no 4 MiB cap on them.
  args.SetMaxReceiveMessageSize(-1);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(target, credentials, args);
  if (!channel->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat(
        "cannot reach canzonad at ", target,
        tls ? " (is the daemon running, with TLS on that port and a "
              "certificate for this host signed by tls_ca?)"
            : " (is the daemon running?)"));
  }
  auto impl =
      std::make_unique<Impl>(target, options.job_token, std::move(channel));
  return std::unique_ptr<Client>(
      new Client(target, std::move(options), std::move(impl)));
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
      SharedMemory::Create(ShmName(job_id, global_rank, NextShmSeq()),
                           static_cast<uint64_t>(numel) * sizeof(float));
  if (!memory.ok()) return memory.status();
  return SharedTensor(*std::move(memory), std::move(shape));
}

absl::StatusOr<canzona::v1::RegisterResponse> Client::Register(
    canzona::v1::RegisterRequest request) {
  if (request.job_token().empty()) request.set_job_token(options_.job_token);
  return impl_->Call(&Impl::Stub::Register, request, options_.register_timeout);
}

absl::StatusOr<canzona::v1::StepResponse> Client::Step(
    const canzona::v1::StepRequest& request) {
  return impl_->StepCall(StepDoorbell::Method::kStep, &Impl::Stub::Step,
                         request, options_.step_timeout);
}

absl::Status Client::AttachStepDoorbell(
    const std::string& job_id, const canzona::v1::RankCoordinates& rank) {
  if (!IsUnixTarget(target_)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "AttachStepDoorbell: a step doorbell is shared memory on the "
        "daemon's node; ",
        target_, " is not its unix socket"));
  }
  // The name's rank field is past any world's ranks and unique per
  // process, and its seq unique per process (NextShmSeq), so it never takes
  // another object's name.
  constexpr int64_t kDoorbellRanks = int64_t{1} << 40;
  absl::StatusOr<StepDoorbell> bell = StepDoorbell::Create(
      ShmName(job_id, kDoorbellRanks + ::getpid(), NextShmSeq()));
  if (!bell.ok()) return bell.status();
  canzona::v1::AttachStepDoorbellRequest request;
  request.set_job_id(job_id);
  *request.mutable_rank() = rank;
  request.set_shm_name(bell->name());
  absl::Status attached =
      impl_->Call(&Impl::Stub::AttachStepDoorbell, request, absl::Seconds(30))
          .status();
  if (!attached.ok()) return attached;
  auto slot = std::make_shared<DoorbellSlot>(*std::move(bell));
  absl::MutexLock lock(&impl_->mu);
  impl_->doorbells[RankKey(job_id, rank)] = std::move(slot);
  return absl::OkStatus();
}

absl::StatusOr<canzona::v1::GetPlanResponse> Client::GetPlan(
    const std::string& job_id) {
  canzona::v1::GetPlanRequest request;
  request.set_job_id(job_id);
  return impl_->Call(&Impl::Stub::GetPlan, request, absl::Seconds(30));
}

absl::Status Client::Deregister(const std::string& job_id,
                                const canzona::v1::RankCoordinates& rank) {
  canzona::v1::DeregisterRequest request;
  request.set_job_id(job_id);
  request.set_job_token(options_.job_token);
  *request.mutable_rank() = rank;
  absl::Status status =
      impl_->Call(&Impl::Stub::Deregister, request, absl::Seconds(30)).status();
  if (status.ok()) {
    // The daemon detached the rank's doorbell: its next job steps over
    // gRPC until it attaches a new one.
    absl::MutexLock lock(&impl_->mu);
    impl_->doorbells.erase(RankKey(job_id, rank));
  }
  return status;
}

absl::StatusOr<canzona::v1::GetStatusResponse> Client::GetStatus() {
  return impl_->Call(&Impl::Stub::GetStatus, canzona::v1::GetStatusRequest(),
                     absl::Seconds(30));
}

absl::StatusOr<canzona::v1::SaveCheckpointResponse> Client::SaveCheckpoint(
    const std::string& job_id, const canzona::v1::RankCoordinates& rank,
    const std::string& dir, int64_t at_step) {
  canzona::v1::SaveCheckpointRequest request;
  request.set_job_id(job_id);
  *request.mutable_rank() = rank;
  request.set_dir(dir);
  request.set_at_step(at_step);
  return impl_->Call(&Impl::Stub::SaveCheckpoint, request,
                     options_.checkpoint_timeout);
}

absl::StatusOr<canzona::v1::LoadCheckpointResponse> Client::LoadCheckpoint(
    const std::string& job_id, const canzona::v1::RankCoordinates& rank,
    const std::string& dir, bool allow_missing) {
  canzona::v1::LoadCheckpointRequest request;
  request.set_job_id(job_id);
  *request.mutable_rank() = rank;
  request.set_dir(dir);
  request.set_allow_missing(allow_missing);
  return impl_->Call(&Impl::Stub::LoadCheckpoint, request,
                     options_.checkpoint_timeout);
}

int64_t Client::StatePartBytes() const {
  return options_.state_part_bytes > 0 ? options_.state_part_bytes
                                       : Options().state_part_bytes;
}

absl::StatusOr<canzona::v1::ExportStateResponse> Client::ExportStatePart(
    const canzona::v1::ExportStateRequest& request) {
  return impl_->Call(&Impl::Stub::ExportState, request,
                     options_.checkpoint_timeout);
}

absl::StatusOr<canzona::v1::ExportStateResponse> Client::ExportState(
    const std::string& job_id, const canzona::v1::RankCoordinates& rank) {
  canzona::v1::ExportStateRequest request;
  request.set_job_id(job_id);
  *request.mutable_rank() = rank;
  request.set_max_bytes(StatePartBytes());
  absl::StatusOr<canzona::v1::ExportStateResponse> whole =
      ExportStatePart(request);
  while (whole.ok() &&
         static_cast<int64_t>(whole->state().size()) < whole->total_bytes()) {
    request.set_offset(static_cast<int64_t>(whole->state().size()));
    absl::StatusOr<canzona::v1::ExportStateResponse> part =
        ExportStatePart(request);
    if (!part.ok()) return part.status();
    if (part->state().empty()) {
      return absl::DataLossError(
          absl::StrCat("ExportState: an empty part at offset ",
                       request.offset(), " of ", whole->total_bytes()));
    }
    whole->mutable_state()->append(part->state());
  }
  return whole;
}

absl::StatusOr<canzona::v1::ImportStateResponse> Client::ImportState(
    const canzona::v1::ImportStateRequest& request) {
  const int64_t total = static_cast<int64_t>(request.state().size());
  const int64_t part_bytes = StatePartBytes();
  if (request.offset() != 0 || request.total_bytes() != 0 ||
      total <= part_bytes) {
    return impl_->Call(&Impl::Stub::ImportState, request,
                       options_.checkpoint_timeout);
  }
  canzona::v1::ImportStateRequest part = request;
  part.set_total_bytes(total);
  absl::StatusOr<canzona::v1::ImportStateResponse> response;
  for (int64_t at = 0; at < total; at += part_bytes) {
    part.set_offset(at);
    part.set_state(request.state().substr(at, part_bytes));
    response = impl_->Call(&Impl::Stub::ImportState, part,
                           options_.checkpoint_timeout);
    if (!response.ok()) return response;
  }
  return response;
}

absl::Status Client::GradReady(const std::string& job_id,
                               const canzona::v1::RankCoordinates& rank,
                               int64_t step, absl::Span<const int> buckets) {
  canzona::v1::GradReadyRequest request;
  request.set_job_id(job_id);
  *request.mutable_rank() = rank;
  request.set_step(step);
  for (int b : buckets) request.add_buckets(b);
  return impl_
      ->StepCall(StepDoorbell::Method::kGradReady, &Impl::Stub::GradReady,
                 request, options_.step_timeout)
      .status();
}

absl::StatusOr<canzona::v1::WaitParamsResponse> Client::WaitParams(
    const std::string& job_id, const canzona::v1::RankCoordinates& rank,
    int64_t step, int bucket) {
  canzona::v1::WaitParamsRequest request;
  request.set_job_id(job_id);
  *request.mutable_rank() = rank;
  request.set_step(step);
  request.set_bucket(bucket);
  return impl_->StepCall(StepDoorbell::Method::kWaitParams,
                         &Impl::Stub::WaitParams, request,
                         options_.step_timeout);
}

}  // namespace canzona
