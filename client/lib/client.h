// canzona::Client: what a C++ trainer rank links to talk to the canzonad on
// its node. Parameters and gradients live in shared buffers the client
// allocates and the daemon maps, so a step moves no tensor bytes over gRPC.
//
//   CANZONA_ASSIGN_OR_RETURN(auto client, canzona::Client::Connect(
//       "unix:/run/user/1000/canzona/canzonad.sock"));
//   CANZONA_ASSIGN_OR_RETURN(canzona::SharedTensor w,
//       client->AllocateTensor("layer0.w", {rows, cols}));
//   ... fill w.data(), then describe it in a RegisterRequest with
//   w.buffer_ref() for the parameter (and another tensor for its gradient)
//   CANZONA_RETURN_IF_ERROR(client->Register(request).status());
//   for (int64_t k = 1; ; ++k) {
//     ... backward writes the gradient tensors ...
//     CANZONA_ASSIGN_OR_RETURN(auto result, client->Step(job, rank, k));
//   }
//
// Thread-safety: a Client is thread-safe (gRPC stubs are; a rank's step
// doorbell carries one call at a time); SharedTensors are plain memory
// owned by the caller.
#ifndef CANZONA_CLIENT_LIB_CLIENT_H_
#define CANZONA_CLIENT_LIB_CLIENT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "proto/shared_memory/shared_memory.h"

namespace canzona {

// A float32 tensor in shared memory: the trainer reads and writes it in
// place; the daemon maps the same bytes.
class SharedTensor {
 public:
  SharedTensor(SharedMemory memory, std::vector<int64_t> shape)
      : memory_(std::move(memory)), shape_(std::move(shape)) {}

  float* data() const { return static_cast<float*>(memory_.data()); }
  int64_t numel() const {
    return static_cast<int64_t>(memory_.size() / sizeof(float));
  }
  absl::Span<float> span() const {
    return absl::Span<float>(data(), static_cast<size_t>(numel()));
  }
  const std::vector<int64_t>& shape() const { return shape_; }
  // The reference to put in a RegisterRequest's Parameter.
  canzona::v1::BufferRef buffer_ref() const;

 private:
  SharedMemory memory_;
  std::vector<int64_t> shape_;
};

// The local daemon's address: its unix socket (canzonad's default
// --unix-socket), "unix:$XDG_RUNTIME_DIR/canzona/canzonad.sock", else
// "unix:/tmp/canzona-<uid>/canzonad.sock".
std::string DefaultTarget();

class Client {
 public:
  struct Options {
    // The job token: sent in Register and Deregister, and, when non-empty,
    // with every call as "authorization: Bearer <token>" metadata (what a
    // daemon's TCP port requires when it has a token; its unix socket
    // authenticates by SO_PEERCRED and ignores the metadata).
    std::string job_token;
    // TLS for TCP targets: the CA certificate(s) that signed the daemon's
    // --tls-cert, either PEM text (anything containing "-----BEGIN ") or
    // the path of a PEM file. Empty: plaintext. Not used for "unix:"
    // targets (the unix socket never uses TLS).
    std::string tls_ca;
    absl::Duration connect_timeout = absl::Seconds(10);
    // Deadline of Register (which waits for every rank of the job) and of
    // Step (which waits for every peer of the step).
    absl::Duration register_timeout = absl::Minutes(10);
    absl::Duration step_timeout = absl::Minutes(10);
    // ExportState / ImportState move a rank's state in parts of this size.
    int64_t state_part_bytes = int64_t{32} << 20;
    // Deadline of checkpoint save / load and state export / import.
    absl::Duration checkpoint_timeout = absl::Minutes(30);
  };

  // `target`: "unix:/path/to.sock" or "host:port". UNAVAILABLE with
  // "cannot reach canzonad at <target>" when no daemon answers in time
  // (which includes a TLS handshake failing: a TLS port without tls_ca, a
  // certificate tls_ca did not sign or that does not name the host);
  // INVALID_ARGUMENT "tls_ca: ..." when tls_ca cannot be read.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& target, Options options);
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& target) {
    return Connect(target, Options());
  }
  ~Client();

  // Allocates a zero-filled float32 shared tensor named after the job and
  // rank (names "/canzona.<job>.<rank>.<seq>", seq unique to this process:
  // NextShmSeq).
  absl::StatusOr<SharedTensor> AllocateTensor(const std::string& job_id,
                                              int64_t global_rank,
                                              std::vector<int64_t> shape);

  absl::StatusOr<canzona::v1::RegisterResponse> Register(
      canzona::v1::RegisterRequest request);
  // Through the rank's step doorbell when one is attached (the same
  // request, checks and answer), over gRPC otherwise.
  absl::StatusOr<canzona::v1::StepResponse> Step(
      const canzona::v1::StepRequest& request);
  // Creates a step doorbell (proto/shared_memory/step_doorbell.h) for this rank of a
  // registered job and hands it to the daemon: later Step, GradReady and
  // WaitParams calls of the rank skip gRPC (two futex wake-ups instead of a
  // unary call completed from the daemon's worker; the step's fixed cost in
  // tests/bench/RESULTS.md, "The step's fixed overhead"). Only on the
  // daemon's unix socket (FAILED_PRECONDITION on TCP); a second call replaces the rank's doorbell,
  // Deregister drops it.
  absl::Status AttachStepDoorbell(const std::string& job_id,
                                  const canzona::v1::RankCoordinates& rank);
  absl::StatusOr<canzona::v1::GetPlanResponse> GetPlan(
      const std::string& job_id);
  absl::Status Deregister(const std::string& job_id,
                          const canzona::v1::RankCoordinates& rank);
  absl::StatusOr<canzona::v1::GetStatusResponse> GetStatus();

  // Collective over the job: every rank calls it between the same steps
  // (at_step 0), or right after step at_step (an operator's save).
  absl::StatusOr<canzona::v1::SaveCheckpointResponse> SaveCheckpoint(
      const std::string& job_id, const canzona::v1::RankCoordinates& rank,
      const std::string& dir, int64_t at_step = 0);
  // `allow_missing`: LoadCheckpointRequest.allow_missing.
  absl::StatusOr<canzona::v1::LoadCheckpointResponse> LoadCheckpoint(
      const std::string& job_id, const canzona::v1::RankCoordinates& rank,
      const std::string& dir, bool allow_missing = false);
  // This rank's view of the state (state_dict) and its way back, whole:
  // both move it in parts of `state_part_bytes` (the daemon receives 64 MiB
  // per message by default). ImportState sends a request that names
  // offset or total_bytes as it is (one part of the caller's own).
  absl::StatusOr<canzona::v1::ExportStateResponse> ExportState(
      const std::string& job_id, const canzona::v1::RankCoordinates& rank);
  absl::StatusOr<canzona::v1::ImportStateResponse> ImportState(
      const canzona::v1::ImportStateRequest& request);
  // One part of an export (ExportStateRequest.offset, max_bytes).
  absl::StatusOr<canzona::v1::ExportStateResponse> ExportStatePart(
      const canzona::v1::ExportStateRequest& request);

  // Overlap (optimizer_service.proto): tell the daemon that backward has
  // finished these buckets of step `step` (RegisterResponse.buckets), and
  // wait for a bucket's updated parameters (-1: all) after an
  // async_params Step. Like Step, through the rank's doorbell when one is
  // attached.
  absl::Status GradReady(const std::string& job_id,
                         const canzona::v1::RankCoordinates& rank, int64_t step,
                         absl::Span<const int> buckets);
  absl::StatusOr<canzona::v1::WaitParamsResponse> WaitParams(
      const std::string& job_id, const canzona::v1::RankCoordinates& rank,
      int64_t step, int bucket);

  const std::string& target() const { return target_; }

 private:
  class Impl;
  // Options::state_part_bytes, or its default where it is not positive.
  int64_t StatePartBytes() const;
  Client(std::string target, Options options, std::unique_ptr<Impl> impl);

  const std::string target_;
  const Options options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace canzona

#endif  // CANZONA_CLIENT_LIB_CLIENT_H_
