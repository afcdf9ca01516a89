// A thin virtual interface over exactly the NCCL and CUDA runtime calls the
// NCCL communicator (nccl_communicator.h) makes, so that the communicator's
// plan-to-call translation, its waits and its failure handling are tested
// without a GPU against a fake (tests/unit/comm/fake_nccl_api.h) that records
// every call, and run on a GPU against the real library.
//
//   CANZONA_ASSIGN_OR_RETURN(NcclApi* api, RealNcclApi());
//   CANZONA_ASSIGN_OR_RETURN(NcclUniqueId id, api->GetUniqueId());
//   CANZONA_RETURN_IF_ERROR(api->SetDevice(0));
//   CANZONA_ASSIGN_OR_RETURN(NcclComm comm, api->CommInitRank(2, id, rank));
//
// Every method maps one call 1:1 (ncclReduce, cudaEventQuery, ...) and turns
// its result code into an absl::Status (kernels/base/cuda_status.h). Counts
// are element counts of `dtype`; every reduction is a sum. The handle types
// are the CUDA / NCCL ones (cudaStream_t is `CUstream_st*`, ncclComm_t is
// `ncclComm*`), declared here without the CUDA headers so that this header,
// the communicator and the fake build without CUDA.
//
// Thread-safety: the real implementation is as thread-safe as NCCL and the
// CUDA runtime (group state is per thread; one communicator must not be used
// by two threads at once). The fake is thread-safe.
#ifndef CANZONA_SERVER_COMM_NCCL_API_H_
#define CANZONA_SERVER_COMM_NCCL_API_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct CUstream_st;
struct CUevent_st;
struct ncclComm;

namespace canzona {

using NcclStream = CUstream_st*;  // == cudaStream_t
using NcclEvent = CUevent_st*;    // == cudaEvent_t
using NcclComm = ncclComm*;       // == ncclComm_t

// == ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128 opaque bytes).
struct NcclUniqueId {
  std::array<char, 128> bytes{};

  // Lower-case hex (256 characters): safe in any KvStore value.
  std::string ToHex() const;
  // INVALID_ARGUMENT unless `hex` is exactly 256 hex digits.
  static absl::StatusOr<NcclUniqueId> FromHex(const std::string& hex);
};

enum class NcclDataType { kFloat32 };  // ncclFloat32

const char* NcclDataTypeName(NcclDataType dtype);

class NcclApi {
 public:
  virtual ~NcclApi() = default;

  // --- NCCL ---
  virtual absl::StatusOr<NcclUniqueId> GetUniqueId() = 0;
  // Blocks (outside a group) until all `nranks` ranks have called it with
  // `id`; inside ncclGroupStart/End it returns at once and the group's end
  // completes the initialization. Uses the calling thread's current device.
  virtual absl::StatusOr<NcclComm> CommInitRank(int nranks,
                                                const NcclUniqueId& id,
                                                int rank) = 0;
  virtual absl::Status GroupStart() = 0;
  virtual absl::Status GroupEnd() = 0;
  // ncclReduce with ncclSum: `recv` is used on `root` only.
  virtual absl::Status Reduce(const void* send, void* recv, int64_t count,
                              NcclDataType dtype, int root, NcclComm comm,
                              NcclStream stream) = 0;
  // ncclBroadcast: `send` is used on `root` only.
  virtual absl::Status Broadcast(const void* send, void* recv, int64_t count,
                                 NcclDataType dtype, int root, NcclComm comm,
                                 NcclStream stream) = 0;
  // ncclReduceScatter with ncclSum: `send` holds nranks * recv_count.
  virtual absl::Status ReduceScatter(const void* send, void* recv,
                                     int64_t recv_count, NcclDataType dtype,
                                     NcclComm comm, NcclStream stream) = 0;
  // ncclAllGather: `recv` receives nranks * send_count.
  virtual absl::Status AllGather(const void* send, void* recv,
                                 int64_t send_count, NcclDataType dtype,
                                 NcclComm comm, NcclStream stream) = 0;
  // ncclAllReduce with ncclSum.
  virtual absl::Status AllReduce(const void* send, void* recv, int64_t count,
                                 NcclDataType dtype, NcclComm comm,
                                 NcclStream stream) = 0;
  virtual absl::Status Send(const void* send, int64_t count, NcclDataType dtype,
                            int peer, NcclComm comm, NcclStream stream) = 0;
  virtual absl::Status Recv(void* recv, int64_t count, NcclDataType dtype,
                            int peer, NcclComm comm, NcclStream stream) = 0;
  // ncclCommGetAsyncError: OK while the communicator has no asynchronous
  // error (ncclSuccess or ncclInProgress), else the error with NCCL's
  // message (ncclGetErrorString and ncclGetLastError).
  virtual absl::Status CommGetAsyncError(NcclComm comm) = 0;
  virtual absl::Status CommAbort(NcclComm comm) = 0;
  virtual absl::Status CommDestroy(NcclComm comm) = 0;

  // --- CUDA runtime ---
  virtual absl::Status SetDevice(int device) = 0;
  // cudaEventCreateWithFlags(cudaEventDisableTiming).
  virtual absl::StatusOr<NcclEvent> EventCreate() = 0;
  virtual absl::Status EventDestroy(NcclEvent event) = 0;
  virtual absl::Status EventRecord(NcclEvent event, NcclStream stream) = 0;
  // cudaEventQuery: true when the work before the recorded event is done,
  // false while it is not (cudaErrorNotReady).
  virtual absl::StatusOr<bool> EventQuery(NcclEvent event) = 0;
  // cudaMalloc / cudaFree of device memory on the current device.
  virtual absl::StatusOr<void*> Malloc(int64_t bytes) = 0;
  virtual absl::Status Free(void* ptr) = 0;
  // cudaStreamCreateWithFlags(cudaStreamNonBlocking) on the current
  // device / cudaStreamDestroy.
  virtual absl::StatusOr<NcclStream> StreamCreate() = 0;
  virtual absl::Status StreamDestroy(NcclStream stream) = 0;
  // cudaStreamWaitEvent: work enqueued on `stream` later waits for `event`
  // (which may be another process's, opened with cudaIpcOpenEventHandle)
  // on the device, without blocking the host.
  virtual absl::Status StreamWaitEvent(NcclStream stream, NcclEvent event) = 0;
  // cudaMemcpyAsync(cudaMemcpyDefault): device or host memory on either
  // side (unified addressing) / cudaMemsetAsync.
  virtual absl::Status MemcpyAsync(void* dst, const void* src, int64_t bytes,
                                   NcclStream stream) = 0;
  virtual absl::Status MemsetAsync(void* dst, int value, int64_t bytes,
                                   NcclStream stream) = 0;
};

// The process-wide implementation over libnccl and the CUDA runtime (never
// destroyed). FAILED_PRECONDITION in builds without CUDA
// (CANZONA_ENABLE_CUDA=OFF).
absl::StatusOr<NcclApi*> RealNcclApi();

}  // namespace canzona

#endif  // CANZONA_SERVER_COMM_NCCL_API_H_
